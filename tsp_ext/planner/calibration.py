"""Calibrate the step-time model on measured runs: fit a cluster's compute efficiency, link
bandwidth and latency to the step times the benchmark harness measured for each layout.

    rows = json.load(open("docs/benchmarks/results_cpu.json"))      # benchmarks.run --json
    fit = calibrate(measured_runs(rows), Cluster(peak_tflops=0.1), cores=2)
    fit.cluster, fit.worst_error

The fit is a minimax over a log-spaced grid (plain Python, no torch): it minimises the largest
relative error over all runs. ``cores`` models processes that time-share fewer cores than there
are ranks (CPU runs): a step of D ranks on ``cores`` cores takes ``D / cores`` times longer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from .comm import COMM
from .inputs import Cluster, Layout, Workload
from .shapes import ModelShape
from .time import step_seconds

# harness layout name -> planner layout kind (single, tp_sp, ring and variants are not ranked)
HARNESS_KINDS = {"tsp": "tsp", "tp": "tp", "ulysses": "sp", "tpxsp": "tpxsp"}


@dataclass(frozen=True)
class MeasuredRun:
    """One measured training step of one layout and model (a harness row)."""

    model: ModelShape
    kind: str
    tp: int
    sp: int
    seq_len: int
    step_seconds: float
    micro_batch: int = 1
    dtype: str = "float32"

    @property
    def devices(self) -> int:
        return self.tp * self.sp if self.kind != "tsp" else self.tp


@dataclass(frozen=True)
class Calibration:
    """A fitted cluster and how well it reproduces each run (``predicted / measured - 1``)."""

    cluster: Cluster
    errors: tuple[tuple[MeasuredRun, float], ...]

    @property
    def worst_error(self) -> float:
        return max(abs(e) for _, e in self.errors)


def measured_runs(rows: Iterable[Mapping]) -> list[MeasuredRun]:
    """The rows of ``benchmarks.run --json`` that the planner ranks (status ok, ranked layouts)."""
    return [
        MeasuredRun(
            ModelShape.from_hf_config(r["model"], name="measured"),
            kind=HARNESS_KINDS[r["layout"]],
            tp=r["tp"],
            sp=r["sp"],
            seq_len=r["seq_len"],
            step_seconds=r["step_seconds"],
            micro_batch=r.get("micro_batch", 1),
            dtype=r.get("dtype", "float32"),
        )
        for r in rows
        if r.get("status") == "ok" and r["layout"] in HARNESS_KINDS
    ]


def predict(run: MeasuredRun, c: Cluster, cores: int | None = None) -> float:
    """Planner step seconds for ``run``'s layout and workload as the harness runs it (torch AdamW
    on the model's dtype, no data parallelism), time-shared over ``cores`` if fewer than ranks."""
    m = run.model
    w = Workload(run.seq_len, run.micro_batch, run.dtype, optimizer="adamw")
    lay = Layout(run.kind, run.tp, run.sp, dp=1)
    per_layer, per_step = COMM[run.kind](m, w, c, lay)
    share = max(1.0, run.devices / cores) if cores else 1.0
    return share * step_seconds(m, w, c, lay, per_layer=per_layer, per_step=per_step)


# the matmul efficiencies the fit searches (a fit at either end means the peak is wrong)
MFU_RANGE = (0.02, 2.0)


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def calibrate(
    runs: list[MeasuredRun],
    base: Cluster,
    *,
    cores: int | None = None,
    points: int = 16,
) -> Calibration:
    """Fit ``mfu``, ``attention_efficiency``, the link bandwidth (intra-node = inter-node) and
    the latency of ``base`` to ``runs``; returns the cluster with the smallest worst relative
    error."""
    if not runs:
        raise ValueError("no measured runs of a ranked layout (tsp, tp, ulysses, tpxsp) to fit")
    best: tuple[float, Cluster] | None = None
    for mfu in _grid(*MFU_RANGE, points):
        for gbs in _grid(0.05, 50.0, points):
            for latency in (10.0, 30.0, 100.0, 300.0, 1000.0):
                for attn in _grid(0.25, 4.0, 9):
                    c = replace(
                        base,
                        mfu=mfu,
                        intra_node_gbs=gbs,
                        inter_node_gbs=gbs,
                        latency_us=latency,
                        attention_efficiency=attn,
                    )
                    worst = max(abs(math.log(predict(r, c, cores) / r.step_seconds)) for r in runs)
                    if best is None or worst < best[0]:
                        best = (worst, c)
    cluster = best[1]
    errors = tuple((r, predict(r, cluster, cores) / r.step_seconds - 1) for r in runs)
    return Calibration(cluster, errors)
