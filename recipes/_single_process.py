"""Launcher-less runs: a plain ``python recipes/<script>.py`` is one process of world size 1
(TSP = 1), as Hugging Face and Accelerate scripts run without ``accelerate launch``."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_single_process(timeout: timedelta) -> None:
    """Without a launcher (no ``RANK`` in the environment), start the process group of this one
    process on an in-memory store: no address or port to choose. Launched runs are left alone
    (``init_tsp_mesh`` joins the launcher's group)."""
    if "RANK" in os.environ or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
