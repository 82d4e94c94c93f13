"""Run a function on D local processes and collect the results: the one launcher of the tests
and the benchmarks.

Backends: ``gloo`` (CPU), ``nccl`` (one GPU per rank) and ``fake`` (PyTorch's fake process group:
only the ``ranks`` asked for start, each alone in a D-rank world whose collectives move no data,
for single-rank emulation). Every run gets a free port, a hard timeout, a report naming a rank
that died (with its exit code), and faulthandler stack dumps of a hung worker.
"""

from __future__ import annotations

import faulthandler
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, backend: str, args, queue, timeout) -> None:
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
    faulthandler.dump_traceback_later(max(timeout - 10, 1))  # a hung worker shows where it hangs
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        if backend == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        else:
            pg_timeout = timedelta(seconds=min(timeout, 300))
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=pg_timeout)
        result = fn(rank, world, *args)
        dist.barrier()
        # plain pickle copies tensors; torch's queue pickler would share them through file
        # descriptors that die with this process
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(
    fn: Callable,
    world: int,
    *args,
    backend: str = "gloo",
    timeout: float = 240.0,
    ranks: list[int] | None = None,
    env: dict[str, str] | None = None,
) -> list:
    """Run ``fn(rank, world, *args)`` on spawned processes; return the results in rank order.

    Args:
        fn: an importable (module-level) function.
        world: number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or ``"fake"``.
        timeout: seconds before a hung run is killed (and fails).
        ranks: the ranks to start (default all; a subset only with ``backend="fake"``).
        env: extra environment variables for the workers only (set while they start).

    Raises:
        RuntimeError: with the first worker's traceback, when a worker dies (e.g. killed for
            memory), or when the run exceeds ``timeout``.
    """
    ranks = list(range(world)) if ranks is None else ranks
    if backend != "fake" and len(ranks) != world:
        raise ValueError("only the fake backend runs a subset of the ranks")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = {
        r: ctx.Process(
            target=_worker, args=(fn, r, world, port, backend, args, queue, timeout), daemon=True
        )
        for r in ranks
    }
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # inherited by the spawned children only at start
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
                    errors.append(f"timed out after {timeout}s (see the stack dumps above)")
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
