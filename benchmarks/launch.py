"""Run a function on D local processes (gloo on CPU, NCCL on GPUs), with a hard timeout.

``backend="fake"`` starts only the ``ranks`` asked for, each alone in a D-rank world of PyTorch's
fake process group (collectives return without moving data): single-rank emulation.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

# glibc: serve every allocation over 64 KiB by mmap, so freed tensors leave the resident set at
# once and the peak RSS (VmHWM) tracks live memory rather than the allocator's cache
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, backend: str, args, queue) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's all_gather_into_tensor
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        if backend == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        else:
            timeout = timedelta(seconds=300)
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        result = fn(rank, world, *args)
        dist.barrier()
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything to the parent, which decides what failed
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(
    fn: Callable,
    world: int,
    *args,
    backend: str = "gloo",
    timeout: float = 900.0,
    ranks: list[int] | None = None,
) -> list:
    """Run ``fn(rank, world, *args)`` on spawned processes; return results in rank order.

    ``ranks``: the ranks to start (default all ``world``; a subset only with ``backend="fake"``).
    ``fn`` must be importable. Raises ``RuntimeError`` with the first worker traceback, or when a
    worker dies (e.g. killed for memory) or the run exceeds ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    saved = {k: os.environ.get(k) for k in _MALLOC_ENV}
    os.environ.update(_MALLOC_ENV)  # inherited by the spawned children only at start
    ranks = list(range(world)) if ranks is None else ranks
    if backend != "fake" and len(ranks) != world:
        raise ValueError("only the fake backend runs a subset of the ranks")
    procs = {
        r: ctx.Process(target=_worker, args=(fn, r, world, port, backend, args, queue), daemon=True)
        for r in ranks
    }
    try:
        for p in procs.values():
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    results: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < len(ranks) and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [(r, p.exitcode) for r, p in procs.items() if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"rank {dead[0][0]} died with exit code {dead[0][1]}")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s")
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs.values():
            p.join(timeout=30 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in ranks]
