"""Zigzag sequence layout: which tokens each TSP rank holds.

The (padded) sequence of length S is cut into 2D equal chunks of c = S/(2D) tokens; rank p holds
chunks p and 2D-1-p, in that order. Under a causal mask every rank then does the same attention
work. Each local token keeps its global position, which RoPE and the causal test use.

Sequences whose length is not a multiple of 2D are right-padded up to the next multiple. Padded
tokens sit at the end of the sequence, so under the causal mask no real token ever attends to them;
their labels must be ignored (``-100``), which ``pad_sequence`` does for label tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Span:
    """Consecutive tokens at local offset ``offset`` with global positions ``[start, stop)``.

    As queries, they see the keys at positions ``[first_key, own position]``: ``first_key`` is 0
    in one causal stream, the start of their document in a packed row
    (``engine.sharding.documents``).
    """

    offset: int
    start: int
    length: int
    first_key: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.length


def chunk_owner(j: int, D: int) -> tuple[int, int]:
    """``(rank, slot)`` holding global chunk j of the zigzag layout (slot 0: first local chunk)."""
    return (j, 0) if j < D else (2 * D - 1 - j, 1)


@dataclass(frozen=True)
class RowSpans:
    """Query spans that differ between batch rows (packed rows with different documents):
    ``rows[b]`` are the spans of batch row b."""

    rows: tuple[tuple[Span, ...], ...]


@dataclass(frozen=True)
class ZigzagLayout:
    """Zigzag partition of a padded sequence of ``seq_len`` tokens over ``size`` ranks.

    Args:
        seq_len: padded sequence length S; must be a multiple of ``2 * size``.
        size: TSP axis size D.
    """

    seq_len: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"TSP size must be >= 1, got {self.size}")
        if self.seq_len <= 0 or self.seq_len % (2 * self.size):
            raise ValueError(
                f"sequence length {self.seq_len} is not a positive multiple of 2*tsp_size="
                f"{2 * self.size}; shard the batch with tsp_ext.shard_batch, which pads it (or "
                "pad with tsp_ext.pad_sequence)"
            )

    @classmethod
    def from_local(cls, local_len: int, size: int) -> ZigzagLayout:
        """The layout whose per-rank length is ``local_len`` (= S/D)."""
        if local_len <= 0 or local_len % 2:
            raise ValueError(
                f"local sequence length {local_len} must be even and positive: a zigzag shard "
                "holds two equal chunks (shard the batch with tsp_ext.shard_batch)"
            )
        return cls(local_len * size, size)

    @property
    def chunk(self) -> int:
        """Tokens per chunk, c = S / (2D)."""
        return self.seq_len // (2 * self.size)

    @property
    def local_len(self) -> int:
        """Tokens per rank, S / D."""
        return self.seq_len // self.size

    def chunks(self, p: int) -> tuple[int, int]:
        """The two chunk indices rank ``p`` holds."""
        if not 0 <= p < self.size:
            raise ValueError(f"rank {p} is outside the TSP axis of size {self.size}")
        return p, 2 * self.size - 1 - p

    def spans(self, p: int) -> tuple[Span, Span]:
        """Rank ``p``'s tokens as two contiguous spans of global positions."""
        c = self.chunk
        return tuple(Span(i * c, j * c, c) for i, j in enumerate(self.chunks(p)))

    def positions(self, p: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global position ids of rank ``p``'s tokens, ``[S/D]`` int64."""
        return torch.cat([torch.arange(s.start, s.stop, device=device) for s in self.spans(p)])

    def gathered_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of an all-gathered sequence, ``[S]`` int64."""
        return torch.cat([self.positions(q, device) for q in range(self.size)])

    def shard(self, x: torch.Tensor, p: int, dim: int = 1) -> torch.Tensor:
        """Copy of rank ``p``'s tokens of a full tensor: ``[.., S, ..]`` -> ``[.., S/D, ..]``."""
        self._check_len(x, dim, self.seq_len)
        return torch.cat([x.narrow(dim, s.start, s.length) for s in self.spans(p)], dim=dim)

    def unshard(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Reorder an all-gathered tensor (rank-major) back to original token order."""
        self._check_len(gathered, dim, self.seq_len)
        order = torch.argsort(self.gathered_positions(gathered.device))
        return gathered.index_select(dim, order)

    @staticmethod
    def _check_len(x: torch.Tensor, dim: int, n: int) -> None:
        if x.shape[dim] != n:
            raise ValueError(f"expected {n} tokens along dim {dim}, got shape {tuple(x.shape)}")


def padded_length(seq_len: int, size: int) -> int:
    """Smallest multiple of ``2 * size`` that is >= ``seq_len``."""
    m = 2 * size
    return -(-seq_len // m) * m


def pad_sequence(x: torch.Tensor, size: int, value: float, dim: int = 1) -> torch.Tensor:
    """Right-pad ``x`` along ``dim`` with ``value`` up to ``padded_length``; no copy if aligned.

    Use ``IGNORE_INDEX`` for labels so padded tokens never enter the loss.
    """
    n = x.shape[dim]
    extra = padded_length(n, size) - n
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)
