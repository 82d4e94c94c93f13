"""From a Hugging Face batch to this rank's TSP inputs, and back from local outputs."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..engine.comm import gather_seq
from ..engine.layout import IGNORE_INDEX, ZigzagLayout, pad_sequence, padded_length
from ..mesh import tsp_submesh

_KNOWN_KEYS = {"input_ids", "labels", "attention_mask"}


def shard_batch(
    batch: dict[str, torch.Tensor], mesh: DeviceMesh, *, pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's TSP inputs for a full batch.

    Args:
        batch: ``input_ids [B, S]``, optional ``labels [B, S]`` (Hugging Face convention: the
            model shifts them) and optional ``attention_mask [B, S]`` for *right* padding.
        mesh: the TSP mesh (``init_tsp_mesh``).
        pad_token_id: id placed in positions added to reach a multiple of 2·tsp_size.

    Returns:
        ``input_ids`` and ``position_ids`` ``[B, S'/D]`` (global positions, zigzag order) and,
        if labels were given, ``shift_labels`` — labels shifted *before* sharding, ``-100``
        wherever the predicted token is padding — also passed as ``labels`` so that the model
        computes its loss. S' is S rounded up to a multiple of 2·D; the added tokens come last,
        so causal attention never lets a real token see them.
    """
    unknown = set(batch) - _KNOWN_KEYS
    if unknown:
        raise ValueError(f"shard_batch does not know how to shard {sorted(unknown)}")
    sub = tsp_submesh(mesh)
    D, p = sub.size(), sub.get_local_rank()
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got {tuple(ids.shape)}")
    B, S = ids.shape
    lay = ZigzagLayout(padded_length(S, D), D)
    out = {
        "input_ids": lay.shard(pad_sequence(ids, D, pad_token_id), p),
        "position_ids": lay.positions(p, ids.device)[None].expand(B, -1),
    }
    labels, mask = batch.get("labels"), batch.get("attention_mask")
    if mask is not None:
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {(B, S)}")
        if (mask[:, 1:] > mask[:, :-1]).any():
            raise ValueError(
                "attention_mask has padding before real tokens: TSP supports right padding only "
                "(pad at the end, or pack sequences)"
            )
    if labels is not None:
        if labels.shape != ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {(B, S)}")
        shifted = torch.cat([labels[:, 1:], labels.new_full((B, 1), IGNORE_INDEX)], dim=1)
        if mask is not None:
            next_is_pad = torch.cat([mask[:, 1:], mask.new_zeros(B, 1)], dim=1) == 0
            shifted = shifted.masked_fill(next_is_pad, IGNORE_INDEX)
        local = lay.shard(pad_sequence(shifted, D, IGNORE_INDEX), p)
        out.update(labels=local, shift_labels=local)
    return out


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh, seq_len: int | None = None) -> torch.Tensor:
    """All-gather local ``[B, S'/D, ...]`` outputs into ``[B, seq_len, ...]`` in original order.

    Differentiable (its backward reduce-scatters). ``seq_len`` drops the padding shard_batch
    added; None keeps all S' positions.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        got = type(x).__name__ if not isinstance(x, torch.Tensor) else f"shape {tuple(x.shape)}"
        raise ValueError(
            f"gather_sequence needs a local [B, S/D, ...] tensor, got {got} (e.g. the logits of a "
            "TSP model called without labels, or with return_logits=True)"
        )
    sub = tsp_submesh(mesh)
    full = ZigzagLayout.from_local(x.shape[1], sub.size()).unshard(gather_seq(x, sub.get_group()))
    return full if seq_len is None else full[:, :seq_len]
