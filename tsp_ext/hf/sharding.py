"""The sharded-module protocol: how a TSP module's parameters map onto full Hugging Face tensors.

Every TSP module that holds a slice of a Hugging Face weight is a ``ShardedModule``. State
gathering, shard-on-read loading, export, optimizer-state resharding, DP parameter roles and
gradient norms all read the layout through this one interface, never through module types.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard


class Role(enum.Enum):
    """How one parameter is laid out over the TSP axis (what a gradient norm must count)."""

    SHARDED = "sharded"  # a distinct slice on every TSP rank: counted on every rank
    REPLICATED = "replicated"  # the same tensor on every TSP rank: counted once
    COPY = "copy"  # a replicated slice held by a rank that is not its first owner: not counted


class ShardedModule(nn.Module, abc.ABC):
    """A module holding this TSP rank's slices of full Hugging Face tensors.

    ``shard_dims`` maps each sharded parameter (name relative to the module) to the dim it is cut
    along; parameters not in it are replicated. ``group`` is the TSP process group.
    """

    shard_dims: ClassVar[dict[str, int]] = {}
    group: dist.ProcessGroup

    @abc.abstractmethod
    def local_index(self, name: str) -> tuple[slice, ...]:
        """Index of this rank's slice in the full Hugging Face tensor behind ``name``."""

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full Hugging Face tensor behind parameter ``name``."""
        return full[self.local_index(name)]

    def assemble(self, name: str, shards: torch.Tensor) -> torch.Tensor:
        """Full Hugging Face tensor from every rank's shard of ``name``, ``shards [D, ...]``."""
        if name not in self.shard_dims:
            return shards[0]
        if self.shard_dims[name] == 0:  # row blocks in rank order: [D, n/D, ..] is [n, ..]
            return shards.flatten(0, 1)
        return torch.cat(list(shards), dim=self.shard_dims[name])

    def role(self, name: str) -> Role:
        """Layout of parameter ``name`` over the TSP axis."""
        return Role.SHARDED if name in self.shard_dims else Role.REPLICATED

    def placement(self, name: str) -> TSPPlacement:
        """Where this rank's slice of ``name`` sits in the full tensor, as DTensor placements."""
        D = dist.get_world_size(self.group)
        if name not in self.shard_dims:
            return TSPPlacement((D,), (Replicate(),))
        return TSPPlacement((D,), (Shard(self.shard_dims[name]),))


@dataclasses.dataclass(frozen=True)
class TSPPlacement:
    """The TSP axis viewed as a mesh of shape ``mesh_shape`` (TSP rank p at row-major position
    p) and the DTensor placement of a parameter on each of its dims: ``((D,), (Shard(0),))`` for
    row blocks, ``((D,), (Replicate(),))`` for a replicated weight, ``((n_kv, D/n_kv),
    (Shard(0), Replicate()))`` for KV heads each held by D/n_kv consecutive ranks."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]


def shard_owner(model: nn.Module, name: str) -> tuple[ShardedModule, str] | None:
    """``(module, local name)`` of the sharded module holding parameter ``name``: the parameter's
    own module or its parent (``q_proj.weight`` of an attention module); None if replicated."""
    parts = name.split(".")
    for cut in (len(parts) - 1, len(parts) - 2):
        if cut < 0:
            continue
        owner = model.get_submodule(".".join(parts[:cut]))
        key = ".".join(parts[cut:])
        if isinstance(owner, ShardedModule) and key in owner.shard_dims:
            return owner, key
    return None


def local_index(model: nn.Module, name: str) -> tuple[slice, ...]:
    """Index of this rank's slice in the full Hugging Face tensor behind parameter ``name``."""
    owner = shard_owner(model, name)
    return (slice(None),) if owner is None else owner[0].local_index(owner[1])


def param_roles(model: nn.Module) -> dict[str, Role]:
    """``{parameter name: Role}`` for every parameter of a TSP model (names as in the model)."""
    roles = {}
    for name, _ in model.named_parameters():
        owner = shard_owner(model, name)
        roles[name] = Role.REPLICATED if owner is None else owner[0].role(owner[1])
    return roles


def placement(model: nn.Module, name: str) -> TSPPlacement:
    """``TSPPlacement`` of parameter ``name`` of a TSP model (replicated unless sharded)."""
    owner = shard_owner(model, name)
    if owner is None:
        return TSPPlacement((dist.get_world_size(model.tsp.group),), (Replicate(),))
    return owner[0].placement(owner[1])
