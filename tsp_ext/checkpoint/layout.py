"""This rank's piece of every full Hugging Face tensor of a TSP model, as a DTensor.

A TSP shard is wrapped with ``DTensor.from_local`` on a mesh of all ranks: the TSP axis (viewed
as ``TSPPlacement.mesh_shape``) followed by the dp axis. The placements say where the piece sits
in the full tensor: ``Shard(dim)`` / ``Replicate()`` over the TSP axis (from the sharded-module
protocol), then ``Replicate()`` over dp, or FSDP2's own ``Shard(0)`` when the parameter is a
DTensor sharded over dp (its dp chunk lies inside the TSP block, so dp is the inner mesh dim).
``torch.distributed.checkpoint`` records each piece with its global offsets, writes replicated
pieces once, and on load reads whatever piece this rank needs under any other layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..hf.sharding import TSPPlacement, placement
from .state import require_tsp


class Layout:
    """DTensor meshes and placements of one TSP model (shared by save and load).

    ``wrap(name, local, like)`` -> DTensor over the full Hugging Face tensor, ``local`` being this
    rank's piece (TSP shard ``[.., n/D, ..]``, or its dp chunk for FSDP2); ``like`` is the model
    parameter whose layout it has.
    """

    def __init__(self, model: nn.Module) -> None:
        state = require_tsp(model)
        self.model = model
        mesh = state.mesh
        self.ranks = mesh.mesh if mesh.ndim == 2 else mesh.mesh.reshape(1, -1)  # [dp, D]
        self.device_type = mesh.device_type
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    def _mesh(self, tsp_shape: tuple[int, ...]) -> DeviceMesh:
        """Mesh ``(*tsp_shape, dp)`` of global ranks; no process groups are created (DTensor
        and DCP only need each rank's coordinates)."""
        if tsp_shape not in self._meshes:
            dp = self.ranks.shape[0]
            ranks = self.ranks.reshape(dp, *tsp_shape).movedim(0, -1)  # [*tsp_shape, dp]
            self._meshes[tsp_shape] = DeviceMesh(self.device_type, ranks, _init_backend=False)
        return self._meshes[tsp_shape]

    def placement(self, name: str, like: torch.Tensor) -> tuple[TSPPlacement, Placement]:
        """``(TSP placement, dp placement)`` of parameter ``name``."""
        tsp = placement(self.model, name)
        if isinstance(like, DTensor):
            if like.device_mesh.ndim != 1 or not isinstance(like.placements[0], Shard | Replicate):
                raise ValueError(
                    f"{name}: a DTensor on {like.device_mesh} with {like.placements} is not an "
                    "FSDP2 parameter sharded over the dp axis (tsp_ext.fsdp.shard_model)"
                )
            return tsp, like.placements[0]
        return tsp, Replicate()

    def full_shape(self, name: str, like: torch.Tensor) -> torch.Size:
        """Shape of the full Hugging Face tensor behind parameter ``name``."""
        tsp, _ = self.placement(name, like)
        shape = list(local_shape(like))
        for n, p in zip(tsp.mesh_shape, tsp.placements):
            if isinstance(p, Shard):
                shape[p.dim] *= n
        return torch.Size(shape)

    def wrap(self, name: str, local: torch.Tensor, like: torch.Tensor) -> DTensor:
        tsp, dp = self.placement(name, like)
        shape = self.full_shape(name, like)
        return DTensor.from_local(
            local,
            self._mesh(tsp.mesh_shape),
            (*tsp.placements, dp),
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )


def local_shape(p: torch.Tensor) -> torch.Size:
    """This TSP rank's shape of a parameter (a DTensor's dp-global shape, ZeRO-3's ds_shape)."""
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (an FSDP2 DTensor's dp chunk)."""
    return t.to_local() if isinstance(t, DTensor) else t
