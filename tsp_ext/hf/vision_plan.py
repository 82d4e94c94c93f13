"""Where a multimodal batch's vision work and features go under TSP: integer bookkeeping on the
full batch, the same on every rank (``shard_batch`` runs it).

A batch's images and videos are cut into *units* that the vision encoder processes independently:
one temporal slice ``[1, h, w]`` of a Qwen-VL image or video (its attention segment; windows and
the 2x2 merger stay inside it), one image of a LLaVA-style model. Units are dealt to the ranks in
order, in contiguous runs of about equal patch counts: rank e encodes only its run. Feature row f
(images' rows first, then videos', each in the placeholders' row-major order) fills the
placeholder token at ``(b, s)``, which the zigzag layout gives to rank ``owner(s)``; the features
travel there in one all-to-all (``hf.vision``). Rank p receives its features in ascending f (the
runs are in order), so ``vision_index [B, S/D]`` is each local token's row in what it receives
(-1 for text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sharding.layout import ZigzagLayout, padded_length


@dataclass(frozen=True)
class Units:
    """The vision units of a batch, in feature order: patches (cost) and features of each, and
    where each one's pixels are (``source`` 0: ``pixel_values``, 1: ``pixel_values_videos``;
    ``rows``: its first row there; ``grid``: its ``[1, h, w]`` for Qwen-VL, else None)."""

    patches: list[int]
    features: list[int]
    source: list[int]
    rows: list[int]
    grid: list[tuple[int, int, int]] | None


def grid_units(grids: list[torch.Tensor | None], merge: int) -> Units:
    """Qwen-VL units: every temporal slice of every ``[t, h, w]`` grid row (images, then videos),
    with ``h * w`` patches (rows of flattened pixels) and ``h * w / merge^2`` features."""
    patches, features, source, rows, grid = [], [], [], [], []
    for kind, g in enumerate(grids):
        row = 0
        for t, h, w in [] if g is None else g.tolist():
            for _ in range(t):
                patches.append(h * w)
                features.append(h * w // merge**2)
                source.append(kind)
                rows.append(row)
                grid.append((1, h, w))
                row += h * w
    return Units(patches, features, source=source, rows=rows, grid=grid)


def image_units(n_images: int, per_image: int) -> Units:
    """LLaVA-style units: whole images of ``per_image`` features each."""
    return Units(
        [1] * n_images,
        [per_image] * n_images,
        source=[0] * n_images,
        rows=list(range(n_images)),
        grid=None,
    )


def deal(costs: list[int], D: int) -> list[int]:
    """The rank of each unit: contiguous runs of about ``sum(costs) / D`` (a unit goes to the
    rank whose share holds its midpoint)."""
    total = sum(costs) or 1
    ranks, before = [], 0
    for c in costs:
        ranks.append(min(D - 1, (2 * before + c) * D // (2 * total)))
        before += c
    return ranks


@dataclass(frozen=True)
class Exchange:
    """Rank p's part of the feature all-to-all: the order of its encoded rows for sending,
    ``[F_p]``; the rows it sends to / receives from each rank, ``counts [2, D]``; and each local
    token's row in what it receives, ``index [B, S/D]`` (-1: a text token)."""

    order: torch.Tensor
    counts: torch.Tensor
    index: torch.Tensor


def exchange(
    slots: torch.Tensor, encoder_rank: torch.Tensor, lay: ZigzagLayout, B: int, p: int
) -> Exchange:
    """Rank p's exchange for features whose placeholders sit at flat positions ``slots [F]``
    (``b * S' + s`` of the padded batch) and which rank ``encoder_rank [F]`` encodes."""
    D, S = lay.size, lay.seq_len
    chunk = (slots % S) // lay.chunk
    owner = torch.where(chunk < D, chunk, 2 * D - 1 - chunk)
    mine = encoder_rank == p
    order = torch.argsort(owner[mine], stable=True)
    send = torch.bincount(owner[mine], minlength=D)
    recv = torch.bincount(encoder_rank[owner == p], minlength=D)
    # row of each feature in its owner's receive buffer: its rank among the owner's features
    rows = torch.zeros_like(slots)
    for q in range(D):
        at = owner == q
        rows[at] = torch.arange(int(at.sum()), device=slots.device)
    full = torch.full((B * S,), -1, dtype=torch.long, device=slots.device)
    full[slots] = rows
    index = lay.shard(full.view(B, S), p)
    return Exchange(order, torch.stack([send, recv]), index)


def pad_positions(pos: torch.Tensor, D: int) -> torch.Tensor:
    """``[..., B, S]`` positions padded to a multiple of 2·D, each row continuing by +1."""
    extra = padded_length(pos.shape[-1], D) - pos.shape[-1]
    if not extra:
        return pos
    tail = pos[..., -1:] + torch.arange(1, extra + 1, device=pos.device)
    return torch.cat([pos, tail], dim=-1)
