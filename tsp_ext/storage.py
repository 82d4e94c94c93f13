"""How a data-parallel engine stores a rank's parameters, and how to reach them.

DDP keeps plain tensors; FSDP2 keeps a ``DTensor`` whose local tensor is this rank's dp chunk
(its shape is the dp-global one: this TSP rank's whole shard); DeepSpeed ZeRO-3 keeps an empty
placeholder tagged ``ds_id``, the partition in ``ds_tensor`` and the shard's shape in
``ds_shape``. Everything else in tsp_ext asks these functions, not the engines' attributes.
Importing this module imports neither deepspeed nor any other engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def is_fsdp2(t: torch.Tensor) -> bool:
    """Whether ``t`` is an FSDP2 ``DTensor`` (sharded or replicated over dp)."""
    return isinstance(t, DTensor)


def is_zero3(p: torch.Tensor) -> bool:
    """Whether ``p`` is a parameter partitioned over dp by DeepSpeed ZeRO-3."""
    return hasattr(p, "ds_id")


def gathered_per_use(p: torch.Tensor) -> bool:
    """Whether the engine gathers ``p`` over dp for each use (FSDP2, ZeRO-3)."""
    return is_fsdp2(p) or is_zero3(p)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor this rank stores for ``t``: an FSDP2 DTensor's dp chunk, else ``t``."""
    return t.to_local() if is_fsdp2(t) else t


def partition(p: torch.Tensor) -> torch.Tensor:
    """The elements of ``p`` this rank holds: ZeRO-3's partition, FSDP2's dp chunk, or ``p``."""
    return p.ds_tensor if is_zero3(p) else local_tensor(p)


def tsp_shape(p: torch.Tensor) -> torch.Size:
    """Shape of this TSP rank's whole shard of ``p`` (ZeRO-3's ``ds_shape``; a DTensor's shape
    is already dp-global)."""
    return p.ds_shape if is_zero3(p) else p.shape


def full_over_dp(t: torch.Tensor) -> torch.Tensor:
    """This TSP rank's whole shard of ``t``: an FSDP2 DTensor gathered over dp (collective),
    else ``t`` (for ZeRO-3 use ``zero3_gathered``)."""
    return t.full_tensor() if is_fsdp2(t) else t


@contextmanager
def zero3_gathered(p: torch.Tensor) -> Iterator[torch.Tensor]:
    """``p`` holding its whole TSP shard inside the context (collective: DeepSpeed's
    ``GatheredParameters`` on this one ZeRO-3 parameter)."""
    import deepspeed  # a ZeRO-3 parameter exists only once deepspeed is imported

    with deepspeed.zero.GatheredParameters([p]):
        yield p


def reshard_fsdp(model: nn.Module) -> None:
    """Put FSDP2 modules back to their sharded DTensor parameters: after a forward without
    backward (evaluation) the root keeps plain unsharded ones, which the optimizer does not know."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
