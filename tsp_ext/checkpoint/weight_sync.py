"""A TSP model's full weights, one tensor at a time, under Hugging Face's names: for an external
generator (vLLM's ``load_weights``, TRL's vLLM server) and for ``save_pretrained``'s files.

``weight_metadata`` lists (name, dtype, full shape) in stream order without communication;
``iter_weights`` (collective) gathers each tensor over the TSP group (and over dp: FSDP2 DTensors,
ZeRO-3 partitions) to one rank and yields it there; ``stream_weights`` hands each to a receiver
and raises its failure on every rank. The stream is what ``AutoModelForCausalLM`` saves: Hugging
Face's names and layout (fused projections such as Phi-3's ``qkv_proj`` stacked back), a tied LM
head left out, a PEFT model's LoRA adapters merged into their base weights (``W + s·B·A``, the
model unchanged; no ``base_model.model.`` / ``.base_layer`` / ``lora_`` names), NF4 bases
dequantized. Peak extra memory: one full tensor on the receiving rank (a fused projection: its
parts and the stacked tensor; an adapted weight: also its full A and B), one shard elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..hf.full_state import full_shape, full_tensor, hf_tensors, require_tsp
from ..hf.lora import ADAPTER_MARK, PEFT_PREFIX, TSPLoraLinear, peft_base
from ..hf.nf4 import NF4Linear
from ..storage import reshard_fsdp
from ..writer import raise_everywhere

Receiver = Callable[[list[tuple[str, torch.Tensor]]], object]


def weight_metadata(model: nn.Module) -> list[tuple[str, torch.dtype, torch.Size]]:
    """``(Hugging Face name, dtype, full shape)`` of every tensor ``iter_weights`` yields, in its
    order; no communication, the same on every rank (what a vLLM server is told before an
    update: TRL's ``update_named_params`` takes these with ``str(dtype).removeprefix("torch.")``
    and ``list(shape)``)."""
    require_tsp(model)
    reshard_fsdp(model)
    family, shapes = model.tsp.family, {}
    for out, src, t, _, _ in _plan(model):
        shape = full_shape(model, src, t)
        fused = family.fused_name(out)
        name = out if fused is None else fused[0]
        if name in shapes:  # a fused projection stacks its parts' rows
            dtype, prev = shapes[name]
            shape = torch.Size([prev[0] + shape[0], *shape[1:]])
        shapes[name] = (t.dtype, shape)
    return [(name, dtype, shape) for name, (dtype, shape) in shapes.items()]


def iter_weights(model: nn.Module, *, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, full tensor)`` of every weight, one at a time, on global rank
    ``dst``; the other ranks yield nothing (collective: every rank must run the whole iterator,
    e.g. ``for _ in iter_weights(model): pass``; a consumer on ``dst`` that stops early or raises
    leaves the others waiting: ``stream_weights`` catches that).

    Each tensor is the rank's own copy (the receiver may keep it) and is referenced by nothing
    here once the next gather starts. Works for a plain TSP model (DDP), an FSDP2-sharded one and
    the ``module`` of a DeepSpeed engine (any ZeRO stage), with or without a PEFT LoRA adapter.
    """
    _check(model, dst)
    reshard_fsdp(model)
    for name, t in hf_tensors(model, _planned(model, _plan(model), dst)):
        if t is not None:
            yield name, t
        del t  # not held while the next tensor is gathered


def stream_weights(
    model: nn.Module, receiver: Receiver | object | None = None, *, dst: int = 0
) -> None:
    """Hand the model's full weights to ``receiver`` on global rank ``dst``, one tensor at a time
    (collective: call it on every rank; the others take part in the gathers and may pass None).

    ``receiver``: an object with ``load_weights`` (a vLLM model:
    ``llm.llm_engine.model_executor.driver_worker.model_runner.model``) or any callable; it is
    called once per tensor with ``[(name, full_tensor)]`` in ``weight_metadata``'s order, and
    what it does not keep is freed before the next tensor is gathered: one full tensor on
    ``dst`` at a time, one shard elsewhere. A receiver that raises gets no further tensors; the
    stream still completes and its error is raised on every rank (a ``RuntimeError`` elsewhere).
    """
    _check(model, dst)
    error: BaseException | None = None
    load = getattr(receiver, "load_weights", receiver)
    if dist.get_rank() == dst and not callable(load):
        error = TypeError(f"stream_weights: receiver {receiver!r} is not callable")
    raise_everywhere(error, "stream_weights", src=dst)
    for name, t in iter_weights(model, dst=dst):
        if error is None:
            try:
                load([(name, t)])
            except BaseException as e:  # every rank must learn that the stream failed
                error = e
        del t
    raise_everywhere(error, "stream_weights", src=dst)


def _check(model: nn.Module, dst: int) -> None:
    """A ``ValueError`` (the same on every rank) unless ``model`` is a TSP model and ``dst`` a
    global rank."""
    require_tsp(model)
    if not 0 <= dst < dist.get_world_size():
        raise ValueError(f"dst={dst}: not a global rank (world size {dist.get_world_size()})")


def _plan(model: nn.Module) -> list:
    """``(Hugging Face name, name in the model, this rank's tensor (or a meta tensor like it),
    a function making it (None: it is that tensor), LoRA projection or None)`` of every tensor to
    stream, in state-dict order, then NF4-packed bases (dequantized as they stream). A PEFT model's
    names lose PEFT's prefix and ``.base_layer``, its adapter tensors are left out and each
    adapted base weight carries its ``TSPLoraLinear`` (merged as it streams); a tied LM head is
    left out."""
    base = peft_base(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    adapted = {}
    if base is not None:
        adapted = {
            f"{prefix}.base_layer.weight": m
            for prefix, m in model.named_modules()
            if isinstance(m, TSPLoraLinear) and m.active
        }
    tensors = [(n, t, None) for n, t in model.state_dict(keep_vars=True).items()]
    for prefix, m in model.named_modules():
        if isinstance(m, NF4Linear):  # not in the state dict: packed bytes
            like = torch.empty(m.shape, dtype=m.dtype, device="meta")
            tensors.append((f"{prefix}.weight", like, lambda m=m: m.weight))
    plan = []
    for name, t, make in tensors:
        out = name
        if base is not None:
            if ADAPTER_MARK in name:
                continue
            out = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if not (tied and out == "lm_head.weight"):
            plan.append((out, name, t, make, adapted.get(name)))
    return plan


def _planned(model: nn.Module, plan: list, dst: int):
    """``(name, full tensor on dst, else None)`` of each planned tensor (collective): an adapted
    weight is merged with its full A and B on dst."""
    for out, name, t, make, lora in plan:
        full = full_tensor(model, name, t if make is None else make(), dst=dst)
        if lora is not None:
            prefix = name.removesuffix("base_layer.weight")
            a = full_tensor(model, f"{prefix}lora_A.{lora.adapter_name}.weight", lora.a, dst=dst)
            b = full_tensor(model, f"{prefix}lora_B.{lora.adapter_name}.weight", lora.b, dst=dst)
            if full is not None:
                wide = torch.promote_types(full.dtype, torch.float32)
                full += (lora.s * (b.to(wide) @ a.to(wide))).to(full.dtype)
            del a, b
        yield out, full
        del full  # not held while the next tensor is gathered
