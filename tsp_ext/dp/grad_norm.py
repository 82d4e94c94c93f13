"""Gradient-norm clipping that counts every distinct value of a TSP model exactly once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..hf.sharding import Role, counted_index, param_roles
from ..storage import full_over_dp, is_fsdp2, local_tensor

CHUNK = 1 << 22  # elements squared in float64 at a time (a 32 MB temporary, not a whole gradient)


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """``sum(t**2)`` in float64, chunk by chunk: converting a whole gradient to float64 would
    add twice its size (and its square as much again) to the peak memory of the step."""
    return sum(c.double().pow(2).sum() for c in t.flatten().split(CHUNK))


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip a TSP model's gradients by their global L2 norm, in place; returns that norm.

    TSP-sharded gradients are summed over the TSP group, replicated ones counted once, copies of
    shared KV heads only on their first user (``counted_index``). Gradients that are DTensors
    sharded over dp (FSDP2) are also summed over dp; plain gradients are taken as already
    identical across dp (DDP). torch's ``clip_grad_norm_`` would count replicated weights D times
    and miss the other shards.
    """
    state = getattr(model, "tsp", None)
    if state is None:
        raise ValueError("not a TSP model: call tsp_ext.apply_tsp first")
    roles = param_roles(model)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if not grads:
        return torch.zeros(())
    first = next(iter(grads.values()))
    device = local_tensor(first).device
    # rows: [sharded over tsp, replicated]; columns: [sharded over dp (DTensor), whole]
    sums = torch.zeros(2, 2, dtype=torch.float64, device=device)
    for name, g in grads.items():
        role = roles[name]
        if role is Role.COPY:
            continue
        dtensor = is_fsdp2(g)
        local = local_tensor(g)
        counted = counted_index(model, name)
        if counted != (slice(None),):  # a slice with a shared KV head's copy: count the rest
            local = full_over_dp(g)[counted]
            dtensor = False  # the full TSP shard, identical over dp
        sums[0 if role is Role.SHARDED else 1, 0 if dtensor else 1] += _sum_of_squares(local)
    if state.mesh.ndim > 1:  # every rank takes part, whether or not it holds DTensor grads
        over_dp = sums[:, 0].clone()
        dist.all_reduce(over_dp, group=state.mesh["dp"].get_group())
        sums[:, 0] = over_dp
    per_role = sums.sum(dim=1)
    sharded = per_role[0:1].clone()
    dist.all_reduce(sharded, group=state.group)
    total = (sharded[0] + per_role[1]).sqrt()
    coef = max_norm / (total.item() + 1e-6)
    if coef < 1.0:
        for g in grads.values():
            g.mul_(coef)
    return total
