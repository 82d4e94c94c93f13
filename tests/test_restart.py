"""Faults in the fine-tuning recipe (2 CPU processes): a killed worker restarted by the launcher
resumes from the newest complete checkpoint (``--resume-from auto``) and ends exactly where an
uninterrupted run ends; a NaN loss on one rank is detected by every rank at the same step."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_recipe import RECIPE, ROOT, TINY, metrics, refusal, run_on, side_by_side

from tsp_ext.testing.launch import free_port

pytestmark = pytest.mark.multiproc

AUTO = [*TINY, "--save-every", "2", "--resume-from", "auto"]


def torchrun(*args: str, env=None, timeout: float = 400) -> subprocess.CompletedProcess:
    """The documented restartable launch: c10d rendezvous on a free port, a store per attempt."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    return run([*cmd, "--max-restarts", "1", RECIPE, *args], env, timeout)


def run(cmd: list[str], env, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def weights(out: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(out, "final", "model.safetensors"))


@functools.cache
def runs(workers, tmp: str) -> tuple[str, str, subprocess.CompletedProcess]:
    """Side by side: 4 steps, checkpoints at 2 and 4 (``auto`` finds nothing in the new
    directory), on the kept ranks; and the same run with rank 1 SIGKILLed at the start of step 4
    (rows 1-3 written, checkpoint 2), restarted once by torchrun (docs/faults.md)."""
    straight, out = os.path.join(tmp, "straight"), os.path.join(tmp, "killed")
    res, killed = side_by_side(
        functools.partial(run_on, workers, *AUTO, "--output-dir", straight),
        functools.partial(
            torchrun, *AUTO, "--output-dir", out, env={"TSP_EXT_FAULT_KILL_STEP": "4"}
        ),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "--resume-from auto: no complete checkpoint, a fresh start" in res.stdout
    assert killed.returncode == 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    return straight, out, killed


def test_killed_worker_restarts_and_ends_like_an_uninterrupted_run(workers, tmp):
    straight, out, res = runs(workers, tmp)
    assert "exitcode: -9" in res.stderr  # the worker was killed, and the job restarted
    assert f"--resume-from auto: {os.path.join(out, 'checkpoint-2')}" in res.stdout
    rows, expected = metrics(out), metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # step 3 of the killed attempt dropped
    for a, b in zip(rows, expected):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    a, b = weights(out), weights(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_auto_skips_damaged_and_interrupted_checkpoints(workers, tmp):
    straight, out, _ = runs(workers, tmp)
    with open(os.path.join(out, "checkpoint-4", "trainer_state.json"), "r+") as f:
        f.truncate(10)
    os.makedirs(os.path.join(out, ".checkpoint-6.incomplete"))
    state = os.path.join(out, "checkpoint-4", "trainer_state.json")
    named = [*TINY, "--resume-from", os.path.join(out, "checkpoint-4"), "--output-dir", out]
    rows = metrics(out)
    # named explicitly: refused before any step (the killed run's rows untouched), naming the file
    for message, _ in workers.run(refusal, 2, named):
        assert f"{state} is truncated or corrupt" in message, message
        assert "resume from another checkpoint" in message
    assert metrics(out) == rows
    res = run_on(workers, *AUTO, "--output-dir", out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = res.stdout
    assert f"skipping {os.path.join(out, '.checkpoint-6.incomplete')}: an interrupted save" in log
    assert f"skipping {state} is truncated or corrupt" in log
    assert f"--resume-from auto: {os.path.join(out, 'checkpoint-2')}" in log
    rows, expected = metrics(out), metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # rows 3, 4 rewritten, not appended
    assert [r["loss"] for r in rows] == [r["loss"] for r in expected]


NAN_RUNS = [("ddp", "skip"), ("deepspeed", "skip"), ("fsdp2", "stop")]


@functools.cache
def nan_runs(workers, tmp: str) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Per engine and --on-nonfinite mode, rank 1's loss NaN at step 2 (on the kept ranks)."""
    return {
        (engine, mode): run_on(
            workers, *TINY, "--max-steps", "3", "--save-every", "1", "--data-parallel", engine,
            "--on-nonfinite", mode, "--output-dir", os.path.join(tmp, f"nan-{engine}"),
            env={"TSP_EXT_FAULT_NAN_STEP": "2"},  # rank 1's loss at step 2
        )
        for engine, mode in NAN_RUNS
    }  # fmt: skip


@pytest.mark.parametrize("engine, mode", NAN_RUNS)
def test_nan_loss_on_one_rank_is_detected_on_every_rank(workers, engine, mode, tmp):
    out = os.path.join(tmp, f"nan-{engine}")
    res = nan_runs(workers, tmp)[engine, mode]
    log = res.stdout + res.stderr
    for rank in (0, 1):
        assert f"rank {rank}: non-finite loss at step 2" in log, log[-3000:]
    saved = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    if mode == "stop":
        assert res.returncode != 0
        assert "stopped, no checkpoint of this step" in log
        assert saved == ["checkpoint-1"]
        return
    assert res.returncode == 0, log[-3000:]
    rows = metrics(out)
    assert rows[1]["skipped"] and rows[1]["loss"] is None
    assert rows[1]["lr"] == rows[0]["lr"] != rows[2]["lr"]  # the schedule waited one step
    assert all(torch.isfinite(w).all() for w in weights(out).values())
    assert saved == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_metrics_keep_the_rows_up_to_the_resumed_step(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from finetune_long_llama import open_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(rows) + '{"step": 4, "lo')  # the last row of a killed process
    with open_metrics(str(path), start=2) as f:
        f.write(json.dumps({"step": 3, "loss": 0.5}) + "\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert json.loads(path.read_text().splitlines()[-1])["loss"] == 0.5
