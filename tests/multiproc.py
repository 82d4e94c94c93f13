"""Run a function on D real processes (gloo, free port, hard timeout) and collect results."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, args, queue, timeout: float) -> None:
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
    faulthandler.dump_traceback_later(max(timeout - 10, 1))  # a hung worker shows where it hangs
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
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


def run_distributed(fn, world: int, *args, timeout: float = 240.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return results by rank.

    ``fn`` must be importable (module level). A worker that raises fails the call with its
    traceback; a hang is killed after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, args, queue, timeout), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
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
        for p in procs:
            p.join(timeout=30 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def error_message(fn) -> str:
    """The message of the ``ValueError`` that ``fn()`` raises (for error tests inside workers)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "<no error>"
