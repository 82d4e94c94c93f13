"""Per-token log-probabilities of a TSP model without full logits: what preference training needs.

- ``model(**shard_batch(batch, mesh), return_token_logps=True).token_logps``: ``[B, S/D]``, each
  local token's log p(label) from the vocab-sharded ring (``engine.vocab.ring_token_logps``),
  sharded as the tokens are; ``sequence_logps(token_logps, model)`` sums each sequence over the
  TSP group (``[B]``, the same on every rank, differentiable).
- TRL's fused-LM-head protocol (``trl.trainer.utils.add_fused_lm_head``), which its DPO / KTO /
  GRPO trainers call: ``model(input_ids, attention_mask, labels, fused_lm_head=True)`` with the
  *full* batch on every rank of a TSP group. The model shards it (``shard_batch``), runs, and
  returns a ``FusedLMHeadOutput`` whose per-token fields ``[B, S - 1]`` cover the whole sequences
  on every rank, gathered from the ranks' ``[B, S/D]`` pieces in one all-gather (a few floats
  per token: no rank ever holds logits beyond one ``[loss_chunk, V/D]`` block). Every rank then
  computes the same loss from them; ``log_probs``' backward keeps each rank's own tokens'
  gradient (``comm.gather_seq_replicated``). Called with ``shift_labels`` (an already sharded batch,
  TRL's convention under context parallelism), the fields stay local, ``[B, S/D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..engine.parallel import comm
from ..engine.sharding.layout import IGNORE_INDEX, ZigzagLayout
from ..engine.vocab import STATS
from .batch import shard_batch, shifted_labels
from .causal_lm import check_shards, vocab_sharded_forward
from .lora import peft_base


@dataclass
class FusedLMHeadOutput(ModelOutput):
    """TRL's ``FusedCausalLMOutput`` fields: ``loss`` (the token-mean NLL), per-token
    ``log_probs`` (differentiable), ``entropy``, ``log_sum_sq_probs``, ``mean_logits``,
    ``is_top1`` (no gradient) and ``label_mask``, each 0 / False where the label is ignored."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def sequence_logps(token_logps: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """``[B]``: each sequence's summed log-probability over all its tokens, from the local
    ``token_logps [B, S/D]`` of a TSP ``model`` (collective over its TSP group; differentiable,
    each rank's backward reaches its own tokens)."""
    return comm.sum_over_ranks(token_logps.sum(dim=-1), _tsp_state(model).group)


def fused_lm_head_forward(
    model: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    **kwargs,
) -> FusedLMHeadOutput:
    """``model(..., fused_lm_head=True)`` of a TSP model (see the module docstring): the full
    batch ``input_ids, labels [B, S]`` (Hugging Face convention: the model shifts the labels;
    right padding by ``attention_mask``; packed documents by ``position_ids``), or with
    ``shift_labels`` this rank's shard of one. ``kwargs``: the model's (``use_cache`` dropped:
    no cache in training)."""
    kwargs.pop("use_cache", None)
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels: it returns their log-probabilities")
    if shift_labels is not None:  # already sharded: the fields stay local
        sharded = dict(input_ids=input_ids, position_ids=position_ids)
        sharded.update(labels=shift_labels, shift_labels=shift_labels)
        out = _run(model, sharded, num_items_in_batch, kwargs, full_batch=None)
        fields = {"log_probs": out.token_logps, **out.token_stats}
        return FusedLMHeadOutput(loss=out.loss, label_mask=shift_labels != IGNORE_INDEX, **fields)
    batch = dict(input_ids=input_ids, labels=labels)
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    if position_ids is not None:
        batch["position_ids"] = position_ids
    state = _tsp_state(model)
    sharded = shard_batch(batch, state.mesh)
    out = _run(model, sharded, num_items_in_batch, kwargs, full_batch=batch)
    label_mask = shifted_labels(batch)[:, :-1] != IGNORE_INDEX
    fields = _gathered(out, state.group, input_ids.shape[1] - 1)
    return FusedLMHeadOutput(loss=out.loss, label_mask=label_mask, **fields)


def _run(model, sharded: dict, num_items_in_batch, kwargs: dict, *, full_batch: dict | None):
    """The sharded batch through the TSP forward, with every per-token field (``full_batch``:
    the batch this rank sharded, checked to be every TSP rank's)."""
    checked = check_shards(model, {**sharded, **kwargs}, full_batch=full_batch)
    return vocab_sharded_forward(
        model, **checked, num_items_in_batch=num_items_in_batch, return_token_logps=STATS
    )


def _gathered(out, group, seq_len: int) -> dict[str, torch.Tensor]:
    """The local per-token fields ``[B, S'/D]`` as ``[B, seq_len]`` in sequence order, the same
    on every rank: one all-gather of them all, stacked (its backward reaches ``log_probs``)."""
    logp, stats = out.token_logps, out.token_stats
    local = torch.stack([logp, *(s.to(logp.dtype) for s in stats.values())], dim=-1)
    D, _ = comm.size_and_rank(group)
    full = ZigzagLayout.from_local(local.shape[1], D).unshard(
        comm.gather_seq_replicated(local, group)
    )[:, :seq_len]
    dtypes = {"log_probs": logp.dtype, **{n: t.dtype for n, t in stats.items()}}
    return {n: full[..., i].to(dtype) for i, (n, dtype) in enumerate(dtypes.items())}


def _tsp_state(model: nn.Module):
    state = getattr(peft_base(model) or model, "tsp", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not a TSP model (apply_tsp)")
    return state
