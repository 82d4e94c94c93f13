"""Packed documents: a rank's query spans cut where documents start.

A packed row holds several documents back to back; its ``position_ids`` restart at 0 on each
document's first token and count up by one inside it (Hugging Face's ``DataCollatorWithFlattening``
convention; one causal stream is the special case of a single document). A token at global
position g with position id i belongs to the document that starts at g - i and attends to the
keys ``[g - i, g]``: causally inside its document, never across. Documents are contiguous, so
cutting a zigzag chunk where a document starts gives spans whose queries share their first key
(``Span.first_key``); the chunked kernels run each as one prefix call over ``[first_key,
start)`` and one causal diagonal call, and no call touches another document's keys.

Every rank checks and derives its spans from its own position ids (``local_error``,
``query_spans``); ``check_chunks`` verifies with one small all-gather that the ranks' chunks fit
together (each chunk continues the document of the chunk before it or starts a new one).
"""

from __future__ import annotations

import torch

from ..parallel import comm
from .layout import RowSpans, Span, ZigzagLayout

HOW = (
    "position_ids must count up by one inside each document and restart at 0 where the next "
    "document starts (Hugging Face's DataCollatorWithFlattening convention): build the batch "
    "with tsp_ext.shard_batch on the same mesh"
)


def _rows(position_ids: torch.Tensor) -> torch.Tensor:
    """``[T]`` or ``[B, T]`` position ids -> ``[B, T]`` int64 on the CPU."""
    pos = position_ids.detach().to("cpu", torch.int64)
    return pos[None] if pos.dim() == 1 else pos


def breaks(pos: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: True where a token (after the first) neither continues the document of
    the token before it nor starts a new one."""
    bad = torch.zeros_like(pos, dtype=torch.bool)
    bad[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1) & (pos[:, 1:] != 0)
    return bad


def local_error(pos: torch.Tensor, layout: ZigzagLayout, p: int) -> str | None:
    """Why rank ``p``'s position ids ``[B, S/D]`` cannot be per-document positions, or None."""
    if pos.dim() != 2 or pos.shape[1] != layout.local_len:
        return f"position_ids must be [B, {layout.local_len}], got {tuple(pos.shape)}"
    g = layout.positions(p)
    for s in layout.spans(p):
        chunk = pos[:, s.offset : s.offset + s.length]
        bad = (chunk < 0) | (chunk > g[s.offset : s.offset + s.length]) | breaks(chunk)
        if bad.any():
            b, j = (int(i) for i in bad.nonzero()[0])
            return (
                f"position_ids row {b} has {int(chunk[b, j])} at global position {s.start + j} "
                f"(after {int(chunk[b, j - 1]) if j else 'the chunk start'}); {HOW}"
            )
    return None


def check_chunks(position_ids: torch.Tensor, layout: ZigzagLayout, group) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless the ranks' chunks continue each
    other (each chunk continues the document of the chunk before it or starts a new one).

    Every rank's position ids must already be valid per-document positions of its zigzag shard
    (``local_error``, agreed across ranks). One all-gather of ``4B`` integers per rank: the first
    and last position id of each local chunk."""
    D, p = comm.size_and_rank(group)
    pos = _rows(position_ids)
    B = pos.shape[0]
    edges = torch.stack([pos[:, [s.offset, s.offset + s.length - 1]] for s in layout.spans(p)], 1)
    gathered = comm.all_gather_seq(edges.to(position_ids.device), group)[0].cpu()
    # chunk c of the sequence: (first, last) position ids of every row
    chunks = torch.empty(B, 2 * D, 2, dtype=torch.int64)
    for r in range(D):
        chunks[:, list(layout.chunks(r))] = gathered[r]
    first, last = chunks[..., 0], chunks[..., 1]
    ok = (first[:, 1:] == 0) | (first[:, 1:] == last[:, :-1] + 1)
    if not ok.all():
        b, c = (int(i) for i in (~ok).nonzero()[0])
        raise ValueError(
            f"position_ids of the TSP ranks do not fit together: in row {b}, chunk {c + 1} "
            f"starts at {int(first[b, c + 1])} but chunk {c} ends at {int(last[b, c])}; {HOW}"
        )


def _row_spans(pos: torch.Tensor, layout: ZigzagLayout, p: int) -> tuple[Span, ...]:
    """One row's spans: each chunk of rank ``p`` cut where a document starts."""
    out = []
    for s in layout.spans(p):
        chunk = pos[s.offset : s.offset + s.length]
        cuts = sorted({0, *(chunk == 0).nonzero().flatten().tolist(), s.length})
        for a, b in zip(cuts[:-1], cuts[1:]):
            out.append(Span(s.offset + a, s.start + a, b - a, s.start + a - int(chunk[a])))
    return tuple(out)


def query_spans(
    position_ids: torch.Tensor, layout: ZigzagLayout, p: int
) -> tuple[Span, ...] | RowSpans:
    """Rank ``p``'s query spans for its per-document position ids ``[B or 1, S/D]`` (zigzag
    order): one tuple if every row has the same documents, else ``RowSpans``. Plain global
    positions give ``layout.spans(p)``. Raises ``ValueError`` for ids that are not per-document
    positions (``check_chunks`` also checks how the ranks' chunks fit together)."""
    pos = _rows(position_ids)
    error = local_error(pos, layout, p)
    if error is not None:
        raise ValueError(error)
    if torch.equal(pos, pos[:1].expand_as(pos)):
        return _row_spans(pos[0], layout, p)
    return RowSpans(tuple(_row_spans(row, layout, p) for row in pos))
