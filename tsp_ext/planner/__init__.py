"""Layout planner: per-device memory, communication and step time of TSP, TP, SP and TP×SP.

The estimates follow what the code actually keeps, tensor by tensor (see ``docs/planner.md``):
this repo's TSP engine (its attention, MLP ring and vocab-sharded head) and the baselines
as the benchmark harness runs them (Hugging Face Llama under DTensor TP with the model's tp plan,
DeepSpeed Ulysses, both composed for TP×SP). Data parallelism with ZeRO fills the devices a layout
leaves over. Plain arithmetic: this package imports no torch. ``tsp_ext.plan`` is its stable alias.

    from tsp_ext.plan import Cluster, PRESETS, Workload, plan
    result = plan(PRESETS["paper-7b"], Workload(seq_len=131072, recompute="full"), Cluster())
    print(result.recommended.layout, result.reason)

Modules: ``shapes`` (model sizes, presets), ``inputs`` (workload, cluster, layout, results),
``memory``, ``comm``, ``time`` (the three models), ``ranking`` (candidates, checks, the plan),
``longest`` (the longest sequence within device and host memory), ``calibration`` (the time
model fitted to measured steps), ``cli`` (the ``tsp-plan`` command).
"""

from __future__ import annotations

from .comm import COMM, baseline_comm, tsp_comm
from .inputs import (
    DTYPE_BYTES,
    GIB,
    LAYOUTS,
    OPTIMIZERS,
    RECOMPUTE,
    Cluster,
    Estimate,
    Layout,
    Memory,
    Plan,
    Transfer,
    Workload,
)
from .memory import MEMORY, baseline_memory, hf_layer_saved, tsp_layer_saved, tsp_memory
from .ranking import candidates, check, estimate, format_bytes, plan
from .shapes import PRESETS, ModelShape, load_model
from .time import step_flops, step_seconds

__all__ = [
    "COMM",
    "DTYPE_BYTES",
    "GIB",
    "LAYOUTS",
    "MEMORY",
    "OPTIMIZERS",
    "PRESETS",
    "RECOMPUTE",
    "Cluster",
    "Estimate",
    "Layout",
    "Memory",
    "ModelShape",
    "Plan",
    "Transfer",
    "Workload",
    "baseline_comm",
    "baseline_memory",
    "candidates",
    "check",
    "estimate",
    "format_bytes",
    "hf_layer_saved",
    "load_model",
    "plan",
    "step_flops",
    "step_seconds",
    "tsp_comm",
    "tsp_layer_saved",
    "tsp_memory",
]
