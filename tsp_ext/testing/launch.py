"""Run a function on D local processes and collect the results: the one launcher of the tests
and the benchmarks.

Backends: ``gloo`` (CPU), ``nccl`` (one GPU per rank) and ``fake`` (PyTorch's fake process group:
only the ``ranks`` asked for start, each alone in a D-rank world whose collectives move no data,
for single-rank emulation). Every run gets a free port, a hard timeout, a report naming a rank
that died (with its exit code), and faulthandler stack dumps of a hung or crashed worker.

``run_processes`` starts fresh processes for one function; ``WorkerPool`` keeps D ranks and
their process group alive to run many functions in turn (what the test suite uses: starting
a rank, importing torch and transformers and joining a group is most of a short test's time).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, world: int, port: int, backend: str, timeout: float) -> None:
    """This process as rank ``rank`` of a ``world``-rank group: one thread, the launcher's
    environment variables, the default process group."""
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
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        if backend == "gloo":
            _share_one_gloo_device()
        pg_timeout = timedelta(seconds=min(timeout, 300))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=pg_timeout)


def _share_one_gloo_device() -> None:
    """Every gloo process group this process creates from now on uses one transport device.

    torch gives each gloo group a device of its own, and each device a thread that wakes every
    10 ms (gloo's epoll loop) for as long as the group lives. A kept rank accumulates hundreds of
    groups over a test session (meshes, DeepSpeed's and FSDP's groups), whose idle wake-ups then
    take a large share of the machine's cores. One device serves any number of groups.
    """
    c10d = dist.distributed_c10d
    gloo = dist.ProcessGroupGloo
    if getattr(c10d.ProcessGroupGloo, "_shared_device", None) is not None:
        return
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    device = gloo.create_device(interface=interface) if interface else gloo.create_default_device()

    class SharedDeviceGloo(gloo):
        _shared_device = device

        def __init__(self, store, rank, size, timeout=timedelta(minutes=30)):
            options = gloo._Options()
            options._devices = [device]
            options._threads = 2  # torch's default: two per device
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def _run_one(fn, rank: int, world: int, args, timeout: float, results, stacks=sys.stderr) -> None:
    """``fn(rank, world, *args)``, its result or traceback put on ``results``; its stacks
    dumped to ``stacks`` if it runs 10 s short of ``timeout`` (where a hung worker hangs) or
    if a fatal signal kills it (what the report of its death quotes)."""
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.dump_traceback_later(max(timeout - 10, 1), file=stacks)
    try:
        result = fn(rank, world, *args)
        dist.barrier()
        # plain pickle copies tensors; torch's queue pickler would share them through file
        # descriptors that die with this process
        results.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        faulthandler.disable()  # it holds the file, which its caller closes


def _worker(fn, rank: int, world: int, port: int, backend: str, args, results, timeout) -> None:
    try:
        _join_group(rank, world, port, backend, timeout=timeout)
        _run_one(fn, rank, world, args, timeout=timeout, results=results)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: dict, results, timeout: float, stacks=None, exit_ok: bool = True) -> list:
    """The results of ``procs`` in rank order; raises on a worker's error, death (any exit
    unless ``exit_ok``: a rank that is done may exit 0) or timeout, quoting then the stack dumps
    of the ranks in ``stacks`` (rank -> file)."""
    got: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    ended = (None, 0) if exit_ok else (None,)
    while len(got) < len(procs) and not errors:
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue_mod.Empty:
            errors = _deaths(procs, ended, stacks)
            if not errors and time.monotonic() > deadline:
                errors.append(f"timed out after {timeout}s{_stack_dumps(stacks)}")
            continue
        if status == "ok":
            got[rank] = pickle.loads(payload)
        else:
            # the error may be the echo of another rank's crash (gloo: "closed by peer"), which
            # has ended that rank by the time its peer's report arrives
            errors += [f"rank {rank}:\n{payload}", *_deaths(procs, ended, stacks)]
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [got[r] for r in sorted(procs)]


def _deaths(procs: dict, ended: tuple, stacks: dict[int, str] | None) -> list[str]:
    """A report for each rank that exited (with a code not in ``ended``), quoting its stack
    dump (written by faulthandler when a signal killed it)."""
    return [
        f"rank {r} died with exit code {p.exitcode}{_stack_dumps(stacks and {r: stacks[r]})}"
        for r, p in sorted(procs.items())
        if p.exitcode not in ended
    ]


def _stack_dumps(stacks: dict[int, str] | None) -> str:
    """The ranks' stack dumps from their files, or where to find them (the workers' stderr)."""
    if not stacks:
        return " (see the stack dumps above)"
    text = ""
    for rank, path in sorted(stacks.items()):
        dump = Path(path).read_text() if Path(path).exists() else ""  # none before a first task
        text += f"\nrank {rank}:\n{dump or '(no stack dump written)'}"
    return text


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
    results = ctx.Queue()
    port = free_port()
    procs = {
        r: ctx.Process(
            target=_worker, args=(fn, r, world, port, backend, args, results, timeout), daemon=True
        )
        for r in ranks
    }
    with mock.patch.dict(os.environ, env or {}):  # inherited by the children at start
        for p in procs.values():
            p.start()
    failed = True
    try:
        out = _collect(procs, results, timeout)
        failed = False
        return out
    finally:
        for p in procs.values():
            p.join(timeout=1 if failed else 30)
            if p.is_alive():
                p.kill()


def _pool_worker(rank: int, world: int, port: int, backend: str, tasks, results, stacks) -> None:
    """Join the group once, then run each task from ``tasks`` in turn (a hung task's stacks go
    to the file ``stacks``, which the parent quotes)."""
    _join_group(rank, world, port, backend, timeout=300)
    import torch

    environ = dict(os.environ)
    seed = torch.initial_seed()
    while True:  # until the pool kills this process
        fn, args, timeout = pickle.loads(tasks.get())
        with open(stacks, "w") as stack_file:
            _run_one(fn, rank, world, args, timeout=timeout, results=results, stacks=stack_file)
        # the next task starts as in a fresh process: environment, defaults, RNG. The process
        # groups it created stay: DTensor caches sharding decisions by mesh *value*, so a later
        # mesh of the same shape may be handed an earlier one whose groups must still exist
        os.environ.clear()
        os.environ.update(environ)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.manual_seed(seed)
        gc.collect()
        # what survives a task (modules, caches) is kept for good: later collections, this one's
        # and Python's own, need not walk the ~400k objects of torch, transformers, DeepSpeed
        gc.freeze()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # an idle rank gives its peak back


class WorkerPool:
    """``world`` spawned gloo ranks, one process group, kept alive to run many functions.

    ``run(fn, *args)`` is ``run_processes(fn, world, *args)`` without the start-up: each rank
    runs ``fn(rank, world, *args)`` and returns to wait for the next function, its environment,
    default dtype, grad mode and RNG seed reset to how they were before (process groups it
    created stay alive). A function that fails, hangs past its timeout or kills a rank fails its
    caller with the same report as ``run_processes``, and the pool starts afresh for the next.

    Not for functions that measure a process's peak memory, end the process group, or need a
    process of their own (faults, elastic restarts): use ``run_processes`` for those.
    """

    def __init__(self, world: int, backend: str = "gloo"):
        self.world, self.backend = world, backend
        self._procs: dict[int, mp.Process] = {}

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._dir = tempfile.TemporaryDirectory(prefix=f"tsp_pool{self.world}_")
        self._stacks = {r: os.path.join(self._dir.name, f"rank{r}.txt") for r in range(self.world)}
        port = free_port()
        self._procs = {
            r: ctx.Process(
                target=_pool_worker,
                args=(r, self.world, port, self.backend, q, self._results, self._stacks[r]),
                daemon=True,
            )
            for r, q in enumerate(self._tasks)
        }
        for p in self._procs.values():
            p.start()

    def run(self, fn: Callable, *args, timeout: float = 240.0) -> list:
        """``fn(rank, world, *args)`` on every rank; the results in rank order (raises as
        ``run_processes`` does)."""
        if not self._procs or any(p.exitcode is not None for p in self._procs.values()):
            self.close()
            self._start()
        task = pickle.dumps((fn, args, timeout))
        for q in self._tasks:
            q.put(task)
        try:
            return _collect(self._procs, self._results, timeout, self._stacks, exit_ok=False)
        except BaseException:
            self.close()  # the other ranks may wait in a collective forever
            raise

    def close(self) -> None:
        """Stop the ranks. They are killed: they hold nothing to save, and an orderly exit of a
        process with many gloo groups takes seconds (or aborts: the gloo exit flake)."""
        for p in self._procs.values():
            if p.is_alive():
                p.kill()
            p.join()
        self._procs = {}
        if hasattr(self, "_dir"):
            self._dir.cleanup()


class WorkerPools:
    """A ``WorkerPool`` per world size, each started on its first use."""

    def __init__(self, backend: str = "gloo"):
        self.backend = backend
        self._pools: dict[int, WorkerPool] = {}

    def run(
        self,
        fn: Callable,
        world: int,
        *args,
        timeout: float = 240.0,
    ) -> list:
        """``run_processes(fn, world, *args, timeout=timeout)`` on the kept ranks."""
        if world not in self._pools:
            self._pools[world] = WorkerPool(world, self.backend)
        return self._pools[world].run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
