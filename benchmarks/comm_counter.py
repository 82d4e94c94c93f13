"""Count the bytes each rank receives, per collective type, by intercepting the collective ops.

Every ``torch.distributed`` call (the Python API dispatches ``torch.ops.c10d.*``), every functional
collective (DTensor's ``torch.ops._c10d_functional.*``) and DeepSpeed's Ulysses exchange op pass
through the dispatcher, where a ``TorchDispatchMode`` sees them with their tensors and group. Any
other op from a communication namespace raises, so no layout's traffic goes uncounted.

Bytes received by one rank (N = bytes of the op's full tensor, G = group size), the volume of the
bandwidth-optimal algorithm:

| op | received |
|---|---|
| all_reduce | 2·(G−1)/G·N |
| all_gather (N = output) / reduce_scatter (N = input) | (G−1)/G·N |
| all_to_all | output minus this rank's own chunk |
| broadcast | N on every rank but the source |
| reduce | (G−1)·N on the destination (every other rank sends N) |
| send / recv | N on the receiver |
| scatter / gather | the rank's chunk on every rank but the root / (G−1) chunks on the root |
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
# ops of those namespaces that move no data
_NO_DATA = {"wait_tensor", "barrier", "monitored_barrier_", "_wrap_tensor_autograd"}


def _nbytes(t) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _group(pg) -> dist.ProcessGroup:
    """A group from a functional op's group name or a c10d op's boxed ProcessGroup."""
    if isinstance(pg, str):
        return dist.distributed_c10d._resolve_process_group(pg)
    return pg if isinstance(pg, dist.ProcessGroup) else dist.ProcessGroup.unbox(pg)


def _all_to_all_received(x: torch.Tensor, out_splits, G: int, p: int) -> int:
    """Received by rank p of an all-to-all along dim 0: the output minus its own chunk."""
    if not out_splits:
        return _nbytes(x) * (G - 1) // G
    row = _nbytes(x) // max(x.shape[0], 1)
    return (sum(out_splits) - out_splits[p]) * row


def _received(ns: str, op: str, args: tuple) -> tuple[str, int]:
    """(collective type, bytes this rank receives) of one call of ``ns::op``."""
    functional = ns != "c10d"
    if ns == "deepspeed":  # dim_zero_all_to_all(input, group_name): even chunks along dim 0
        G = _group(args[1]).size()
        return "all_to_all", _nbytes(args[0]) * (G - 1) // G
    if op.startswith(("all_reduce", "allreduce")):
        G = _group(args[2] if functional else args[1]).size()
        return "all_reduce", 2 * (G - 1) * _nbytes(args[0]) // G
    if op.startswith("all_gather_into_tensor") and functional:  # (input, group_size, group)
        return "all_gather", (args[1] - 1) * _nbytes(args[0])
    if op.startswith(("allgather", "_allgather")):  # (output, input, group, ...)
        G = _group(args[2]).size()
        return "all_gather", (G - 1) * _nbytes(args[0]) // G
    if op.startswith("reduce_scatter_tensor") and functional:  # (input, op, group_size, group)
        return "reduce_scatter", (args[2] - 1) * _nbytes(args[0]) // args[2]
    if op.startswith(("reduce_scatter", "_reduce_scatter")):  # (output, input, group, ...)
        G = _group(args[2]).size()
        return "reduce_scatter", (G - 1) * _nbytes(args[1]) // G
    if op == "all_to_all_single":  # (input, output_splits, input_splits, group)
        pg = _group(args[3])
        return "all_to_all", _all_to_all_received(args[0], list(args[1]), pg.size(), pg.rank())
    if op == "alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
        pg = _group(args[2])
        return "all_to_all", _all_to_all_received(args[0], list(args[3]), pg.size(), pg.rank())
    if op == "alltoall_":  # (outputs, inputs, group, ...)
        pg = _group(args[2])
        return "all_to_all", _nbytes(args[0]) - _nbytes(args[0][pg.rank()])
    if op in ("broadcast", "broadcast_"):
        src, pg = (args[1], _group(args[2])) if functional else (args[2], _group(args[1]))
        return "broadcast", 0 if pg.rank() == src else _nbytes(args[0])
    if op == "reduce_":  # (tensors, group, op, root, ...)
        pg = _group(args[1])
        return "reduce", (pg.size() - 1) * _nbytes(args[0]) if pg.rank() == args[3] else 0
    if op in ("recv_", "recv_any_source_", "send"):
        return "send_recv", _nbytes(args[0]) if op != "send" else 0
    if op == "scatter_":  # (outputs, inputs, group, root, ...)
        return "scatter", 0 if _group(args[2]).rank() == args[3] else _nbytes(args[0])
    if op == "gather_":  # (outputs, inputs, group, root, ...)
        pg = _group(args[2])
        return "gather", (pg.size() - 1) * _nbytes(args[1]) if pg.rank() == args[3] else 0
    raise LookupError(f"unknown communication op {ns}::{op}: add it to comm_counter")


class CommCounter(TorchDispatchMode):
    """Dispatch mode summing, per collective type, the bytes this rank receives inside it.

    ``received`` maps a collective type (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all``, ``broadcast``, ``reduce``, ``send_recv``) to bytes; ``calls`` counts ops.
    """

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # let DTensor desugar into plain collectives first, then count those
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        ns = func.namespace
        op = func._schema.name.split("::")[-1]
        counted = (ns == "deepspeed" and op == "dim_zero_all_to_all") or (
            ns in _COMM_NAMESPACES and op not in _NO_DATA
        )
        if not counted:
            return func(*args, **(kwargs or {}))
        kind, nbytes = _received(ns, op, args)
        self.received[kind] += nbytes
        self.calls[kind] += 1
        return func(*args, **(kwargs or {}))
