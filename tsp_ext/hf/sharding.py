"""The sharded-module protocol: how a TSP module's parameters map onto full Hugging Face tensors.

Every TSP module that holds a slice of a Hugging Face weight is a ``ShardedModule``. State
gathering, shard-on-read loading, export, optimizer-state resharding, DP parameter roles and
gradient norms all read the layout through this one interface, never through module types.
"""

from __future__ import annotations

import abc
import enum
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..engine.parallel import comm


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
    def index_of(self, name: str, rank: int) -> tuple[slice, ...]:
        """Index of TSP rank ``rank``'s slice in the full Hugging Face tensor behind ``name``
        (shards may differ by one head or row between ranks; every rank can compute all)."""

    def small_replicated(self) -> list[nn.Parameter]:
        """Its replicated parameters of more than one dimension that are small and used once per
        step (their gradients share one all-reduce: ``hf.replicated.replicated_vectors``)."""
        return []

    def local_index(self, name: str) -> tuple[slice, ...]:
        """Index of this rank's slice in the full Hugging Face tensor behind ``name``."""
        return self.index_of(name, dist.get_rank(self.group))

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full Hugging Face tensor behind parameter ``name``."""
        return full[self.local_index(name)]

    def assemble(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """Full Hugging Face tensor from every rank's shard of ``name`` (``shards[q]`` of rank q,
        each its own size); copies held by several ranks (shared KV heads) are written once."""
        if name not in self.shard_dims:
            return shards[0]
        dim = self.shard_dims[name]
        index = [self.index_of(name, q) for q in range(len(shards))]
        shape = list(shards[0].shape)
        shape[dim] = max(i[dim].stop for i in index)
        full = shards[0].new_empty(shape)
        for i, shard in zip(index, shards):
            full[i] = shard
        return full

    def gather_full(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        """The full tensor of ``name`` from this rank's ``shard`` (collective over the group).

        Shards are padded along their shard dim to the largest one, all-gathered
        (``[D, ...max shard]``), trimmed back to each rank's size and assembled."""
        D = dist.get_world_size(self.group)
        if name not in self.shard_dims:
            return shard
        dim = self.shard_dims[name]
        sizes = [self.index_of(name, q)[dim] for q in range(D)]
        sizes = [s.stop - s.start for s in sizes]
        pad = [0, 0] * (shard.dim() - 1 - dim) + [0, max(sizes) - shard.shape[dim]]
        padded = nn.functional.pad(shard, pad) if any(pad) else shard
        gathered, _ = comm.all_gather_seq(padded, self.group)
        return self.assemble(name, [g.narrow(dim, 0, n) for g, n in zip(gathered, sizes)])

    def shard_shape(self, name: str, rank: int, like: torch.Size) -> torch.Size:
        """Shape of TSP rank ``rank``'s shard of ``name``, given this rank's shape ``like``."""
        if name not in self.shard_dims:
            return like
        dim = self.shard_dims[name]
        rows = self.index_of(name, rank)[dim]
        return torch.Size((*like[:dim], rows.stop - rows.start, *like[dim + 1 :]))

    def blocks(self, name: str) -> tuple[int, list[slice]] | None:
        """``(dim, [rows of TSP rank q along dim, for every q])`` of sharded parameter ``name``;
        None if replicated. Blocks may differ by one head or row, and several ranks may hold
        overlapping ones (a KV head shared by consecutive head groups)."""
        if name not in self.shard_dims:
            return None
        dim = self.shard_dims[name]
        return dim, [self.index_of(name, q)[dim] for q in range(dist.get_world_size(self.group))]

    def counted_index(self, name: str) -> tuple[slice, ...]:
        """The part of this rank's ``name`` that a gradient norm counts here (all of it unless
        some of its values are copies whose first owner is another rank)."""
        return (slice(None),)

    def role(self, name: str) -> Role:
        """Layout of parameter ``name`` over the TSP axis."""
        return Role.SHARDED if name in self.shard_dims else Role.REPLICATED


def shard_owner(model: nn.Module, name: str) -> tuple[ShardedModule, str] | None:
    """``(module, local name)`` of the sharded module holding parameter ``name``: the nearest
    ancestor that shards it (``q_proj.weight`` of an attention module, ``lora_B.default.weight``
    of a LoRA projection); None if replicated."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:cut]))
        key = ".".join(parts[cut:])
        if isinstance(owner, ShardedModule):
            return (owner, key) if key in owner.shard_dims else None
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


def counted_index(model: nn.Module, name: str) -> tuple[slice, ...]:
    """The part of this rank's parameter ``name`` a gradient norm counts (see ``ShardedModule``)."""
    owner = shard_owner(model, name)
    return (slice(None),) if owner is None else owner[0].counted_index(owner[1])


def blocks(model: nn.Module, name: str) -> tuple[int, list[slice]] | None:
    """``ShardedModule.blocks`` of parameter ``name`` of a TSP model (None if replicated)."""
    owner = shard_owner(model, name)
    return None if owner is None else owner[0].blocks(owner[1])
