"""This rank's pieces of every full Hugging Face tensor of a TSP model, with their global offsets.

A rank stores each parameter (and each optimizer tensor laid out like it) as one block of the full
tensor: its TSP slice (``ShardedModule.blocks``: uneven head groups, MLP slices and vocabularies,
KV heads shared by some ranks), or FSDP2's dp chunk of that slice. ``Layout.wrap`` hands the block
to ``torch.distributed.checkpoint`` (DCP) as ``Chunks``: pieces with explicit global offsets. Every
block is cut at every boundary of every rank's block, so a piece held by several ranks (replicated
parameters, dp replicas, a KV head shared by a few head groups) is the same chunk on all of them:
DCP writes it once, and on load reads each chunk into every rank that holds it, under any layout.

    9 query / 3 KV heads at D = 2, k_proj rows (head_dim d): rank 0 holds [0, 2d), rank 1 [d, 3d)
    -> rank 0 chunks [0, d), [d, 2d); rank 1 chunks [d, 2d), [2d, 3d); [d, 2d) is written once
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..hf.full_state import require_tsp
from ..hf.sharding import blocks
from ..storage import is_fsdp2, tsp_shape


class Layout:
    """Where this rank's pieces of a TSP model's parameters lie (shared by save and load).

    ``wrap(name, local, like)`` -> ``Chunks`` over the full Hugging Face tensor, ``local`` being
    this rank's piece (its TSP slice, or FSDP2's dp chunk of it); ``like`` is the model parameter
    whose layout it has.
    """

    def __init__(self, model: nn.Module) -> None:
        state = require_tsp(model)
        self.model = model
        self.rank = dist.get_rank(state.group)

    def full_shape(self, name: str, like: torch.Tensor) -> torch.Size:
        """Shape of the full Hugging Face tensor behind parameter ``name``."""
        shape = list(tsp_shape(like))
        tsp = blocks(self.model, name)
        if tsp is not None:
            dim, rows = tsp
            shape[dim] = max(r.stop for r in rows)
        return torch.Size(shape)

    def wrap(self, name: str, local: torch.Tensor, like: torch.Tensor) -> Chunks:
        """``local`` (this rank's piece of ``name``, laid out like ``like``) as DCP chunks."""
        shape = self.full_shape(name, like)
        tsp = blocks(self.model, name)
        # TSP blocks along each dim (global [start, stop)); this rank's is at position self.rank
        extents = [[(0, n)] for n in shape]
        offset, size = [0] * len(shape), list(tsp_shape(like))
        if tsp is not None:
            dim, rows = tsp
            extents[dim] = [(r.start, r.stop) for r in rows]
            offset[dim] = rows[self.rank].start
        cuts = [{b for e in ext for b in e} for ext in extents]
        if is_fsdp2(like):  # FSDP2: this rank's dp chunk of its TSP block
            dp_dim = _dp_shard_dim(name, like)
            size, dp_offset = compute_local_shape_and_global_offset(
                like.shape, like.device_mesh, like.placements
            )
            offset = [o + d for o, d in zip(offset, dp_offset)]
            if dp_dim is not None:  # every rank's dp chunk boundaries, as torch.chunk cuts
                parts = like.device_mesh.size()
                cuts[dp_dim] |= {
                    s + c for s, e in extents[dp_dim] for c in _chunk_cuts(e - s, parts)
                }
        if tuple(local.shape) != tuple(size):
            raise ValueError(f"{name}: piece of shape {tuple(local.shape)}, expected {size}")
        per_dim = []  # this rank's intervals along each dim, cut at every rank's boundaries
        for o, n, c in zip(offset, size, cuts):
            points = sorted({o, o + n} | {x for x in c if o < x < o + n})
            per_dim.append(list(itertools.pairwise(points)) if n else [])
        pieces = [
            (tuple(slice(a - o, b - o) for (a, b), o in zip(box, offset)), tuple(a for a, _ in box))
            for box in itertools.product(*per_dim)
        ]
        return Chunks(local, pieces, shape)


def _dp_shard_dim(name: str, like: DTensor) -> int | None:
    """Dim FSDP2 shards ``like`` along over dp (None if replicated over dp)."""
    placement = like.placements[0] if like.device_mesh.ndim == 1 else None
    if placement is None or not (isinstance(placement, Shard) or placement.is_replicate()):
        raise ValueError(
            f"{name}: a DTensor on {like.device_mesh} with {like.placements} is not an FSDP2 "
            "parameter sharded over the dp axis (tsp_ext.fsdp.shard_model)"
        )
    return placement.dim if isinstance(placement, Shard) else None


def _chunk_cuts(n: int, parts: int) -> list[int]:
    """Boundaries of ``torch.chunk``-style blocks of ``n`` rows over ``parts`` (DTensor's Shard)."""
    step = -(-n // parts) if n else 0
    return [min(k * step, n) for k in range(parts + 1)]


class Chunks(torch.Tensor):
    """A full tensor of ``shape`` as DCP sees this rank's part of it: ``pieces`` of the stored
    tensor ``local``, each ``(index into local, offsets in the full tensor)``.

    DCP writes each piece from, and loads it into, a view of ``local`` (no copy of the whole);
    pieces with the same offsets on several ranks are one chunk, written once. The planner calls
    ``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``; async save
    stages it through ``new_empty`` and a deep copy of its attributes.
    """

    _local: torch.Tensor
    _pieces: list[tuple[tuple[slice, ...], tuple[int, ...]]]

    @staticmethod
    def __new__(cls, local: torch.Tensor, pieces, shape: torch.Size) -> Chunks:
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        r._local, r._pieces = local, pieces
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self = args[0]
        if func is torch.ops.aten.detach.default:
            return self
        if func is torch.ops.aten.new_empty.default:  # async staging; it then sets _local, _pieces
            device = (kwargs or {}).get("device", self._local.device)
            return Chunks(self._local.new_empty(0, device=device), self._pieces, self.shape)
        raise NotImplementedError(f"{func} on a checkpoint Chunks wrapper")

    def _chunks(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(torch.Size(offsets), self._local[index].shape)
            for index, offsets in self._pieces
        ]

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self._local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in self._chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for where, offsets in self._pieces:
            if torch.Size(offsets) == index.offset:
                return self._local[where]
        raise ValueError(f"{index.fqn}: no piece at offsets {index.offset} on this rank")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Chunks(shape={tuple(self.shape)}, pieces={self._pieces})"
