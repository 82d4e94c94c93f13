"""From a Hugging Face batch to this rank's TSP inputs, and back from local outputs."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..engine.parallel.comm import gather_seq
from ..engine.sharding.documents import HOW, breaks
from ..engine.sharding.layout import IGNORE_INDEX, ZigzagLayout, pad_sequence, padded_length
from ..mesh import tsp_submesh
from .vision import BATCH_KEYS, shard_vision_batch

_KNOWN_KEYS = {"input_ids", "labels", "attention_mask", "position_ids"}


def shard_batch(
    batch: dict[str, torch.Tensor],
    mesh: DeviceMesh,
    *,
    pad_token_id: int = 0,
    model: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's TSP inputs for a full batch.

    Args:
        batch: ``input_ids [B, S]``, optional ``labels [B, S]`` (Hugging Face convention: the
            model shifts them), optional ``attention_mask [B, S]`` for *right* padding and
            optional ``position_ids [B or 1, S]`` for packed documents: restarting at 0 on each
            document's first token (``DataCollatorWithFlattening``); attention then stays
            inside each document and RoPE uses the position inside the document.
        mesh: the TSP mesh (``init_tsp_mesh``).
        pad_token_id: id placed in positions added to reach a multiple of 2·tsp_size.
        model: the TSP vision-language model, for a batch with images or videos (the
            processor's ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
            ``video_grid_thw``, ``mm_token_type_ids``, ...): its vision split, feature exchange
            and 3-D positions are read from it (``hf.vision``).

    Returns:
        ``input_ids`` and ``position_ids`` ``[B, S'/D]`` (global positions, or the given
        per-document ones, zigzag order) and, if labels were given, ``shift_labels`` — labels
        shifted *before* sharding, ``-100`` wherever the predicted token is padding or the first
        token of the next document — also passed as ``labels`` so that the model computes its
        loss. S' is S rounded up to a multiple of 2·D; the added tokens come last (continuing
        the last document), so causal attention never lets a real token see them. With
        images: this rank's pixels and the keys ``hf.vision.vision_forward`` takes.
    """
    vision = model is not None and model.tsp.family.vision is not None
    multimodal = {k for k in batch if k in BATCH_KEYS and batch[k] is not None}
    unknown = set(batch) - _KNOWN_KEYS - (set(BATCH_KEYS) if vision else set())
    if multimodal and not vision:
        if model is not None:
            raise ValueError(
                f"the batch has {sorted(multimodal)}, but {type(model).__name__} is not a "
                "vision-language model"
            )
        raise ValueError(
            f"the batch has {sorted(multimodal)}: pass the TSP vision-language model, "
            "shard_batch(batch, mesh, model=model)"
        )
    if unknown:
        raise ValueError(f"shard_batch does not know how to shard {sorted(unknown)}")
    sub = tsp_submesh(mesh)
    D, p = sub.size(), sub.get_local_rank()
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got {tuple(ids.shape)}")
    B, S = ids.shape
    lay = ZigzagLayout(padded_length(S, D), D)
    docs = _document_positions(batch.get("position_ids"), B, S)
    out = {"input_ids": lay.shard(pad_sequence(ids, D, pad_token_id), p)}
    if docs is None:
        out["position_ids"] = lay.positions(p, ids.device)[None].expand(B, -1)
    else:  # the padding continues the last document
        tail = docs[:, -1:] + torch.arange(1, lay.seq_len - S + 1, device=docs.device)
        out["position_ids"] = lay.shard(torch.cat([docs, tail], dim=1), p)
    shifted = _shifted_labels(batch, docs)
    if shifted is not None:
        local = lay.shard(pad_sequence(shifted, D, IGNORE_INDEX), p)
        out.update(labels=local, shift_labels=local)
    if multimodal:
        if docs is not None:
            raise ValueError(
                "packed documents (position_ids) with images are not supported: pass one "
                "sequence per row (right padding with its attention_mask)"
            )
        out.update(shard_vision_batch(model, batch, lay, p))
    return out


def shifted_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The targets ``[B, S]`` that ``shard_batch`` shards (before padding to 2·D), or None
    without ``labels``: ``labels`` shifted left, ``-100`` where the predicted token is padding
    (``attention_mask``) or the first token of the next document (``position_ids``). Counting
    their non-ignored entries gives the number of tokens the TSP loss averages over."""
    ids = batch["input_ids"]
    return _shifted_labels(batch, _document_positions(batch.get("position_ids"), *ids.shape))


def _shifted_labels(batch: dict[str, torch.Tensor], docs: torch.Tensor | None):
    ids, labels, mask = batch["input_ids"], batch.get("labels"), batch.get("attention_mask")
    B, S = ids.shape
    if mask is not None:
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {(B, S)}")
        if (mask[:, 1:] > mask[:, :-1]).any():
            raise ValueError(
                "attention_mask has padding before real tokens: TSP supports right padding only "
                "(pad at the end, or pack sequences)"
            )
    if labels is None:
        return None
    if labels.shape != ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {(B, S)}")
    shifted = torch.cat([labels[:, 1:], labels.new_full((B, 1), IGNORE_INDEX)], dim=1)
    if mask is not None:
        next_is_pad = torch.cat([mask[:, 1:], mask.new_zeros(B, 1)], dim=1) == 0
        shifted = shifted.masked_fill(next_is_pad, IGNORE_INDEX)
    if docs is not None:  # the last token of a document does not predict the next one
        next_starts = torch.cat([docs[:, 1:] == 0, docs.new_zeros(B, 1, dtype=bool)], dim=1)
        shifted = shifted.masked_fill(next_starts.to(shifted.device), IGNORE_INDEX)
    return shifted


def _document_positions(pos: torch.Tensor | None, B: int, S: int) -> torch.Tensor | None:
    """The batch's per-document ``position_ids`` as ``[B, S]`` int64, checked, or None."""
    if pos is None:
        return None
    if pos.dim() != 2 or pos.shape[1] != S or pos.shape[0] not in (1, B):
        raise ValueError(f"position_ids {tuple(pos.shape)} must be [B, S] or [1, S], S = {S}")
    pos = pos.long().expand(B, S)
    bad = breaks(pos)
    bad[:, 0] = pos[:, 0] != 0
    if bad.any():
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"position_ids row {b} has {int(pos[b, j])} at token {j}; {HOW}")
    return pos


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
