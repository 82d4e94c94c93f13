"""Plausible contents for the fake process group's data-dependent collectives.

PyTorch's fake process group returns every collective at once without moving data, so the
outputs of all-to-alls and all-gathers are left unfilled; code that reads them (TSP's
vocabulary-sharded embedding exchanges row counts, then row ids) would go out of range. ``Mirror``
fills them as if every rank held this rank's data: from every source, the chunk this rank sends
to itself. ``emulate`` runs a rank under it; ``emulate_fake``'s ``Emulation`` calls ``mirror``
for the ops it runs on real tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _group(pg) -> dist.ProcessGroup:
    if isinstance(pg, str):
        return dist.distributed_c10d._resolve_process_group(pg)
    return pg if isinstance(pg, dist.ProcessGroup) else dist.ProcessGroup.unbox(pg)


def _fill(out_chunks: list[torch.Tensor], mine: torch.Tensor) -> None:
    """Every output chunk gets ``mine`` where the shapes agree, zeros (valid ids) elsewhere."""
    with torch.no_grad():
        for chunk in out_chunks:
            if chunk.shape == mine.shape:
                chunk.copy_(mine)
            else:
                chunk.zero_()


def mirror(func, args: tuple, out):
    """``func``'s output with every all-to-all / all-gather output filled as if every rank held
    this rank's data (from every source, the chunk this rank sends to itself); ``out`` as is for
    other ops. ``func`` has run already (on the fake process group: the outputs are unfilled)."""
    name = f"{func.namespace}.{func._schema.name.split('::')[-1]}"
    if name == "c10d.alltoall_base_":
        output, x, pg, out_splits, in_splits = args[:5]
        p, G = _group(pg).rank(), _group(pg).size()
        mine = x.split(in_splits or x.shape[0] // G)[p]
        _fill(list(output.split(out_splits or output.shape[0] // G)), mine)
    elif name == "_c10d_functional.all_to_all_single":
        x, out_splits, in_splits, pg = args[:4]
        p, G = _group(pg).rank(), _group(pg).size()
        mine = x.split(list(in_splits) or x.shape[0] // G)[p]
        _fill(list(out.split(list(out_splits) or out.shape[0] // G)), mine)
    elif name in ("c10d._allgather_base_", "_c10d_functional.all_gather_into_tensor"):
        output, x = (args[0], args[1]) if func.namespace == "c10d" else (out, args[0])
        _fill(list(output.flatten().split(x.numel())), x.flatten())
    elif name == "c10d.allgather_":
        _fill(list(args[0][0]), args[1][0])
    return out


class Mirror(TorchDispatchMode):
    """Fill fake all-to-all / all-gather outputs as if every rank held this rank's data."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return mirror(func, args, func(*args, **(kwargs or {})))
