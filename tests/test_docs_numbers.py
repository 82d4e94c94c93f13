"""The exact numbers the docs quote match the JSON each doc links (written by the command the
doc names), and the cheap ones are derived again here from the model's shape."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checks import ROOT, table
from transformers import LlamaConfig, LlamaForCausalLM

RESULTS = ROOT / "docs" / "benchmarks"


def meta_parameters(**config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**config)).parameters())


def test_inference_table_is_its_json_and_the_bytes_follow_from_the_shape():
    from benchmarks.decode import MODEL

    runs = json.loads((RESULTS / "decode_cpu.json").read_text())
    keys = {
        "prefill seconds": ("prefill_s", "{:.3f}"),
        "prefill peak tensor bytes": ("prefill_peak_bytes", "{:,}"),
        "decode tokens/s, batch 1": ("decode_b1_tokens_per_s", "{:.1f}"),
        "KV-cache bytes, batch 1": ("kv_b1_bytes", "{:,}"),
        "decode tokens/s, batch 8": ("decode_b8_tokens_per_s", "{:.1f}"),
        "KV-cache bytes, batch 8": ("kv_b8_bytes", "{:,}"),
        "weight bytes": ("weight_bytes", "{:,}"),
    }
    rows = table("docs/inference.md", "| metric | 1 process")
    assert [r[0] for r in rows] == list(keys)
    for name, *cells in rows:
        key, form = keys[name]
        assert cells == [form.format(run[key]) for run in runs.values()], name
    one, tsp = runs["1 process"], runs["TSP D=2"]
    head_dim = MODEL["hidden_size"] // MODEL["num_attention_heads"]
    cached = 1024 + 32 - 1  # the decode prompt and the new tokens but the last, float32
    per_row = MODEL["num_hidden_layers"] * 2 * MODEL["num_key_value_heads"] * head_dim * cached * 4
    assert (one["kv_b1_bytes"], one["kv_b8_bytes"]) == (per_row, 8 * per_row)
    assert (tsp["kv_b1_bytes"], tsp["kv_b8_bytes"]) == (per_row // 2, 4 * per_row)
    assert one["weight_bytes"] == 4 * meta_parameters(**MODEL)


def test_uneven_table_is_its_json():
    runs = json.loads((RESULTS / "uneven_cpu.json").read_text())
    rows = table("docs/apply_tsp.md", "| model, TSP size |")
    assert len(rows) == len(runs)
    for (_, _, step, params), run in zip(rows, runs):
        assert step == f"{run['step_s']:.3f}"
        counts = [int(n.replace(",", "")) for n in re.findall(r"[\d,]{4,}", params)]
        if "×" in params:  # "3 × n": every rank the same
            counts = counts * int(params.split("×")[0])
        assert counts == run["params_per_rank"], params


def test_emulation_numbers_are_its_json():
    run = json.loads((RESULTS / "emulate_tsp_d8.json").read_text())
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    mib = {k: f"{v / 2**20:.1f}" for k, v in run["memory_bytes"].items()}
    quoted = (
        f"params {mib['params']} MiB, grads {mib['grads']}, optimizer {mib['optimizer']}, saved "
        f"activations {mib['activations']}, peak above step start {mib['peak_delta']}, absolute "
        f"peak {mib['peak']} MiB"
    )
    assert quoted in text
    assert (run["layout"], run["devices"], run["seq_len"]) == ("tsp", 8, 8192)
    assert run["memory_bytes"]["params"] == run["memory_bytes"]["grads"]


def test_big_llama_table_is_its_json_and_the_state_follows_from_the_shape():
    runs = json.loads((RESULTS / "big_llama_memory.json").read_text())
    rows = {r[0]: r[1:] for r in table("docs/recipes.md", "| | per-rank model state |")}
    mb = lambda n: round(n / 2**20)  # noqa: E731
    for name, n in (("D=2", "2"), ("D=4", "4"), ("one process", "1")):
        state, peak, _ = rows[name]
        assert state.startswith(f"{mb(runs[n]['model_state_bytes_per_rank'])} MB"), name
        assert peak == f"{mb(runs[n]['peak_process_bytes'])} MB", name
    one = runs["1"]
    saved = f"+ {one['saved_activation_bytes_per_rank'] / 2**20:.1f} MB saved activations"
    assert saved in rows["one process"][0]
    big = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, vocab_size=32000)
    params = meta_parameters(**big, num_attention_heads=8, num_key_value_heads=8)
    assert one["parameters"] == params and one["model_state_bytes_per_rank"] == 16 * params
    assert {round(r["final_eval_loss"], 4) for r in runs.values()} == {8.8667}


def _searched(runs: list[dict]) -> None:
    """Each row's longest S is within the budget and every longer probe was over it."""
    for run in runs:
        assert run["bytes_at_max"] <= run["budget_bytes"]
        above = [p for p in run["probes"] if p["seq_len"] > run["max_seq_len"]]
        assert all(p["bytes"] is None or p["bytes"] > run["budget_bytes"] for p in above)


@pytest.mark.parametrize("name", ["maxlen_cpu.json", "maxlen_cpu_128.json"])
def test_maxlen_table_is_its_json(name):
    from benchmarks.maxlen import markdown

    runs = json.loads((RESULTS / name).read_text())
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert markdown(runs) in text  # the table maxlen printed, as it printed it
    _searched(runs)


MEMORY_OPTIONS = {  # benchmarks/registry.py's layouts and the TSPConfig options each adds
    "tsp": "defaults",
    "tsp_no_overlap": "`overlap=False`",
    "tsp_layers": "`checkpoint_layers=True, mlp_tile=h`",
    "tsp_offload": "`tsp_layers` + `offload_checkpoints=True`",
    "tsp_long": "`tsp_offload` + `overlap=False, head_bucket=1`",
    "tsp_intervals": "`tsp_long` + `checkpoint_every=2`",
    "ulysses": "(Ulysses, replicated weights, no checkpointing)",
    "alst": "(ALST)",
}


def test_memory_options_time_table_is_its_json():
    """docs/benchmarks.md's step time of each memory option: one ``benchmarks.run`` at D = 2,
    S = 4096 (medians of its rounds), as ratios to TSP's defaults and to Ulysses (the median of
    the per-round ratios, ``vs_ulysses``: the layouts ran in turn, each round under one load)."""
    rows = {r["layout"]: r for r in json.loads((RESULTS / "memory_options_cpu.json").read_text())}
    assert set(rows) == set(MEMORY_OPTIONS)
    assert {(r["devices"], r["seq_len"], r["status"]) for r in rows.values()} == {(2, 4096, "ok")}
    step = {n: r["step_seconds"] for n, r in rows.items()}
    expected = [
        [f"`{n}`", about, f"{step[n]:.3f}", f"{step[n] / step['tsp']:.2f}",
         f"{rows[n]['vs_ulysses']:.2f}"]
        for n, about in MEMORY_OPTIONS.items()
    ]  # fmt: skip
    assert table("docs/benchmarks.md", "| layout | TSP options | step s |") == expected
    assert rows["tsp"]["vs_ulysses"] < 1.1  # the default's cost against replicated Ulysses


def test_dpo_maxlen_numbers_are_their_json():
    """docs/preference.md's DPO lengths against ALST: the table, the one-process length, and the
    fixed parts and per-token growth from the D = 4 probes at S = 4096 and 8192."""
    from benchmarks.maxlen import markdown

    runs = json.loads((RESULTS / "dpo_maxlen_cpu.json").read_text())
    [single] = json.loads((RESULTS / "dpo_single_maxlen_cpu.json").read_text())
    text = (ROOT / "docs" / "preference.md").read_text()
    assert markdown(runs, versus="dpo_alst") in text
    _searched([*runs, single])
    flat = " ".join(text.split())
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    assert f"fits S = {single['max_seq_len']} ({mib(single['bytes_at_max'])} MiB)" in flat
    probes = {
        (r["layout"], r["devices"]): {p["seq_len"]: p["bytes"] for p in r["probes"]} for r in runs
    }
    tsp, alst = probes["dpo_tsp_long", 4], probes["dpo_alst", 4]
    rise = {k: p[8192] - p[4096] for k, p in (("tsp", tsp), ("alst", alst))}
    assert (
        f"the fixed part is {mib(tsp[4096] - rise['tsp'])} MiB for TSP against "
        f"{mib(alst[4096] - rise['alst'])} MiB, and the working sets grow by "
        f"{rise['tsp'] / 4096 / 1024:.2f} against {rise['alst'] / 4096 / 1024:.2f} KiB" in flat
    )
    d2 = probes["dpo_alst", 2][1024], probes["dpo_tsp_long", 2][1024]
    assert f"ALST holds {mib(d2[0])} MiB already at S = 1024, where TSP holds {mib(d2[1])}" in flat
    rows = {(r["layout"], r["devices"]): r for r in runs}
    ratio = lambda key, d: f"{rows['dpo_tsp_long', d][key] / rows['dpo_alst', d][key]:.2f}"  # noqa: E731
    (l2, l4), (t2, t4) = [(ratio(k, 2), ratio(k, 4)) for k in ("max_seq_len", "step_seconds")]
    assert f"**{l2}× (D = 2) and {l4}× (D = 4) the length of DPO on the ALST path**" in flat
    assert f"takes {t2}× (D = 2) and {t4}× (D = 4) the ALST step's time" in flat
    summary = f"TSP {l2}× (D = 2) and {l4}× (D = 4) ALST's length, in {t2}× / {t4}× its step"
    assert summary in " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        f"on {l2}× (D = 2) and {l4}× (D = 4) the sequence length of DPO on the ALST path" in readme
    )


def test_demo_numbers_are_its_json_and_the_parameters_follow_from_the_shape():
    run = json.loads((RESULTS / "demo_cpu.json").read_text())
    memory, tuned = run["memory.json"], run["fine_tuning.json"]
    text = (ROOT / "docs" / "recipes.md").read_text()
    log = text[text.index("```\neval loss:") :]
    before, after = tuned["eval_loss_before"], tuned["eval_loss_after"]
    assert f"eval loss: {before:.4f} before fine-tuning, {after:.4f} after" in log
    assert f"of {tuned['sample_prompt']!r}" in log
    assert f"  before: {tuned['sample_before']!r}\n  after:  {tuned['sample_after']!r}" in log
    eval_loss = run["final_eval.json"]["eval_loss"]
    assert f"single-process eval loss {eval_loss:.4f}" in log and round(eval_loss, 4) == round(
        after, 4
    )
    mb = lambda n: round(n / 2**20)  # noqa: E731
    prose = " ".join(text.split())
    local, full = memory["parameters_per_rank"], memory["parameters"]
    assert (
        f"model state {mb(memory['model_state_bytes_per_rank'])} MB ({local / 1e6:.1f}M of the "
        f"{full / 1e6:.1f}M parameters" in prose
    )
    assert f"saved activations {mb(memory['saved_activation_bytes_per_rank'])} MB" in prose
    assert f"peak process memory {mb(memory['peak_process_bytes'])} MB" in prose
    saved = memory["saved_activation_bytes_per_rank"]
    assert f"{mb(16 * full)} MB of model state and ~{mb(2 * saved)} MB of activations" in prose
    # SmolLM2-135M: 30 layers, h 576, 9 / 3 heads, F 1536, V 49152, tied embeddings; fp32 AdamW
    smollm2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)
    shape = dict(num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    assert full == meta_parameters(**smollm2, **shape)
    assert memory["model_state_bytes_per_rank"] == 16 * local


# the layout names the sweep tables in docs/benchmarks.md print for the harness's layouts
SWEEP_NAMES = {"tsp, overlap off": "tsp_no_overlap", "tpxsp (2×2)": "tpxsp"}


@pytest.mark.parametrize(
    "header,results",
    [
        ("| layout | D | seq | state | activations | peak Δ | step s (rounds) |", "rounds"),
        ("| layout | D | seq | state | activations | peak Δ | step s |", "results_cpu.json"),
    ],
)
def test_sweep_tables_are_their_json_and_the_state_is_the_planners(header, results):
    from tsp_ext import plan as planner

    name = "results_cpu_rounds.json" if results == "rounds" else results
    runs = {
        (r["layout"], r["devices"], r["seq_len"]): r
        for r in json.loads((RESULTS / name).read_text())
    }
    shape = planner.PRESETS["tiny"]
    kind = {"single": "sp", "tsp": "tsp", "tsp_no_overlap": "tsp", "ulysses": "sp", "tp": "tp"}
    kind["tpxsp"] = "tpxsp"
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    rows = [r for r in table("docs/benchmarks.md", header) if r[1].isdigit()]  # not "unsupported"
    assert rows
    for layout, devices, seq, state, saved, peak, step, *_ in rows:
        layout = SWEEP_NAMES.get(layout.strip("*"), layout.strip("*"))
        run = runs[(layout, int(devices), int(seq))]
        m = run["memory_bytes"]
        cells = [
            mib(m["params"] + m["grads"] + m["optimizer"]),
            mib(m["activations"]),
            mib(m["peak_delta"]),
        ]
        assert [c.strip("*") for c in (state, saved, peak)] == cells, (layout, devices, seq)
        times = [run["step_seconds"], *run.get("step_seconds_rounds", [])]
        assert step.replace("*", "").split(" (")[0] == f"{times[0]:.3f}", (layout, devices, seq)
        if len(times) > 1:
            assert step.split("(")[1].rstrip(")") == " ".join(f"{t:.3f}" for t in times[1:])
        work = planner.Workload(seq_len=int(seq), dtype="float32", optimizer="adamw")
        lay = planner.Layout(kind[layout], run["tp"], run["sp"], dp=1)
        predicted = planner.MEMORY[lay.kind](shape, work, lay)
        assert cells[0] == mib(predicted.params + predicted.grads + predicted.optimizer)


def test_maxlen_accounting_is_its_probes():
    """docs/benchmarks.md's fixed part and per-token slope of tsp_long and alst, from the
    probes at (4096, 8192) for D = 2 and (8192, 16384) for D = 4."""
    runs = {
        (r["layout"], r["devices"]): r
        for r in json.loads((RESULTS / "maxlen_cpu.json").read_text())
    }
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    fixed, slope = {}, {}
    for (layout, d), run in runs.items():
        probes = {p["seq_len"]: p["bytes"] for p in run["probes"]}
        lo, hi = (4096, 8192) if d == 2 else (8192, 16384)
        if layout in ("tsp_long", "alst"):
            rise = probes[hi] - probes[lo]
            slope[layout, d] = f"{rise / (hi - lo) / 1024:.2f}"
            fixed[layout, d] = f"{(probes[lo] - rise * lo / (hi - lo)) / 2**20:.1f}"
    assert (
        f"`tsp_long` {fixed['tsp_long', 2]} / {fixed['tsp_long', 4]} MiB, `alst` "
        f"{fixed['alst', 2]} / {fixed['alst', 4]} MiB" in text
    )
    assert (
        f"{slope['tsp_long', 2]} vs {slope['alst', 2]} KiB per token of S at D = 2, "
        f"{slope['tsp_long', 4]} vs {slope['alst', 4]} at D = 4" in text
    )


def test_readme_headline_is_the_maxlen_run():
    runs = {
        (r["layout"], r["devices"], r["budget_bytes"] >> 20): r
        for name in ("maxlen_cpu.json", "maxlen_cpu_128.json")
        for r in json.loads((RESULTS / name).read_text())
    }
    times = {r["layout"]: r for r in json.loads((RESULTS / "memory_options_cpu.json").read_text())}
    readme = " ".join((ROOT / "README.md").read_text().split())
    bench = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())

    def ratios(a, b, digits=2):
        return [f"{runs[a, d, 64]['max_seq_len'] / runs[b, d, 64]['max_seq_len']:.{digits}f}×"
                for d in (2, 4)]  # fmt: skip

    length = ratios("tsp_long", "alst")
    at_128 = [
        f"{runs['tsp_long', d, 128]['max_seq_len'] / runs['alst', d, 128]['max_seq_len']:.2f}×"
        for d in (2, 4)
    ]
    assert f"train **{length[0]} (D = 2) and {length[1]} (D = 4) ALST's sequence length" in readme
    assert f"at 64 MiB per rank and {at_128[0]} / {at_128[1]} at 128 MiB" in readme
    step = times["tsp_long"]["step_seconds"] / times["alst"]["step_seconds"]
    assert f"with a step {step:.2f}× as long" in readme
    versus = "{} / {}".format(*ratios("tsp", "ulysses", digits=1))
    assert f"{versus} the length" in readme and f"{versus} its length" in bench


def test_lora_table_is_its_json():
    """docs/lora.md's table is ``benchmarks.lora``'s table of the JSON it links, and the
    ratios it quotes are that JSON's."""
    from benchmarks.lora import markdown

    result = json.loads((RESULTS / "lora_cpu.json").read_text())
    doc = (ROOT / "docs" / "lora.md").read_text()
    assert markdown(result) in doc
    for row in result["rows"]:
        for name in ("tsp_lora", "tsp_qlora"):
            ratio = f"{row[name]['step_ratio']:.2f}×"
            assert f"D = {row['devices']}" in doc and ratio in doc, (name, ratio)


def test_preference_table_is_its_json():
    """docs/preference.md's table is ``benchmarks.preference``'s table of the JSON it names."""
    from benchmarks.preference import markdown

    result = json.loads((RESULTS / "preference_cpu.json").read_text())
    assert markdown(result) in (ROOT / "docs" / "preference.md").read_text()


def test_grpo_table_is_its_json_and_the_quoted_ratios_follow():
    """docs/benchmarks.md's (and docs/rl.md's) GRPO table is ``benchmarks.grpo``'s table of its
    JSON; the step peaks and time ratios its text quotes are the JSON's."""
    from benchmarks.grpo import markdown

    result = json.loads((RESULTS / "grpo_cpu.json").read_text())
    doc = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    rl = " ".join((ROOT / "docs" / "rl.md").read_text().split())
    assert " ".join(markdown(result).split()) in doc
    assert " ".join(markdown(result).split()) in rl
    rows = {(r["layout"], r["devices"]): r for r in result["rows"]}
    for D in (2, 4):
        probes = rows["tsp", D]["probes"]
        peaks = f"{probes[0]['peak'] / 2**20:.1f} to {probes[-1]['peak'] / 2**20:.1f} MiB (D = {D})"
        assert peaks in doc, peaks
    for (layout, D), row in rows.items():
        for key in ("tokens_per_s_ratio", "step_seconds_ratio"):
            if layout != "trl":
                assert f"{row[key]:.2f}x" in doc, (layout, D, key)


def test_window_table_is_its_json_and_the_bytes_follow_from_the_exchange():
    """docs/engine.md's sliding-window table is ``benchmarks.window``'s table of its JSON, and
    the forward K/V bytes are the keys a rank receives (the exchange's pieces, or (D-1)·S/D for
    the all-gather) times 2 (K and V) · head_dim · 4 bytes · the KV heads of all D head groups,
    max over ranks."""
    from benchmarks.window import MODEL, markdown_table
    from tsp_ext.engine.attention.heads import AttentionSpec
    from tsp_ext.engine.attention.window import WindowExchange
    from tsp_ext.engine.sharding.layout import ZigzagLayout

    rows = json.loads((RESULTS / "window_cpu.json").read_text())
    assert markdown_table(rows) in (ROOT / "docs" / "engine.md").read_text()
    h, n, n_kv = (MODEL[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    for r in rows:
        D, S = r["D"], r["seq_len"]
        assert S == 8 * r["window"]
        spec = AttentionSpec(h, n, n_kv, h // n, D, 1.0)
        ex = WindowExchange.for_layout(ZigzagLayout(S, D), r["window"])
        keys = [ex.moved_rows(p) if r["mode"] == "window" else (D - 1) * S // D for p in range(D)]
        per_key = sum(2 * spec.n_kv(g) * spec.head_dim * 4 for g in range(D))  # every group
        assert r["kv_bytes_fwd"] == max(keys) * per_key, r


def test_moe_tables_are_their_json_and_the_expert_bytes_are_e_over_d():
    """docs/moe.md's tables are ``benchmarks.moe``'s of its JSON files; every row's experts are
    E/D of the model's (float32), and the crossover line is the planner's count."""
    from benchmarks.moe import crossover_table, markdown_table
    from tsp_ext.engine.feed_forward.moe_traffic import traffic

    doc = (ROOT / "docs" / "moe.md").read_text()
    result = json.loads((RESULTS / "moe_cpu.json").read_text())
    assert markdown_table(result["rows"]) in doc
    m = result["model"]
    E, F, h = m["num_experts"], m["moe_intermediate_size"], m["hidden_size"]
    for r in result["rows"]:
        assert r["experts"] == 3 * E * F * h * 4 // r["D"], r
    cross = json.loads((RESULTS / "moe_crossover_cpu.json").read_text())["crossover"]
    for c in cross:
        assert crossover_table(c) in doc
        per_token = traffic(1, m["num_experts_per_tok"], E, F, h, c["D"])
        assert c["planned"] == per_token["ring"] / per_token["all_to_all"]


def test_long_context_tables_are_their_json():
    """docs/long_context.md's tables are ``long_context_report.py``'s of the SmolLM2 runs' JSON;
    the fine-tune's numbers its text quotes are that run's."""
    import sys

    sys.path.insert(0, str(ROOT / "recipes"))
    from long_context_report import passkey_table, ppl_table

    report = json.loads((RESULTS / "long_context_smollm2.json").read_text())
    runs, fine = report["runs"], report["fine_tune"]
    lines = (ROOT / "docs" / "long_context.md").read_text().splitlines()
    for line in ppl_table(runs) + passkey_table(runs):
        assert line in lines, line
    text = " ".join((ROOT / "docs" / "long_context.md").read_text().split())
    losses = fine["fine_tuning"]
    before, after = losses["eval_loss_before"], losses["eval_loss_after"]
    assert f"from {before:.4f} before fine-tuning to {after:.4f} after" in text
    speed = [r["tokens_per_s"] for r in fine["steps"]]
    assert f"{len(speed)} steps" in text and f"{sum(speed) / len(speed):.0f} tokens/s" in text
    assert f"{fine['memory']['peak_process_bytes'] / 2**30:.1f} GiB" in text
    plain = json.loads((RESULTS / "long_context_plain_eval.json").read_text())["eval_loss"]
    assert abs(plain - after) < 1e-4 * after and f"gives {plain:.4f} on the same blocks" in text
    last = {r["label"]: r["ppl"]["buckets"][-1]["ppl"] for r in runs}["original"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"the original model's climbs to {last:.2f}" in readme


def test_vision_table_is_its_json():
    """docs/vision.md's benchmark table is ``benchmarks.vision``'s of its JSON, and the text
    quotes its numbers."""
    from benchmarks.vision import markdown_table

    rows = json.loads((RESULTS / "vision_cpu.json").read_text())["rows"]
    doc = (ROOT / "docs" / "vision.md").read_text()
    lines = doc.splitlines()
    for line in markdown_table(rows).splitlines():
        assert line in lines, line
    tsp = {r["D"]: r for r in rows if r["path"] in ("1 process", "tsp")}
    saved = " → ".join(f"{tsp[d]['saved'] / 2**20:.1f}" for d in (1, 2, 4))
    text = " ".join(doc.split())
    assert f"({saved} MiB)" in text
    share = tsp[1]["vision_saved"] / tsp[1]["saved"]
    assert f"{share:.0%}".replace("%", " %") in text
    assert f"D = 2 runs in {tsp[2]['vs_1_process']:.2f}x" in text
    assert all(not r["ok"] for r in rows if r["path"] in ("ulysses", "ring"))


def test_gpt_oss_table_is_its_json():
    """docs/moe.md's gpt-oss benchmark table is ``benchmarks.gpt_oss``'s of its JSON: TSP's loss
    is the single process's, every other path refuses or answers another."""
    from benchmarks.gpt_oss import markdown_table

    rows = json.loads((RESULTS / "gpt_oss_cpu.json").read_text())["rows"]
    lines = (ROOT / "docs" / "moe.md").read_text().splitlines()
    for line in markdown_table(rows).splitlines():
        assert line in lines, line
    assert all(r["ok"] and r["loss_ok"] for r in rows if r["path"] in ("1 process", "tsp"))
    assert not any(r["ok"] and r["loss_ok"] for r in rows if r["path"] not in ("1 process", "tsp"))


def test_qwen3_next_table_is_its_json():
    """docs/hybrid.md's benchmark table is ``benchmarks.qwen3_next``'s of its JSON, and its prose
    ratios are the JSON's: TSP's loss is the single process's, no other path answers it."""
    from benchmarks.qwen3_next import markdown_table

    rows = json.loads((RESULTS / "qwen3_next_cpu.json").read_text())["rows"]
    text = (ROOT / "docs" / "hybrid.md").read_text()
    for line in markdown_table(rows).splitlines():
        assert line in text.splitlines(), line
    assert all(r["ok"] and r["loss_ok"] for r in rows if r["path"] in ("1 process", "tsp"))
    assert not any(r["ok"] and r["loss_ok"] for r in rows if r["path"] not in ("1 process", "tsp"))
    single, tsp2, tsp4 = rows[0], rows[1], rows[2]
    assert (tsp2["D"], tsp4["D"]) == (2, 4)
    saved = [round(single["saved"] / r["saved"]) for r in (tsp2, tsp4)]
    peak = [single["peak_delta"] / r["peak_delta"] for r in (tsp2, tsp4)]
    assert f"saves {saved[0]}x (D = 2) and {saved[1]}x (D = 4) less" in text
    assert f"grows {peak[0]:.1f}x and {peak[1]:.1f}x less" in text
    assert f"{tsp2['vs_1_process']:.2f}x the single process" in text
