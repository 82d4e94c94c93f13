"""Smoke test of the benchmark harness: bytes and losses only, never time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.comm_counter import CommCounter
from benchmarks.harness import measure

pytestmark = pytest.mark.multiproc

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)
S = 64


def _collectives(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(torch.ones(4, 100), mesh, [Shard(0)])  # a scatter from rank 0
    with CommCounter() as c:
        dist.all_reduce(torch.ones(100))
        dist.broadcast(torch.ones(100), src=0)
        dist.reduce(torch.ones(100), dst=0)
        dist.all_gather_into_tensor(torch.empty(100 * world), torch.ones(100))
        dist.reduce_scatter_tensor(torch.empty(100), torch.ones(100 * world))
        dist.all_to_all_single(torch.empty(100), torch.ones(100))
        peer = 1 - rank
        ops = [
            dist.P2POp(dist.isend, torch.ones(10), peer),
            dist.P2POp(dist.irecv, torch.empty(10), peer),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        d.redistribute(mesh, [Replicate()])  # DTensor: a functional all-gather
    return dict(c.received)


def test_registry_derives_the_splits_sweep_and_process_wide_layouts():
    """One ``registry.REGISTRY`` entry per layout gives its (tp, sp) split, whether it needs
    processes of its own and whether the default sweep runs it."""
    from benchmarks.registry import LAYOUTS, REGISTRY, SWEEP_LAYOUTS, TRAINING_LAYOUTS, tp_sp_split

    splits = {n: tp_sp_split(n, 4) for n in LAYOUTS}
    assert splits["single"] == splits["dpo_single"] == (1, 1)
    assert {splits[n] for n in LAYOUTS if n.startswith(("tsp", "dpo_tsp"))} == {(4, 4)}
    assert splits["tp"] == splits["tp_sp"] == (4, 1) and splits["tpxsp"] == (2, 2)
    assert {splits[n] for n in ("ulysses", "ring", "ulysses_zero3", "alst", "dpo_alst")} == {(1, 4)}
    with pytest.raises(ValueError, match="at least 4"):
        tp_sp_split("tpxsp", 2)
    with pytest.raises(ValueError, match="unknown layout"):
        tp_sp_split("nope", 2)
    assert {n for n, e in REGISTRY.items() if e.process_wide} == {
        "ulysses",
        "tpxsp",
        "ulysses_zero3",
        "alst",
        "dpo_alst",
    }
    assert SWEEP_LAYOUTS == (
        "single", "tsp", "tsp_no_overlap", "tsp_keep_mlp", "tsp_long", "tp", "tp_sp", "ulysses",
        "tpxsp", "ring", "alst",
    )  # fmt: skip
    assert TRAINING_LAYOUTS == tuple(n for n in LAYOUTS if not n.startswith("dpo_"))
    assert REGISTRY["dpo_single"].ranks(4) == REGISTRY["single"].ranks(4) == 1


def test_benchmarks_have_no_import_cycle():
    """The modules of ``benchmarks/`` import each other (at module level or inside a function)
    without a cycle."""
    import ast
    from pathlib import Path

    folder = Path(__file__).parents[1] / "benchmarks"
    names = {p.stem for p in folder.glob("*.py")}
    edges = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                found.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                found.add(node.module.split(".")[1])
        edges[path.stem] = found & names
    done, active = set(), []

    def visit(mod):
        assert mod not in active, f"import cycle: {' -> '.join([*active, mod])}"
        if mod not in done:
            active.append(mod)
            for dep in sorted(edges[mod]):
                visit(dep)
            active.pop()
            done.add(mod)

    for mod in sorted(edges):
        visit(mod)
    assert edges["emulate"] >= {"mirror"} and "emulate" not in edges["emulate_fake"]


def test_comm_counter_bytes_received(workers):
    r0, r1 = workers.run(_collectives, 2, timeout=120)
    # fp32, G = 2: all-reduce 2·(G-1)/G·400, gathers/scatters (G-1)/G of the full tensor
    common = dict(all_reduce=400, reduce_scatter=400, all_to_all=200, send_recv=40)
    assert r0 == {**common, "broadcast": 0, "reduce": 400, "all_gather": 400 + 800}
    assert r1 == {**common, "broadcast": 400, "reduce": 0, "all_gather": 400 + 800}


@pytest.fixture(scope="module")
def rows(workers) -> dict[str, dict]:
    return {
        layout: measure(layout, 2, S, TINY, steps=1, warmup=1, timeout=120, launch=workers.run)
        for layout in ("single", "tsp", "tp", "tsp_long")
    }


def test_rows_ok_and_losses_agree(rows):
    single = rows["single"]
    for layout, row in rows.items():
        assert row["status"] == "ok", (layout, row["status"])
        for key in ("loss", "final_loss"):
            assert row[key] == pytest.approx(single[key], rel=1e-4), (layout, key)
        mem = row["memory_bytes"]
        assert all(mem[k] > 0 for k in ("params", "grads", "optimizer", "activations", "peak"))
        if layout != "single":
            assert row["comm_bytes"] and all(v >= 0 for v in row["comm_bytes"].values())
            assert sum(row["comm_bytes"].values()) > 0


def test_tsp_model_state_is_sharded(rows):
    def state(row):
        m = row["memory_bytes"]
        return m["params"] + m["grads"] + m["optimizer"]

    assert state(rows["tsp"]) < state(rows["single"])
    assert (
        rows["tsp"]["memory_bytes"]["activations"] < rows["single"]["memory_bytes"]["activations"]
    )
    assert rows["tp"]["comm_bytes"]["all_reduce"] > 0  # TP's activation all-reduces were counted


def _alst_gradient_errors(rank: int, world: int) -> dict[str, float]:
    """The ``alst`` layout's loss and gradients (gathered from ZeRO-3's partitions) against the
    unmodified model's on the whole sequence, relative to the largest reference value."""
    import copy

    from deepspeed.utils import safe_get_full_grad

    from benchmarks.harness import build_model, make_batch
    from benchmarks.registry import REGISTRY

    seq = 256  # 4 MLP tiles of h = 32 tokens per rank
    model = build_model(TINY, torch.float32, seq)
    ref = copy.deepcopy(model)
    ids = make_batch(model.config.vocab_size, 1, seq)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    prep = REGISTRY["alst"].build(model, ids, world, torch.device("cpu"))
    local, total = prep.loss()
    prep.deepspeed_engine.backward(local)
    errs = {"loss": abs(float(total) - ref_loss.item()) / ref_loss.item()}
    for (name, p), q in zip(prep.model.named_parameters(), ref.parameters()):
        errs[name] = ((safe_get_full_grad(p) - q.grad).abs().max() / q.grad.abs().max()).item()
    errs["host"] = prep.host_store.held  # the offloaded layer inputs, released by backward
    return errs


def test_alst_baseline_is_exact():
    """DeepSpeed's ALST as the benchmarks run it (ZeRO-3 over the SP ranks, Ulysses, TiledMLP,
    TiledFusedLogitsLoss, layer checkpoints offloaded): the loss and every gradient of one
    process, in float32 (its own processes: Ulysses patches transformers process-wide)."""
    from tsp_ext.testing.launch import run_processes

    for errs in run_processes(_alst_gradient_errors, 2, timeout=180):
        assert errs.pop("host") == 0
        assert len(errs) == 1 + 2 + 9 + 1  # loss, embedding and head, a layer, the final norm
        assert max(errs.values()) < 1e-5, errs


def _dpo_gradient_errors(rank: int, world: int) -> dict[str, float]:
    """The DPO layouts' loss and policy gradients against ``dpo_single``'s (one process, the whole
    pair), relative to the largest reference value. Policy and reference start equal, so the loss
    is log 2 only if each layout's reference log-probabilities equal its policy's. TSP first:
    ``dpo_alst`` patches transformers' attention process-wide."""
    import copy

    from deepspeed.utils import safe_get_full_grad

    from benchmarks.harness import build_model, make_batch
    from benchmarks.registry import REGISTRY
    from tsp_ext import full_grads

    seq = 256  # 2 MLP tiles of h = 32 tokens per rank; a log-probability tile each
    model = build_model(TINY, torch.float32, seq)
    ids = make_batch(model.config.vocab_size, 1, seq)
    cpu = torch.device("cpu")

    def run(layout: str, policy: torch.nn.Module):
        prep = REGISTRY[layout].build(policy, ids, world if layout != "dpo_single" else 1, cpu)
        local, total = prep.loss()
        prep.deepspeed_engine.backward(local) if prep.deepspeed_engine else local.backward()
        return prep, float(total)

    single, expect = run("dpo_single", copy.deepcopy(model))
    grads = {n: p.grad for n, p in single.model["policy"].named_parameters()}
    tsp, tsp_loss = run("dpo_tsp_long", copy.deepcopy(model))
    alst, alst_loss = run("dpo_alst", model)
    errs = {"tsp loss": abs(tsp_loss - expect) / expect}
    errs["alst loss"] = abs(alst_loss - expect) / expect
    for name, g in full_grads(tsp.model["policy"]).items():
        errs[f"tsp {name}"] = ((g - grads[name]).abs().max() / grads[name].abs().max()).item()
    for name, p in alst.model["policy"].named_parameters():
        g = safe_get_full_grad(p) - grads[name]
        errs[f"alst {name}"] = (g.abs().max() / grads[name].abs().max()).item()
    errs["host"] = alst.host_store.held + tsp.host_store.held
    errs["single loss"] = expect
    return errs


def test_dpo_layouts_are_exact():
    """DPO on the ALST path as the benchmarks assemble it, and under TSP's longest-context
    options: the loss and every policy gradient of one process, in float32."""
    from tsp_ext.testing.launch import run_processes

    for errs in run_processes(_dpo_gradient_errors, 2, timeout=180):
        assert errs.pop("host") == 0
        assert errs.pop("single loss") == pytest.approx(0.6931471805599453, rel=1e-6)  # log 2
        assert len(errs) == 2 + 2 * (2 + 9 + 1), sorted(errs)
        assert max(errs.values()) < 1e-5, errs


def test_maxlen_table_has_ratios_to_alst():
    from benchmarks.maxlen import markdown

    row = dict(status="ok", budget_bytes=64 * 2**20, host_bytes_at_max=None)
    rows = [
        {**row, "layout": "alst", "devices": 2, "max_seq_len": 4000, "bytes_at_max": 60 * 2**20},
        {**row, "layout": "tsp", "devices": 2, "max_seq_len": 6000, "bytes_at_max": 63 * 2**20},
    ]
    rows[0]["step_seconds"], rows[1]["step_seconds"] = 2.0, 1.5
    table = markdown(rows)
    assert "| tsp | 2 | 6000 | 1.50 | 63.0 | — | 1.500 | 0.75 |" in table
    assert "| alst | 2 | 4000 | 1.00 | 60.0 | — | 2.000 | 1.00 |" in table


def test_combine_rounds_takes_medians_and_keeps_failures():
    from benchmarks.run import combine_rounds

    def row(step, peak, status="ok"):
        return {
            "status": status,
            "micro_batch": 1,
            "seq_len": 100,
            "step_seconds": step,
            "tokens_per_s": 100 / step,
            "memory_bytes": {"peak": peak, "activations": 7},
        }

    out = combine_rounds([row(2.0, 30), row(1.0, 10), row(4.0, 20)])
    assert out["step_seconds"] == 2.0 and out["step_seconds_rounds"] == [2.0, 1.0, 4.0]
    assert out["tokens_per_s"] == 50.0
    assert out["memory_bytes"] == {"peak": 20, "activations": 7}
    assert combine_rounds([row(1.0, 1), row(1.0, 1, status="oom")])["status"] == "oom"


def test_ulysses_ratio_pairs_the_rounds():
    from benchmarks.report import add_ulysses_ratio, markdown_table

    def row(layout, rounds, devices=2, status="ok"):
        steps = {"step_seconds_rounds": rounds} if rounds else {}
        return {
            "layout": layout,
            "devices": devices,
            "tp": 1,
            "sp": devices,
            "seq_len": 8,
            "micro_batch": 1,
            "status": status,
            "step_seconds": sorted(rounds or [1.0])[len(rounds or [1]) // 2],
            **steps,
        }

    # the machine slowed down in round 2: paired ratios 0.9, 0.9, 1.2 -> median 0.9
    rows = add_ulysses_ratio(
        [row("ulysses", [1.0, 2.0, 1.0]), row("tsp", [0.9, 1.8, 1.2]), row("tsp", None, devices=4)]
    )
    assert rows[0]["vs_ulysses"] == 1.0 and abs(rows[1]["vs_ulysses"] - 0.9) < 1e-12
    assert "vs_ulysses" not in rows[2]  # no Ulysses row at D = 4
    failed = add_ulysses_ratio([row("ulysses", [1.0], status="oom"), row("tsp", [1.0])])
    assert "vs_ulysses" not in failed[1]
    assert "| vs Ulysses |" in markdown_table(failed[:1])


def test_profile_step_names_the_tsp_functions():
    from benchmarks.profile_step import markdown, profile

    res = profile("tsp", 256, {"num_hidden_layers": 1}, top=40, timeout=120)
    names = [r["name"] for r in res["top"]]
    assert res["step_ms"] > 0 and res["device_busy_ms"] == 0  # CPU: no kernels
    assert "fwd:TSPAttention" in names and "_TSPMLPFunctionBackward" in names
    assert markdown(res).count("\n| ") == len(res["top"]) + 1


def test_longest_bisects_to_within_a_sixteenth():
    from benchmarks.maxlen import longest

    for limit_fit in (100, 1000, 4096, 70000):
        asked = []

        def fits(s, limit_fit=limit_fit, asked=asked):
            asked.append(s)
            return s <= limit_fit

        best = longest(fits, start=512, granule=16, limit=1 << 20)
        assert best % 16 == 0 and best <= limit_fit, (limit_fit, best)
        assert limit_fit - best <= max(16, best // 16), (limit_fit, best)
        assert len(asked) < 20  # doubling, then bisection
    assert longest(lambda s: False, start=512, granule=16, limit=1 << 20) is None
    assert longest(lambda s: True, start=512, granule=16, limit=4096) == 4096


@pytest.mark.multiproc
def test_maxlen_search_finds_the_budgets_edge(workers):
    """TSP at D = 2 on the tiny model: the longest S under a budget fits it, and the next
    probe above it does not."""
    from benchmarks.maxlen import rank_bytes, search

    at_256 = measure("tsp", 2, 256, TINY, steps=1, warmup=1, timeout=120, launch=workers.run)
    budget = int(rank_bytes(at_256) * 1.6)  # some length between 256 and a few thousand
    row = search("tsp", 2, budget, start=256, model_cfg=TINY, launch=workers.run)
    assert row["status"] == "ok" and row["max_seq_len"] >= 256, row
    assert row["bytes_at_max"] <= budget
    above = [p for p in row["probes"] if p["seq_len"] > row["max_seq_len"]]
    assert above and all(p["bytes"] > budget for p in above), row["probes"]


def test_window_rows_measure_less_kv_traffic_than_the_all_gather():
    """``benchmarks.window`` at S = 8W, D = 2: a rank receives the W - 1 keys before one of its
    chunks instead of the other rank's S/2, forward and backward (a re-gather and dK/dV going
    home)."""
    from benchmarks.window import bench, markdown_table

    rows = bench(window=8, seq=64, sizes=[2], steps=1)
    window, gather = rows
    assert (window["mode"], gather["mode"]) == ("window", "all-gather")
    assert 32 * window["kv_bytes_fwd"] == 7 * gather["kv_bytes_fwd"] > 0
    assert 32 * window["kv_bytes_bwd"] == 7 * gather["kv_bytes_bwd"]
    assert gather["kv_bytes_bwd"] == 2 * gather["kv_bytes_fwd"]
    assert (window["kv_tokens_held"], gather["kv_tokens_held"]) == (39, 64)
    assert markdown_table(rows).count("\n| 2 |") == 2


def test_moe_rows_hold_e_over_d_experts_and_move_what_each_schedule_plans():
    """``benchmarks.moe`` at D = 2 on a small block: each rank holds half the experts; the ring
    receives the other rank's experts forward and experts plus gradients backward; the
    all-to-all receives its experts' assignment counts and rows of h floats; both save the same
    bytes, less than one process's."""
    from benchmarks.moe import bench, markdown_table

    model = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    one, ring, a2a = bench(model, seq=64, sizes=[2], steps=1)
    assert (one["schedule"], ring["schedule"], a2a["schedule"]) == (
        "1 process",
        "ring",
        "all_to_all",
    )
    experts = 4 * 3 * 16 * 32 * 4  # bytes, float32
    assert one["experts"] == experts and ring["experts"] == a2a["experts"] == experts // 2
    assert ring["recv_fwd"] == experts // 2  # the other rank's two experts
    counts = 2 * 8  # the other rank's assignment counts for my two experts (int64)
    assert (a2a["recv_fwd"] - counts) % (32 * 4) == 0 and a2a["recv_fwd"] > counts
    assert ring["saved"] == a2a["saved"] < one["saved"]
    assert markdown_table([one, ring, a2a]).count("\n| 2 |") == 2


def test_grpo_rows_tsp_below_trl(tmp_path):
    """``benchmarks.grpo --quick`` at D = 2: a row per layout, every rank measured and timed;
    at the first probed length TSP's per-rank bytes (state and step peak) are below one-process
    TRL's and ZeRO-3's, and the longest completions found keep within the budget. Each layout
    runs in fresh processes, as the benchmark does: on the kept ranks, after the DeepSpeed runs
    of earlier tests, it has failed (DeepSpeed's ``mpu`` None after test_docs.py) and crashed
    (a segfault in one CI run)."""
    from benchmarks.grpo import QUICK, QUICK_SETTINGS, markdown, run

    settings = dict(QUICK_SETTINGS, model=QUICK, out=str(tmp_path))
    result = run([2], ["trl", "zero3", "tsp"], settings)
    rows = {r["layout"]: r for r in result["rows"]}
    assert [(r["layout"], r["devices"]) for r in result["rows"]] == [
        ("trl", 1),
        ("zero3", 2),
        ("tsp", 2),
    ]
    first = {name: r["probes"][0] for name, r in rows.items()}
    assert {p["len"] for p in first.values()} == {settings["start"]}
    for key in ("state", "peak"):
        assert first["tsp"][key] < first["zero3"][key] < first["trl"][key], (key, first)
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["step_seconds"] > 0
        for p in r["probes"]:
            assert p["bytes"] == p["state"] + p["peak"] > 0
        if r["max_len"] is not None:
            assert r["bytes_at_max"] <= settings["budget"] and r["max_len"] % 32 == 0
    assert rows["tsp"]["max_len"] >= (rows["zero3"]["max_len"] or 0)
    assert rows["trl"]["tokens_per_s_ratio"] == rows["trl"]["step_seconds_ratio"] == 1.0
    assert markdown(result).count("\n| ") == 3  # a line per row


def test_self_check_table_is_its_json():
    """docs/benchmarks.md's self-check table is ``benchmarks.self_check``'s JSON, rendered, and
    the ranges its text quotes hold."""
    import json
    from pathlib import Path

    from benchmarks.self_check import TYPES, markdown_table

    root = Path(__file__).parents[1]
    rows = json.loads((root / "docs/benchmarks/self_check_cpu.json").read_text())["rows"]
    assert {r["model_type"] for r in rows} == set(TYPES)
    doc = (root / "docs/benchmarks.md").read_text()
    assert markdown_table(rows) in doc
    longer = ("gemma3_text", "qwen3_next", "qwen3_5_text")
    assert max(r["seconds"] for r in rows if r["model_type"] not in longer) <= 0.6, rows
    hybrid = [r["seconds"] for r in rows if r["model_type"] in longer[1:] and r["D"] == 4]
    assert f"{min(hybrid):.1f}–{max(hybrid):.1f} s at D = 4" in " ".join(doc.split())
