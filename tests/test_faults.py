"""Faults: one rank's bad input fails every rank together, within seconds, and the next good step
runs in step on every rank."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from models import batch, build

from tsp_ext import apply_tsp, init_tsp_mesh, shard_batch
from tsp_ext.testing.launch import run_processes

pytestmark = pytest.mark.multiproc


def _on_rank(local: dict, rank: int, bad_rank: int, key: str, value) -> dict:
    """``local`` with ``key`` set to ``value`` on ``bad_rank`` only (``value(local[key])``)."""
    if rank != bad_rank:
        return local
    return {**local, key: value(local.get(key))}


def one_bad_rank_worker(rank, world):
    mesh = init_tsp_mesh(world)
    model = apply_tsp(build("llama"), mesh)
    V = model.config.vocab_size
    local = shard_batch(batch(V, 2, 16), mesh)

    labels = local["shift_labels"].clone()
    labels[1, 3] = V + 5  # the full batch's label at position 8 (rank 1 holds 4..11)
    bad = {
        "id": _on_rank(
            local, rank, 1, "input_ids", lambda ids: ids.index_fill(1, torch.tensor([2]), V)
        ),
        "label": {**local, "labels": labels, "shift_labels": labels} if rank == 1 else local,
        "mask": _on_rank(local, rank, 1, "attention_mask", lambda _: torch.ones(2, 8)),
        "shape": shard_batch(batch(V, 2, 8), mesh) if rank == 1 else local,
        "positions": _on_rank(local, rank, 0, "position_ids", lambda pos: pos + 1),
    }
    reference = model(**local).loss.detach()
    out = {}
    for case, inputs in bad.items():
        start = time.monotonic()
        try:
            model(**inputs).loss.backward()
            message = "<no error>"
        except ValueError as e:
            message = str(e)
        seconds = time.monotonic() - start
        model.zero_grad()
        loss = model(**local).loss.detach()  # the next good step, on every rank
        losses = [torch.zeros_like(loss) for _ in range(world)]
        dist.all_gather(losses, loss)
        out[case] = (message, seconds, [float(x) for x in losses], float(reference))
    return out


@functools.cache
def results(workers):
    return workers.run(one_bad_rank_worker, 2, timeout=120)


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "id",
            "TSP rank 1 of 2: input_ids must be in [0, 96), got 96 in row 0 at position 6 of",
        ),
        (
            "label",
            "TSP rank 1 of 2: labels must be in [0, 96) or -100, got 101 in row 1 at position 8",
        ),
        ("mask", "TSP rank 1 of 2: a TSP model takes no attention_mask"),
        (
            "shape",
            "TSP ranks got local batches of different shapes (rank 0: [2, 8], rank 1: [2, 4])",
        ),
        ("positions", "TSP rank 0 of 2: position_ids row 0 has 1 at global position 0"),
    ],
)
def test_one_bad_rank_fails_every_rank(workers, case, expected):
    per_rank = [r[case] for r in results(workers)]
    messages = {message for message, *_ in per_rank}
    assert len(messages) == 1, messages  # the same error on every rank
    assert expected in messages.pop()
    for _, seconds, losses, reference in per_rank:
        assert seconds < 10
        assert losses == [reference] * 2  # the next step runs in step, on the same batch


def stopped_peer_worker(rank, world, timeout_s):
    """Rank 1 stops (SIGSTOP) before a step; rank 0 runs it, then lets rank 1 go (SIGCONT)."""
    mesh = init_tsp_mesh(world, timeout=timeout_s)
    model = apply_tsp(build("llama"), mesh)
    local = shard_batch(batch(model.config.vocab_size, 2, 16), mesh)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    start = time.monotonic()
    try:
        model(**local)
        error = "<no error>"
    except Exception as e:  # what the backend raises when a collective times out
        error = f"{type(e).__name__}: {e}"
    finally:
        os.kill(pids[1], signal.SIGCONT)
    return error, time.monotonic() - start


def test_stopped_peer_times_out():
    """A peer that stops (SIGSTOP) fails the others within the mesh's timeout, not gloo's 30
    minutes; the launcher kills whatever is left."""
    error, seconds = run_processes(stopped_peer_worker, 2, 4, timeout=120)[0]
    assert "Timed out" in error, error
    assert 3.5 < seconds < 30
