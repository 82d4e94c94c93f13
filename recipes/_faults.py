"""Fault injection for the tests (docs/faults.md): environment switches that make the last rank
die, or produce a NaN loss, at a given optimizer step. Unset, they do nothing."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

KILL_STEP = "TSP_EXT_FAULT_KILL_STEP"  # SIGKILL at the start of this step (first attempt only)
NAN_STEP = "TSP_EXT_FAULT_NAN_STEP"  # a NaN loss at this step


def _last_rank_at(var: str, step: int) -> bool:
    return os.environ.get(var) == str(step) and dist.get_rank() == dist.get_world_size() - 1


def maybe_kill(step: int) -> None:
    """``step``: 1-based. Only on a launcher's first attempt, so that a restart gets past it."""
    if _last_rank_at(KILL_STEP, step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_poison(loss: torch.Tensor, step: int) -> torch.Tensor:
    """``loss`` times NaN on the last rank at ``step`` (1-based); its gradients become NaN."""
    return loss * float("nan") if _last_rank_at(NAN_STEP, step) else loss
