"""DPO's training step as harness layouts: the same preference pair, reference model and loss,
parallelised the way each library's users would run preference training at long context.

The harness batch's row is a pair's chosen sequence; the rejected one shares its first half (the
prompt) and continues with the chosen completion reversed. Only completion tokens are scored. The
loss is DPO's sigmoid loss, ``-log σ(β · ((π_c - π_r) - (ref_c - ref_r)))``, over each sequence's
summed token log-probabilities under the policy π and the frozen reference.

- ``dpo_single``: one process, Hugging Face layer checkpointing, the reference a frozen copy;
  log-probabilities in tiles of 1024 tokens, each tile's logits recomputed in backward.
- ``dpo_tsp_long``: ``tsp_long``'s ``TSPConfig``, the reference a frozen TSP model on the same
  mesh; log-probabilities by TSP's vocab-sharded ring (``return_token_logps``).
- ``dpo_alst``: ``alst``'s Ulysses, ZeRO-3 over the SP ranks, ``TiledMLP`` and offloaded layer
  checkpoints, the reference a ZeRO-3 engine without optimizer (as TRL prepares one); tiles as
  ``dpo_single``, the sequence sums all-reduced over the SP ranks.

TRL 1.16's ``DPOTrainer`` does not run Ulysses (TRL wires sequence parallelism into its
``SFTTrainer`` only), so ``dpo_alst`` is DPO assembled from the parts ALST ships.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .layouts import (
    IGNORE_INDEX,
    Prepared,
    contiguous_shard,
    register_ulysses,
    shifted_labels,
    sp_inputs,
    tile_mlps,
    zero3_engine,
)

BETA = 0.1
LOSS_TILE = 1024  # tokens per log-probability tile, as ``alst``'s loss


def dpo_pair(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[chosen; rejected]`` input ids ``[2, S]`` from a chosen row ``ids [1, S]`` and labels
    (Hugging Face convention) scoring the completion, the second half."""
    S = ids.shape[1]
    pair = ids.repeat(2, 1)
    pair[1, S // 2 :] = ids[0, S // 2 :].flip(0)
    labels = pair.clone()
    labels[:, : S // 2] = IGNORE_INDEX
    return {"input_ids": pair, "labels": labels}


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """DPO's sigmoid loss from the ``[2]`` sequence log-probabilities (chosen, rejected)."""
    margin = (policy[0] - policy[1]) - (reference[0] - reference[1])
    return -F.logsigmoid(BETA * margin)


def _tile_logps(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()  # [B, tile, V]
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp.masked_fill(labels == IGNORE_INDEX, 0).sum(-1)


def tiled_logps(lm: nn.Module, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    """``[B]``: summed log p(label) over the given tokens (``labels`` shifted, ``[B, T]``), in
    tiles of ``LOSS_TILE`` tokens whose logits backward recomputes (never all ``[B, T, V]``)."""
    hidden = lm.model(**inputs).last_hidden_state
    B, T = labels.shape
    tile = max(1, LOSS_TILE // B)
    parts = []
    for i in range(0, T, tile):
        args = (lm.lm_head, hidden[:, i : i + tile], labels[:, i : i + tile])
        if torch.is_grad_enabled():
            parts.append(checkpoint(_tile_logps, *args, use_reentrant=False))
        else:
            parts.append(_tile_logps(*args))
    return torch.stack(parts).sum(0)


def _frozen_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).requires_grad_(False).eval()


def build_dpo_single(model, ids, world, device) -> Prepared:
    from tsp_ext.hf.checkpointing import enable_layer_checkpointing

    reference = _frozen_copy(model)
    enable_layer_checkpointing(model, offload=False)
    pair = dpo_pair(ids)
    inputs, labels = {"input_ids": pair["input_ids"]}, shifted_labels(pair["labels"])

    def loss():
        with torch.no_grad():
            ref = tiled_logps(reference, inputs, labels)
        out = dpo_loss(tiled_logps(model, inputs, labels), ref)
        return out, out.detach()

    return Prepared(nn.ModuleDict({"policy": model, "reference": reference}), loss)


def build_dpo_tsp(model, ids, world, device, **options) -> Prepared:
    from tsp_ext import TSPConfig, apply_tsp, init_tsp_mesh, sequence_logps, shard_batch

    mesh = init_tsp_mesh(world)
    config = TSPConfig(**options)
    reference = apply_tsp(_frozen_copy(model), mesh, config=config)
    policy = apply_tsp(model, mesh, config=config)
    batch = shard_batch(dpo_pair(ids), mesh)

    def logps(m: nn.Module) -> torch.Tensor:
        return sequence_logps(m(**batch, return_token_logps=True).token_logps, m)

    def loss():
        with torch.no_grad():
            ref = logps(reference)
        out = dpo_loss(logps(policy), ref)
        return out, out.detach()

    models = nn.ModuleDict({"policy": policy, "reference": reference})
    return Prepared(models, loss, host_store=policy.tsp.host_store)


def build_dpo_alst(model, ids, world, device) -> Prepared:
    from tsp_ext.hf.checkpointing import enable_layer_checkpointing

    reference = _frozen_copy(model)
    pair = dpo_pair(ids)
    B, S = pair["input_ids"].shape
    mpu = register_ulysses(model, B, S, world)
    store = enable_layer_checkpointing(model, offload=True)
    for m in (model, reference):
        tile_mlps(m, S // world)
    engine = zero3_engine(model, B, mpu, train=True)
    ref_engine = zero3_engine(reference, B, mpu, train=False)
    group = mpu.get_sequence_parallel_group()
    rank = dist.get_rank(group)
    inputs, _ = sp_inputs(pair["input_ids"], world, rank)
    labels = contiguous_shard(shifted_labels(pair["labels"]), world, rank)

    def loss():
        with torch.no_grad():
            ref = tiled_logps(ref_engine.module, inputs, labels)
            dist.all_reduce(ref, group=group)
        # every rank computes the same loss: backward's all-reduce sums D equal gradients of it,
        # which ZeRO's average over the D ranks takes back to one
        policy = dist_fn.all_reduce(tiled_logps(engine.module, inputs, labels), group=group)
        out = dpo_loss(policy, ref)
        return out, out.detach()

    models = nn.ModuleDict({"policy": engine.module, "reference": ref_engine.module})
    return Prepared(models, loss, deepspeed_engine=engine, host_store=store)
