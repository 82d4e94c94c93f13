"""One builder per layout: the same Llama, batch and loss, parallelised by the real library.

Every builder takes the full model (same weights on every rank), the full batch and the world
size, and returns a ``Prepared``: the parallelised model and the two calls of a training step,
``loss()`` (forward; returns the tensor to differentiate and the global loss, detached) and
``reduce_grads()`` (gradient sums a layout leaves to the trainer, e.g. over sequence shards).

Which layouts exist, and with which options each builder runs: ``registry.REGISTRY``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

IGNORE_INDEX = -100
LR = 1e-3  # AdamW's learning rate in every layout's step


@dataclass
class Prepared:
    """A parallelised model and its training-step pieces on this rank."""

    model: nn.Module
    loss: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    reduce_grads: Callable[[], None] = lambda: None
    # entered around forward and backward (ring attention's sequence sharding)
    context: Callable[[], AbstractContextManager] = field(default=nullcontext)
    # a DeepSpeed engine that runs backward and the optimizer step itself (None: torch AdamW)
    deepspeed_engine: Any = None
    # host memory holding offloaded layer checkpoints (``tsp_ext.hf.checkpointing.HostStore``)
    host_store: Any = None


def tpxsp_split(devices: int) -> tuple[int, int]:
    """(tp, sp) of ``tpxsp`` on ``devices`` ranks: TP inside pairs, Ulysses across them."""
    if devices % 2 or devices <= 2:
        raise ValueError(f"tpxsp needs an even device count of at least 4, got {devices}")
    return 2, devices // 2


def shifted_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels shifted before sharding: position i predicts token i+1, the last one nothing."""
    return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)


def _sum_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _sharded_loss(model, inputs: dict, labels, count: int, group) -> Callable:
    """Loss of a sequence-sharded layout: local token sum / global count (+ global value)."""

    def loss():
        local = _sum_ce(model(**inputs).logits, labels) / count
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        return local, total

    return loss


def _grad_all_reduce(model: nn.Module, group) -> Callable[[], None]:
    """Sum gradients over ranks that saw different tokens with the same weights."""

    def reduce_grads():
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=group)

    return reduce_grads


def hf_tp_plan(model: nn.Module) -> dict:
    """The model's own HF tp plan (``model._tp_plan``: base plan + head) as torch parallel styles.

    HF's style names map to torch's: ``colwise``/``rowwise`` as is, ``colwise_gather_output``
    gathers the logits, ``embedding_rowwise`` is the vocab-parallel embedding (partial lookups
    all-reduced).
    """
    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return {name: styles[style]() for name, style in model._tp_plan.items()}


def build_single(model, ids, world, device) -> Prepared:
    labels = ids.clone()

    def loss():
        out = model(input_ids=ids, labels=labels).loss
        return out, out.detach()

    return Prepared(model, loss)


def build_tsp(model, ids, world, device, **options) -> Prepared:
    from tsp_ext import TSPConfig, apply_tsp, init_tsp_mesh, shard_batch

    mesh = init_tsp_mesh(world)
    model = apply_tsp(model, mesh, config=TSPConfig(**options))
    batch = shard_batch({"input_ids": ids, "labels": ids}, mesh)

    def loss():
        out = model(**batch).loss
        return out, out.detach()

    return Prepared(model, loss, host_store=model.tsp.host_store)


def build_tp(model, ids, world, device) -> Prepared:
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, hf_tp_plan(model))
    return build_single(model, ids, world, device)


def _tp_sp_plan(model: nn.Module) -> dict:
    """Megatron TP+SP: norms and residuals sequence-sharded, projections tensor-parallel."""
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update(
            {
                p + "input_layernorm": SequenceParallel(),
                p + "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                p + "self_attn.q_proj": ColwiseParallel(),
                p + "self_attn.k_proj": ColwiseParallel(),
                p + "self_attn.v_proj": ColwiseParallel(),
                p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                p + "post_attention_layernorm": SequenceParallel(),
                p + "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                p + "mlp.gate_proj": ColwiseParallel(),
                p + "mlp.up_proj": ColwiseParallel(),
                p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return plan


def build_tp_sp(model, ids, world, device) -> Prepared:
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, _tp_sp_plan(model))
    positions = torch.arange(ids.shape[1], device=device)[None].expand_as(ids)
    labels = ids.clone()

    def loss():
        # explicit positions: the embedding output is sequence-sharded, HF would count S/D
        out = model(input_ids=ids, position_ids=positions, labels=labels).loss
        return out, out.detach()

    return Prepared(model, loss)


def contiguous_shard(t: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    return t.chunk(size, dim=1)[rank].contiguous()


def sp_inputs(ids: torch.Tensor, size: int, rank: int):
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    inputs = {
        "input_ids": contiguous_shard(ids, size, rank),
        "position_ids": contiguous_shard(positions, size, rank),
    }
    return inputs, contiguous_shard(shifted_labels(ids), size, rank)


def build_ulysses(model, ids, world, device) -> Prepared:
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.comm.init_distributed(dist_backend=dist.get_backend())
    B, S = ids.shape
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", world, B, seq_length=S, seq_length_is_variable=False
    )
    group = mpu.get_sequence_parallel_group()
    inputs, labels = sp_inputs(ids, world, dist.get_rank(group))
    count = B * (S - 1)
    return Prepared(
        model, _sharded_loss(model, inputs, labels, count, group), _grad_all_reduce(model, group)
    )


def _install_ulysses(cfg, tp: int, B: int, S: int, group) -> None:
    """DeepSpeed's Ulysses attention over ``group`` for heads already split ``tp`` ways.

    ``register_with_transformers`` reads the global head counts from the config; under TP each
    rank holds 1/tp of them, so build the same ``UlyssesSPAttentionHF`` with the local counts and
    install it the way ``register_with_transformers`` does (in place of the core attention).
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sp = dist.get_world_size(group)
    uattn = UlyssesSPAttentionHF(
        attn=ALL_ATTENTION_FUNCTIONS["sdpa"],
        batch_size=B,
        attn_head_count=cfg.num_attention_heads // tp,
        attn_head_size=cfg.hidden_size // cfg.num_attention_heads,
        kv_head_count=cfg.num_key_value_heads // tp,
        num_hidden_layers=cfg.num_hidden_layers,
        process_group=group,
        local_seq_length=S // sp,
        global_seq_length=S,
    )
    uattn.core_attn_implementation = "sdpa"

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        return uattn(module, query, key, value, None, *args, **kwargs)  # causal: no 4-D mask

    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapper


def build_tpxsp(model, ids, world, device) -> Prepared:
    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend=dist.get_backend())
    tp, sp = tpxsp_split(world)
    mesh = init_device_mesh(device.type, (sp, tp), mesh_dim_names=("sp", "tp"))
    parallelize_module(model, mesh["tp"], hf_tp_plan(model))
    group = mesh["sp"].get_group()
    B, S = ids.shape
    _install_ulysses(model.config, tp, B, S, group)
    inputs, labels = sp_inputs(ids, sp, mesh["sp"].get_local_rank())
    count = B * (S - 1)
    return Prepared(
        model, _sharded_loss(model, inputs, labels, count, group), _grad_all_reduce(model, group)
    )


def build_ring(model, ids, world, device) -> Prepared:
    from torch.distributed.tensor.experimental import context_parallel

    mesh: DeviceMesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    positions = torch.arange(ids.shape[1], device=device)[None].expand_as(ids).contiguous()
    full = (ids, positions, shifted_labels(ids))
    count = ids.shape[0] * (ids.shape[1] - 1)
    local: list[torch.Tensor] = []

    def context():
        # context_parallel shards its buffers in place (load-balanced for causal attention)
        local[:] = [t.clone() for t in full]
        return context_parallel(mesh, buffers=local, buffer_seq_dims=[1, 1, 1])

    def loss():
        ids_p, pos_p, labels_p = local
        out = _sum_ce(model(input_ids=ids_p, position_ids=pos_p).logits, labels_p) / count
        total = out.detach().clone()
        dist.all_reduce(total, group=group)
        return out, total

    return Prepared(model, loss, _grad_all_reduce(model, group), context)


def long_context(model) -> dict:
    """TSP's long-context options: layers checkpointed, MLP tiles of ``h`` tokens (as ALST's)."""
    return {"checkpoint_layers": True, "mlp_tile": model.config.hidden_size}


def register_ulysses(model: nn.Module, B: int, S: int, world: int):
    """DeepSpeed's Ulysses attention for ``model`` (installed process-wide in place of SDPA) on
    ``world`` SP ranks for batches ``[B, S]``; returns its mpu (the SP groups)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.comm.init_distributed(dist_backend=dist.get_backend())
    return UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", world, B, seq_length=S, seq_length_is_variable=False
    )


def zero3_engine(model: nn.Module, B: int, mpu, *, train: bool):
    """``model`` in a ZeRO-3 engine over the SP ranks of ``mpu``: with AdamW to train, without an
    optimizer (parameters partitioned, gathered per module) for a frozen model."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 3}}
    optimizer = (lambda params: torch.optim.AdamW(params, lr=LR)) if train else None
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu, optimizer=optimizer)
    engine.train(train)
    return engine


def tile_mlps(model: nn.Module, local_len: int) -> None:
    """Run every decoder MLP of ``model`` through DeepSpeed's ``TiledMLP``, in tiles of ``h``
    tokens of a rank's ``local_len`` (as DeepSpeed's example)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = math.ceil(local_len / model.config.hidden_size)
    for layer in model.model.layers:
        mlp = layer.mlp
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        hf_forward = type(mlp).forward  # the class's own, untouched by the instance's below
        mlp.forward = functools.partial(_tiled, TiledMLP, hf_forward, mlp, shards, params)


def _tiled(tiled_mlp, hf_forward, mlp, shards, params, x):
    return tiled_mlp.apply(hf_forward, mlp, x, shards, params)


def build_ulysses_zero3(model, ids, world, device, *, tiled: bool = False) -> Prepared:
    """DeepSpeed's Ulysses SP with a ZeRO-3 engine over the same ranks and Hugging Face layer
    checkpointing; ``tiled`` adds what makes it ALST: ``TiledMLP`` (tiles of ``h`` tokens, as
    DeepSpeed's example), ``TiledFusedLogitsLoss`` (tiles of 1024 tokens, as TSP's loss) and
    the layer checkpoints offloaded to host memory. DeepSpeed's own offload context does
    nothing on CPU, so the checkpoints go to the same ``HostStore`` TSP's offload uses."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    from tsp_ext.hf.checkpointing import enable_layer_checkpointing

    B, S = ids.shape
    mpu = register_ulysses(model, B, S, world)
    store = enable_layer_checkpointing(model, offload=tiled)
    if tiled:
        tile_mlps(model, S // world)
    engine = zero3_engine(model, B, mpu, train=True)
    group = mpu.get_sequence_parallel_group()
    inputs, labels = sp_inputs(ids, world, dist.get_rank(group))
    # ZeRO averages the gradients over the SP ranks: each rank's share of the global mean, x D
    scale = world / (B * (S - 1))

    def loss():
        if tiled:
            hidden = engine.module.model(**inputs).last_hidden_state

            def tile_loss(lm, x, y):  # the scale inside: the tiles' backward runs in forward
                logits = lm.lm_head(x).float()  # [tile tokens, V]
                return (
                    F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum") * scale
                )

            params = [model.lm_head.weight]
            shards = math.ceil(hidden.shape[1] / 1024)
            local = TiledFusedLogitsLoss.apply(
                tile_loss, engine.module, hidden, labels, None, shards, params, "sum"
            )
        else:
            local = _sum_ce(engine(**inputs).logits, labels) * scale
        total = local.detach() / world
        dist.all_reduce(total, group=group)
        return local, total

    return Prepared(engine.module, loss, deepspeed_engine=engine, host_store=store)


# the adapter of the LoRA layouts: what long-context LoRA recipes commonly use
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear")


def with_lora(model: nn.Module) -> nn.Module:
    """``model`` as a PEFT LoRA model (``LORA``), the same adapter on every rank."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(**LORA))
