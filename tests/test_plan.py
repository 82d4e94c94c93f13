"""The layout planner: its CLI and JSON, its checks, and its memory model against measurements."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from checks import ROOT, table

from tsp_ext import plan as planner
from tsp_ext.planner.cli import main

EXAMPLE = ["--model", "paper-7b", "--seq-len", "131072", "--devices", "8", "--recompute", "full"]
RESULTS = ROOT / "docs" / "benchmarks"
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "transient", "total", "host"}


def run_json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_schema(capsys):
    doc = run_json(capsys, EXAMPLE)
    assert set(doc) == {"layouts", "recommended"}
    assert {e["layout"] for e in doc["layouts"]} == {"tsp", "tp", "sp", "tpxsp", "alst"}
    for e in doc["layouts"]:
        assert set(e) == {"layout", "tp", "sp", "memory_bytes", "comm_bytes_per_layer"} | {
            "est_step_seconds"
        }
        assert isinstance(e["tp"], int) and isinstance(e["sp"], int)
        mem = e["memory_bytes"]
        assert set(mem) == MEMORY_KEYS and all(isinstance(v, int) for v in mem.values())
        parts = sum(v for k, v in mem.items() if k not in ("total", "host"))  # host: apart
        assert abs(mem["total"] - parts) <= 5  # each part rounded on its own
        assert e["comm_bytes_per_layer"] > 0 and e["est_step_seconds"] > 0
        if e["layout"] == "tsp":
            assert e["tp"] == e["sp"]  # one folded axis
    rec = doc["recommended"]
    assert rec is not None
    chosen = [e for e in doc["layouts"] if (e["layout"], e["tp"], e["sp"]) == tuple(rec.values())]
    assert len(chosen) == 1 and chosen[0]["memory_bytes"]["total"] <= 80 * 2**30


def test_console_script():
    exe = shutil.which("tsp-plan", path=str(Path(sys.executable).parent))
    assert exe, "tsp-plan is not installed: pip install -e ."
    table = subprocess.run([exe, *EXAMPLE], capture_output=True, text=True, check=True).stdout
    assert "recommended:" in table and "tsp=8" in table


def test_cpu_calibration_needs_the_machines_peak(capsys, tmp_path):
    """CPU runs (``--cores``) fitted against the default GPU peak are refused; a fit at the edge
    of the searched mfu range is reported."""
    rows = json.loads((Path(__file__).parents[1] / "docs/benchmarks/results_cpu.json").read_text())
    runs = str(tmp_path / "runs.json")  # TSP's rows only: a fit is a grid search per row
    Path(runs).write_text(json.dumps([r for r in rows if r["layout"] == "tsp"]))
    with pytest.raises(SystemExit, match="Pass the measured machine's peak, e.g. --peak-tflops"):
        main([*EXAMPLE, "--calibrate", runs, "--cores", "2"])
    assert main([*EXAMPLE, "--calibrate", runs, "--cores", "2", "--peak-tflops", "0.1"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*EXAMPLE, "--calibrate", runs, "--peak-tflops", "100"]) == 0
    assert "is probably not the measured machine's peak" in capsys.readouterr().err


def test_table(capsys):
    assert main(EXAMPLE) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "tp=2 x sp=4" in out


def test_tsp_has_the_least_memory_at_long_context(capsys):
    """All 8 devices in the model-parallel group (no data parallel): TSP's total is the least
    of the layouts that keep what this workload says (ALST always checkpoints: --max-seq-len
    compares it with TSP's own long-context configuration)."""
    doc = run_json(capsys, EXAMPLE)
    full = [
        e
        for e in doc["layouts"]
        if (e["tp"] if e["layout"] == "tsp" else e["tp"] * e["sp"]) == 8 and e["layout"] != "alst"
    ]
    assert {e["layout"] for e in full} == {"tsp", "tp", "sp", "tpxsp"}
    assert min(full, key=lambda e: e["memory_bytes"]["total"])["layout"] == "tsp"


def test_layouts_that_cannot_run_are_skipped_with_a_reason(capsys):
    """6 heads: no 4-way TP head split (TSP takes groups of 2, 2, 1, 1); the reason names what
    does not divide. 8 devices: TSP needs a head per rank, and says the largest valid size."""
    shape = planner.ModelShape("six", 384, 2, 6, 6, 64, 1024, 1024)
    result = planner.plan(shape, planner.Workload(seq_len=4096), planner.Cluster(devices=4))
    reasons = {str(lay): why for lay, why in result.skipped}
    assert reasons["tp=4"] == "num_heads=6 is not divisible by tp=4"
    assert {"tsp=2 dp=2", "tsp=4"} <= {str(e.layout) for e in result.estimates}
    result = planner.plan(shape, planner.Workload(seq_len=4096), planner.Cluster(devices=8))
    reasons = {str(lay): why for lay, why in result.skipped}
    assert reasons["tsp=8"] == "tsp=8 exceeds num_heads=6: the largest valid TSP size is 6"


def test_uneven_tsp_counts_the_largest_shard():
    """7 heads, F and V not divisible by 4: TSP=4 weights are the largest rank's (2 heads, 257
    MLP rows, 251 vocabulary rows), more than a quarter of the model and less than a third."""
    shape = planner.ModelShape("seven", 448, 2, 7, 7, 64, 1025, 1001)
    result = planner.plan(shape, planner.Workload(seq_len=4096), planner.Cluster(devices=4))
    est = next(e for e in result.estimates if str(e.layout) == "tsp=4")
    weights = est.memory.params / 2  # bf16 weights (2 bytes per parameter)
    layer = 2 * 448 * 64 * (2 + 2) + 3 * 448 * 257 + 2 * 448
    assert weights == 2 * layer + 2 * 251 * 448 + 448


def test_no_valid_layout_is_an_error_naming_the_fix(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "paper-7b", "--seq-len", "4096", "--devices", "37"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no layout can run paper-7b on 37 devices" in err and "--devices" in err


def test_bad_model_is_an_error(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "missing"), "--seq-len", "4096"])
    assert "neither a preset" in capsys.readouterr().err


def test_vision_language_config_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2_5_vl", "text_config": {}, "vision_config": {}})
    )
    with pytest.raises(ValueError, match="vision-language model's: the planner models causal"):
        planner.load_model(str(tmp_path))


def test_hf_config_file(tmp_path, capsys):
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1408,
        "vocab_size": 4096,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = planner.load_model(str(tmp_path))
    assert (shape.head_dim, shape.qkv_bias, shape.tie_embeddings) == (64, True, True)
    doc = run_json(capsys, ["--model", str(tmp_path), "--seq-len", "8192", "--devices", "4"])
    assert doc["layouts"]


def test_hf_config_kwargs_inverts_from_hf_config():
    """The LlamaConfig kwargs the benchmarks build presets from: head_dim, tying and bias only
    where they differ from what LlamaConfig derives or defaults to."""
    odd = planner.ModelShape("odd", 512, 2, 4, 2, 96, 1024, 4096, True, True)
    for shape in (*planner.PRESETS.values(), odd):
        assert planner.ModelShape.from_hf_config(shape.hf_config_kwargs(), shape.name) == shape
    assert planner.PRESETS["tiny"].hf_config_kwargs() == dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
    )
    extra = {k: odd.hf_config_kwargs()[k] for k in ("head_dim", "tie_word_embeddings")}
    assert extra == {"head_dim": 96, "tie_word_embeddings": True}


def test_model_types_name_each_family_of_hf_families():
    """Each family's ``model_types`` (the config facts the torch-free planner reads) are the
    types whose causal LM is one of its classes, and ``model_type_of`` finds each (the planner
    models causal LMs: vision-language families are refused, below)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tsp_ext.hf.families import FAMILIES, model_type_of

    for family in FAMILIES:
        assert bool(family.model_types) == (family.vision is None), family.name
        for model_type in family.model_types:
            assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type.name] in family.classes
            assert model_type_of({"model_type": model_type.name}) == (family, model_type)


def test_plot_needs_matplotlib_or_writes_png(tmp_path, capsys):
    png = tmp_path / "mem.png"
    argv = ["--model", "tiny", "--seq-len", "4096", "--devices", "4", "--plot", str(png)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit):
            main(argv)
        assert "--plot needs matplotlib" in capsys.readouterr().err
    else:
        assert main(argv) == 0
        assert png.read_bytes()[:4] == b"\x89PNG"


# ---- the memory model against the benchmark harness's measurements ---------------------------

# (harness layout, devices, sequence length): every planner layout, two lengths for TSP; small
# enough for ~90 s on 2 cores (one warm-up and one measured step each)
MEASURED = [
    ("tsp", 2, 256),
    ("tsp", 2, 512),
    ("tp", 2, 512),
    ("ulysses", 2, 256),
    ("tpxsp", 4, 256),
]
PLANNER_KIND = {"tsp": "tsp", "tp": "tp", "ulysses": "sp", "tpxsp": "tpxsp"}
STATE_AND_SAVED = ("params", "grads", "optimizer", "activations")


@pytest.mark.multiproc  # the harness runs the layouts on process groups
@pytest.mark.parametrize("layout,devices,seq_len", MEASURED)
def test_predicted_memory_within_10_percent_of_measured(workers, layout, devices, seq_len):
    from benchmarks.harness import DEFAULT_MODEL, measure

    row = measure(layout, devices, seq_len, steps=1, warmup=1, launch=workers.run)
    assert row["status"] == "ok", row["status"]
    shape = planner.ModelShape.from_hf_config(DEFAULT_MODEL, name="harness")
    assert shape == replace(planner.PRESETS["tiny"], name="harness")
    # as the harness runs: float32, torch AdamW on the model, the engine's defaults (gate/up
    # recomputed; the baselines recompute nothing either way), no data parallelism
    work = planner.Workload(seq_len=seq_len, dtype="float32", optimizer="adamw")
    lay = planner.Layout(PLANNER_KIND[layout], row["tp"], row["sp"], dp=1)
    predicted = planner.MEMORY[lay.kind](shape, work, lay)
    measured = row["memory_bytes"]
    for key in STATE_AND_SAVED:
        assert getattr(predicted, key) == pytest.approx(measured[key], rel=0.10), key
    total = sum(getattr(predicted, k) for k in STATE_AND_SAVED)
    assert total == pytest.approx(sum(measured[k] for k in STATE_AND_SAVED), rel=0.10)
    # the bytes docs/planner.md quotes for this run are a fresh run's, to the byte
    quoted = documented_runs()[(layout, devices, seq_len, "float32")]["memory_bytes"]
    assert {k: quoted[k] for k in STATE_AND_SAVED} == {k: measured[k] for k in STATE_AND_SAVED}


# the runs docs/planner.md's validation table quotes (written by the commands it names)
PLANNER_RUNS = ("planner_check_cpu.json", "planner_check_cpu_bf16.json")


def documented_runs() -> dict[tuple, dict]:
    """The ``benchmarks.run`` rows behind docs/planner.md, by (layout, D, S, dtype)."""
    rows = [r for f in PLANNER_RUNS for r in json.loads((RESULTS / f).read_text())]
    return {(r["layout"], r["devices"], r["seq_len"], r["dtype"]): r for r in rows}


def test_planner_docs_table_is_the_planner_and_its_json():
    shape = replace(planner.PRESETS["tiny"], name="harness")
    runs = documented_runs()
    rows = table("docs/planner.md", "| layout | D | S | dtype |")
    assert len(rows) == len(runs)
    for layout, d, s, dtype, *cells, worst in rows:
        run = runs[(layout, int(d), int(s), dtype)]
        work = planner.Workload(seq_len=int(s), dtype=dtype, optimizer="adamw")
        lay = planner.Layout(PLANNER_KIND[layout], run["tp"], run["sp"], dp=1)
        predicted = planner.MEMORY[lay.kind](shape, work, lay)
        pairs = [(getattr(predicted, k), run["memory_bytes"][k]) for k in STATE_AND_SAVED]
        pairs.append(tuple(map(sum, zip(*pairs))))
        assert cells == [f"{p / 1e6:.3f} / {m / 1e6:.3f}" for p, m in pairs], (layout, d, s)
        assert worst == f"{max(abs(p - m) / m for p, m in pairs):.2%}", (layout, d, s)


# ---- the step-time model against the measured CPU step times ---------------------------------

RESULTS_CPU = RESULTS / "results_cpu.json"


def test_step_time_model_calibrates_within_25_percent_of_measured():
    from tsp_ext.planner.calibration import calibrate, measured_runs

    runs = measured_runs(json.loads(RESULTS_CPU.read_text()))
    assert {r.kind for r in runs} == {"tsp", "tp", "sp", "tpxsp"}
    # the harness's CPU runs: one core each at D = 2, four ranks sharing two cores at D = 4
    fit = calibrate(runs, planner.Cluster(peak_tflops=0.1), cores=2)
    assert fit.worst_error < 0.25, [(r.kind, r.tp, r.sp, r.seq_len, e) for r, e in fit.errors]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_presets_count_the_hf_models_parameters_and_pick_the_schedule(name):
    """A MoE preset's parameters are the Hugging Face model's (built on the meta device from
    its config keys); TSP's per-layer traffic runs the ring or the all-to-all as
    ``engine.feed_forward.moe_traffic.schedule_for`` picks for the tokens a rank holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tsp_ext.engine.feed_forward.moe_traffic import schedule_for
    from tsp_ext.planner.comm import tsp_comm

    shape = planner.PRESETS[name]
    kwargs = shape.hf_config_kwargs()
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    assert shape.params == sum(p.numel() for p in hf.parameters())
    lay = planner.Layout("tsp", 8, 8, 1)
    for seq in (8192, 1 << 20):
        w = planner.Workload(seq_len=seq)
        n, k, E, F = seq // 8, shape.experts_per_token, shape.num_experts, shape.intermediate_size
        picked = schedule_for("auto", n, k, E, F, shape.hidden_size, 8)
        names = [t.name for t in tsp_comm(shape, w, planner.Cluster(), lay)[0]]
        assert ("all-to-all MoE token rows" in names) == (picked == "all_to_all"), (seq, names)
        assert ("ring MLP weights (fwd+bwd)" in names) == (picked == "ring"), (seq, names)
