"""Per-token log-probabilities of a TSP model without full logits: what preference training needs.

- ``model(**shard_batch(batch, mesh), return_token_logps=True).token_logps``: ``[B, S/D]``, each
  local token's log p(label) from the vocab-sharded ring (``engine.vocab.ring_token_logps``),
  sharded as the tokens are; ``sequence_logps(token_logps, model)`` sums each sequence over the
  TSP group (``[B]``, the same on every rank, differentiable).
- TRL's fused-LM-head protocol (``trl.trainer.utils.add_fused_lm_head``), which its DPO / KTO /
  GRPO trainers call: ``model(input_ids, attention_mask, labels, fused_lm_head=True)`` with the
  *full* batch on every rank of a TSP group. The model shards it (``shard_batch``), runs, and
  returns a ``FusedLMHeadOutput`` whose per-token fields ``[B, S - 1]`` cover the whole sequences
  on every rank, gathered from the ranks' ``[B, S/D]`` pieces (a few floats per token: no rank
  ever holds logits beyond one ``[loss_chunk, V/D]`` block). Every rank then computes the same
  loss from them; ``log_probs``' backward keeps each rank's own tokens' gradient
  (``comm.gather_seq_replicated``). Called with ``shift_labels`` (an already sharded batch,
  TRL's convention under context parallelism), the fields stay local, ``[B, S/D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..engine import comm
from ..engine.layout import ZigzagLayout
from ..engine.vocab import STATS
from .batch import shard_batch
from .causal_lm import check_shards, vocab_sharded_forward


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
    use_cache: bool | None = None,
    **kwargs,
) -> FusedLMHeadOutput:
    """``model(..., fused_lm_head=True)`` of a TSP model (see the module docstring): the full
    batch ``input_ids, labels [B, S]`` (Hugging Face convention: the model shifts the labels;
    right padding by ``attention_mask``; packed documents by ``position_ids``), or with
    ``shift_labels`` this rank's shard of one."""
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels: it returns their log-probabilities")
    if shift_labels is not None:  # already sharded
        sharded = dict(input_ids=input_ids, position_ids=position_ids)
        sharded.update(labels=shift_labels, shift_labels=shift_labels)
        return _fields(model, sharded, num_items_in_batch, kwargs, seq_len=None)
    batch = dict(input_ids=input_ids, labels=labels)
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    if position_ids is not None:
        batch["position_ids"] = position_ids
    sharded = shard_batch(batch, _tsp_state(model).mesh)
    return _fields(model, sharded, num_items_in_batch, kwargs, seq_len=input_ids.shape[1] - 1)


def _fields(model, sharded, num_items_in_batch, kwargs, seq_len) -> FusedLMHeadOutput:
    """Run the sharded batch; per-token fields local, or gathered to ``[B, seq_len]``."""
    checked = check_shards(model, {**sharded, **kwargs})
    out = vocab_sharded_forward(
        model, **checked, num_items_in_batch=num_items_in_batch, return_token_logps=STATS
    )
    fields = {"log_probs": out.token_logps, **out.token_stats}
    fields["label_mask"] = sharded["shift_labels"] != -100
    if seq_len is not None:
        group = _tsp_state(model).group
        fields = {k: _gather(v, group, seq_len) for k, v in fields.items()}
    return FusedLMHeadOutput(loss=out.loss, **fields)


def _gather(x: torch.Tensor, group, seq_len: int) -> torch.Tensor:
    """Local ``[B, S'/D]`` -> ``[B, seq_len]`` in sequence order, the same on every rank."""
    D, _ = comm.size_and_rank(group)
    if x.requires_grad:
        full = comm.gather_seq_replicated(x, group)
    else:  # flags travel as bytes (gloo gathers no bool)
        wire = torch.uint8 if x.dtype == torch.bool else x.dtype
        full = comm.gather_seq(x.detach().to(wire), group)
    return ZigzagLayout.from_local(x.shape[1], D).unshard(full)[:, :seq_len].to(x.dtype)


def _tsp_state(model: nn.Module):
    state = getattr(model, "tsp", None)
    if state is None:
        base = getattr(model, "get_base_model", None)  # a PEFT model around a TSP model
        state = getattr(base(), "tsp", None) if base is not None else None
    if state is None:
        raise ValueError(f"{type(model).__name__} is not a TSP model (apply_tsp)")
    return state
