"""Full tensors of a TSP model under the original Hugging Face names (export, compare, debug).

``full_tensor`` assembles ONE tensor (collective); ``iter_full_tensors`` streams a model through
it, so a caller holds at most one full tensor at a time. ``full_state_dict`` / ``full_grads``
gather everything at once and are meant for tests and debugging, not for saving large models.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..storage import full_over_dp, is_zero3, reshard_fsdp, tsp_shape, zero3_gathered
from .sharding import shard_owner


def require_tsp(model: nn.Module):
    """``model.tsp``, or a ``ValueError`` saying to apply TSP first."""
    state = getattr(model, "tsp", None)
    if state is None:
        raise ValueError("not a TSP model: call tsp_ext.apply_tsp(model, mesh) first")
    return state


def full_shape(model: nn.Module, name: str, t: torch.Tensor) -> torch.Size:
    """Shape of the full Hugging Face tensor that ``full_tensor(model, name, t)`` assembles,
    without communication (``t``: this rank's value, as there)."""
    shape = list(tsp_shape(t))
    sharded = shard_owner(model, name)
    if sharded is not None:
        module, key = sharded
        dim = module.shard_dims[key]
        tsp = dist.get_world_size(module.group)
        shape[dim] = max(module.index_of(key, q)[dim].stop for q in range(tsp))
    return torch.Size(shape)


def full_tensor(
    model: nn.Module, name: str, t: torch.Tensor, *, dst: int | None = None
) -> torch.Tensor | None:
    """The full Hugging Face tensor behind parameter/buffer ``name`` of a TSP model (collective).

    ``t`` is this rank's value of it: a TSP shard ``[.., n/D, ..]`` or a replicated tensor, possibly
    a DTensor sharded over dp (FSDP2; gathered over dp first) or a ZeRO-3 partition (gathered with
    ``GatheredParameters``, this parameter only). With ``dst`` (a global rank) only the TSP group
    holding ``dst`` gathers the shards and only ``dst`` gets the result (others get None); the
    transient memory is one full tensor on ``dst`` and one shard elsewhere.
    """
    state = require_tsp(model)
    if is_zero3(t):  # gather this one parameter over dp
        with zero3_gathered(t):
            return full_tensor(model, name, t.detach().clone(), dst=dst)
    t = full_over_dp(t).detach()  # FSDP2: the dp shards first
    tsp_ranks = dist.get_process_group_ranks(state.group)
    if dst is not None and dst not in tsp_ranks:
        return None
    sharded = shard_owner(model, name)
    if sharded is None:
        return t.clone() if dst is None or dist.get_rank() == dst else None
    module, key = sharded
    if dst is None:  # shards may differ by one head or row: a padded all-gather
        return module.gather_full(key, t)
    t = t.contiguous()
    if dist.get_rank() != dst:
        dist.send(t, group=state.group, group_dst=tsp_ranks.index(dst))
        return None
    shards = []  # each rank's shard at its own size, received in place
    for i, rank in enumerate(tsp_ranks):
        if rank == dst:
            shards.append(t)
        else:
            shards.append(t.new_empty(module.shard_shape(key, i, t.shape)))
            dist.recv(shards[-1], group=state.group, group_src=i)
    return module.assemble(key, shards)


def hf_tensors(
    model: nn.Module, items: Iterator[tuple[str, torch.Tensor | None]]
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``items`` (name, full tensor) under Hugging Face's names: the parts of a projection the
    model's family fuses (Phi-3's ``qkv_proj``) are held until all have come, then stacked by
    rows into the fused tensor (None where a part is None: another rank's result). Nothing
    yielded is referenced here once the next item is asked for."""
    family = model.tsp.family
    pending: dict[str, dict[int, torch.Tensor | None]] = {}
    for name, t in items:
        fused = family.fused_name(name)
        if fused is None:
            yield name, t
            del t
            continue
        hf_name, i, n = fused
        pending.setdefault(hf_name, {})[i] = t
        del t
        if len(pending[hf_name]) == n:
            parts = pending.pop(hf_name)
            ordered = [parts.pop(j) for j in range(n)]
            yield hf_name, None if any(p is None for p in ordered) else torch.cat(ordered)
            del ordered


def iter_full_tensors(
    model: nn.Module, *, dst: int | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(name, full tensor)`` for every entry of ``model.state_dict()`` under Hugging Face's
    names, one at a time (a fused projection's parts together: ``hf_tensors``; collective:
    every rank must consume the whole iterator); see ``full_tensor`` for ``dst``."""
    require_tsp(model)
    reshard_fsdp(model)
    items = model.state_dict(keep_vars=True).items()
    yield from hf_tensors(model, ((n, full_tensor(model, n, t, dst=dst)) for n, t in items))


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's full state dict under the original Hugging Face names (collective).

    Sharded weights are gathered over the TSP group and reassembled; replicated ones are returned
    as they are. With ``rank0_only`` the other TSP ranks get ``{}``. Holds the whole model: for
    saving use ``tsp_ext.save_pretrained`` (streams) or ``tsp_ext.checkpoint.save``.
    """
    out = {n: t for n, t in iter_full_tensors(model) if t is not None}
    return {} if rank0_only and dist.get_rank(model.tsp.group) != 0 else out


def full_grads(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full gradients under the original names (collective); parameters without one are left out."""
    require_tsp(model)
    params = model.named_parameters(remove_duplicate=False)
    grads = ((n, full_tensor(model, n, p.grad)) for n, p in params if p.grad is not None)
    out = dict(hf_tensors(model, grads))
    return {} if rank0_only and dist.get_rank(model.tsp.group) != 0 else out
