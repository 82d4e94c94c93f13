"""Full tensors of a TSP model under the original Hugging Face names (export, compare, debug)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..hf.sharding import local_index, shard_owner


def _require_tsp(model: nn.Module):
    state = getattr(model, "tsp", None)
    if state is None:
        raise ValueError("not a TSP model: call tsp_ext.apply_tsp(model, mesh) first")
    return state


def _full(model: nn.Module, tensors: dict[str, torch.Tensor | None], rank0_only: bool):
    """Gather every sharded tensor over the TSP group and assemble it (collective)."""
    state = _require_tsp(model)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t is None:
            continue
        if isinstance(t, DTensor):  # FSDP2: gather the dp shards first
            t = t.full_tensor()
        sharded = shard_owner(model, name)
        if sharded is not None:  # shards may differ by one head or row: padded all-gather
            t = sharded[0].gather_full(sharded[1], t.detach())
        out[name] = t.detach().clone()
    if rank0_only and dist.get_rank(state.group) != 0:
        return {}
    return out


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's full state dict under the original Hugging Face names (collective).

    Sharded weights are all-gathered over the TSP group and reassembled; replicated ones are
    returned as they are. With ``rank0_only`` the other TSP ranks get ``{}``.
    """
    return _full(model, dict(model.state_dict(keep_vars=True)), rank0_only)


def full_grads(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full gradients under the original names (collective); parameters without one are left out."""
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return _full(model, grads, rank0_only)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """Per-parameter optimizer state as full tensors under the original names (collective).

    ``{name: {"exp_avg": full tensor, "step": tensor, ...}}``: tensors shaped like their parameter
    are gathered and reassembled like it, so the result is independent of the TSP size.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, dict] = {}
    for param, st in optimizer.state.items():
        name = names[id(param)]
        out[name] = {}
        for key, value in st.items():
            if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                value = _full(model, {name: value}, rank0_only=False)[name]
            out[name][key] = value
    return out


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, read) -> None:
    """Fill ``optimizer``'s per-parameter state from full tensors, each rank taking its slice.

    ``read(name, key, index)`` returns the slice ``index`` of the full state tensor ``key`` of
    parameter ``name`` (e.g. from ``safe_open(...).get_slice``), or None if it has none.
    """
    for name, param in model.named_parameters():
        index = local_index(model, name)
        state = {}
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):
            value = read(name, key, index if key != "step" else ())
            if value is not None:
                state[key] = value.to(param.device)
        if state:
            optimizer.state[param] = state
