"""TRL's cross-process collectives over the data-parallel replicas instead of every process.

TRL's online trainers (GRPO, RLOO) gather rewards, token counts and metrics with Accelerate over
every process and slice their rows by ``process_index``. Under TSP the D ranks of a TSP group
hold the *same* rows (the model shards them itself), so a gather over the world would hold D
copies of each: group statistics, Bessel corrections, quantiles and token counts would change.
``over_replicas`` runs TRL's code with those collectives on the dp group instead: the ranks of a
TSP group each gather over their own dp group, from peers holding the same rows, and so agree.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist


class ReplicaAccelerator:
    """An ``Accelerator`` whose ``gather`` / ``reduce`` / ``pad_across_processes`` /
    ``gather_for_metrics`` and ``num_processes`` / ``process_index`` cover the dp ``group``;
    every other attribute is the wrapped accelerator's."""

    def __init__(self, accelerator, group: dist.ProcessGroup) -> None:
        self._accelerator = accelerator
        self._group = group
        self.num_processes = dist.get_world_size(group)
        self.process_index = dist.get_rank(group)

    def __getattr__(self, name: str):
        return getattr(self._accelerator, name)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's ``tensor [N, ...]`` concatenated, ``[R·N, ...]`` (a scalar: ``[R]``)."""
        t = tensor[None] if tensor.dim() == 0 else tensor
        wire = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()
        parts = [torch.empty_like(wire) for _ in range(self.num_processes)]
        dist.all_gather(parts, wire, group=self._group)
        return torch.cat(parts).to(t.dtype)

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0):
        """``tensor`` summed (or averaged: ``reduction="mean"``) over the replicas."""
        out = tensor.clone() * scale
        dist.all_reduce(out, group=self._group)
        return out / self.num_processes if reduction == "mean" else out

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first=False):
        """``tensor`` padded along ``dim`` to the longest replica's size."""
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self._group)
        missing = int(size) - tensor.shape[dim]
        if missing == 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        pad = tensor.new_full(shape, pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)

    def gather_object(self, obj: list) -> list:
        """Every replica's list, concatenated (Accelerate's ``gather_object``)."""
        out = [None] * self.num_processes
        dist.all_gather_object(out, obj, group=self._group)
        return [x for part in out for x in part]


@contextlib.contextmanager
def over_replicas(trainer, module: types.ModuleType, group: dist.ProcessGroup):
    """Run ``trainer``'s TRL code (from ``module``, whose ``gather`` / ``gather_object`` it
    imported from Accelerate) with its collectives over the dp ``group``; re-entrant."""
    if isinstance(trainer.accelerator, ReplicaAccelerator):
        yield
        return
    accelerator = trainer.accelerator
    replicas = ReplicaAccelerator(accelerator, group)
    saved = module.gather, module.gather_object
    trainer.accelerator = replicas
    module.gather, module.gather_object = replicas.gather, replicas.gather_object
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        module.gather, module.gather_object = saved
