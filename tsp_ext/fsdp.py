"""FSDP2 data parallelism across TSP groups on a (dp, tsp) mesh.

    mesh = init_tsp_mesh(tsp_size=4)
    model = tsp_ext.fsdp.shard_model(model, mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    ...
    loss.backward()
    tsp_ext.fsdp.clip_grad_norm_(model, 1.0)
    optimizer.step()

FSDP2 shards every parameter over ``mesh["dp"]`` only; TSP keeps its own layout on ``mesh["tsp"]``.
Passing the 2-D mesh to ``fully_shard`` would make it HSDP over both axes, mixing TSP shards.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from .model import apply_tsp
from .roles import Role, param_roles


def shard_model(model: nn.Module, mesh: DeviceMesh, **fully_shard_kwargs) -> nn.Module:
    """``fully_shard`` each decoder layer and the root over ``mesh["dp"]``; returns the model.

    Applies TSP first if the model is not a TSP model yet. ``fully_shard_kwargs`` go to every
    ``fully_shard`` call (``mp_policy``, ``reshard_after_forward``, ``offload_policy``, ...).
    """
    if "mesh" in fully_shard_kwargs:
        raise ValueError(
            "pass the (dp, tsp) mesh as `mesh`; FSDP2 is applied on its 'dp' axis only"
        )
    if mesh.mesh_dim_names != ("dp", "tsp"):
        raise ValueError(
            f"shard_model needs a ('dp', 'tsp') mesh (init_tsp_mesh), got {mesh.mesh_dim_names}"
        )
    if getattr(model, "tsp", None) is None:
        apply_tsp(model, mesh)
    # fully_shard swaps in new DTensor parameters (attributes are lost): keep roles by name
    model.tsp_param_roles = param_roles(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], **fully_shard_kwargs)
    fully_shard(model, mesh=mesh["dp"], **fully_shard_kwargs)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of an FSDP2 + TSP model by their global L2 norm; returns that norm.

    Each distinct value is counted once: TSP-sharded parameters are summed over dp and tsp,
    replicated ones over dp only, copies of replicated KV heads not at all. (torch's
    ``clip_grad_norm_`` would see only the dp axis.)
    """
    roles = getattr(model, "tsp_param_roles", None)
    if roles is None:
        raise ValueError("not an FSDP2 TSP model: build it with tsp_ext.fsdp.shard_model")
    state = model.tsp
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if not grads:
        return torch.zeros(())
    device = _local(next(iter(grads.values()))).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [sharded, replicated]
    for name, g in grads.items():
        role = roles[name]
        if role is not Role.COPY:
            sums[0 if role is Role.SHARDED else 1] += _local(g).double().pow(2).sum()
    dist.all_reduce(sums, group=state.mesh["dp"].get_group())
    sharded = sums[0:1].clone()
    dist.all_reduce(sharded, group=state.group)
    total = (sharded[0] + sums[1]).sqrt()
    coef = max_norm / (total.item() + 1e-6)
    if coef < 1.0:
        for g in grads.values():
            g.mul_(coef)
    return total


def _tsp_dir(path: str | os.PathLike, model: nn.Module) -> str:
    state = model.tsp
    return os.path.join(os.fspath(path), f"tsp_{state.size}_rank_{dist.get_rank(state.group):02d}")


def dcp_save(state_dict: dict, path: str | os.PathLike, model: nn.Module) -> None:
    """Save a DCP state dict of an FSDP2 + TSP model (from ``torch.distributed.checkpoint``).

    TSP shards share parameter names across TSP ranks, so each TSP rank writes its own DCP
    checkpoint (``path/tsp_<D>_rank_<p>``), coordinated over its dp group.
    """
    dcp.save(
        state_dict,
        checkpoint_id=_tsp_dir(path, model),
        process_group=model.tsp.mesh["dp"].get_group(),
    )


def dcp_load(state_dict: dict, path: str | os.PathLike, model: nn.Module) -> None:
    """Load, in place, what ``dcp_save`` wrote for this TSP rank (same TSP size required)."""
    where = _tsp_dir(path, model)
    if not os.path.isdir(where):
        raise FileNotFoundError(
            f"no checkpoint for this TSP rank at {where}: was it saved with "
            f"tsp_size={model.tsp.size}?"
        )
    dcp.load(state_dict, checkpoint_id=where, process_group=model.tsp.mesh["dp"].get_group())
