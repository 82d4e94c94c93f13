"""``tsp-plan --max-seq-len``: each layout's longest sequence in its long-context configuration,
against ALST's published lengths and this repo's measured ``benchmarks.maxlen`` run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checks import table

from tsp_ext import planner
from tsp_ext.planner.cli import main
from tsp_ext.planner.longest import long_context, longest, longest_per_layout

GIB = planner.GIB
# ALST's published runs (arXiv 2506.13996; ../shared/alst.md): 8 x H100-80GB nodes with 1.9 TB
# of host memory each, bf16, micro-batch 1, SP = all GPUs, everything offloaded and tiled
ALST_NODE_HOST_GB = 1.9e12 / GIB
PUBLISHED = [
    ("llama3-8b", 1, 500_000),
    ("llama3-8b", 8, 3_700_000),
    ("llama3-8b", 32, 15_000_000),
    ("llama3-70b", 32, 4_000_000),
    ("qwen3-32b", 8, 1_550_000),
]


def alst_longest(model: str, devices: int):
    """ALST's longest sequence for ``model`` on ``devices`` GPUs, with its published settings."""
    m = planner.PRESETS[model]
    c = planner.Cluster(devices=devices, reserved_gb=4, host_memory_gb=ALST_NODE_HOST_GB)
    w = long_context("alst", m, planner.Workload(seq_len=1), devices)
    return longest(m, w, c, planner.Layout("alst", 1, devices, 1)), c


@pytest.mark.parametrize("model,devices,published", PUBLISHED)
def test_alst_reproduces_its_published_lengths_within_25_percent(model, devices, published):
    found, c = alst_longest(model, devices)
    assert found.seq_len == pytest.approx(published, rel=0.25), found
    if model == "llama3-70b":  # "stopped at host RAM with the GPUs about 3/4 full"
        assert found.limit == "host" and 0.6 < found.memory.total / c.memory_bytes < 0.85


def test_max_seq_len_table_for_llama3_8b_on_8_gpus(capsys):
    """The command the docs quote: ALST within 25% of its published 3.7M, TSP past it."""
    assert main(["--model", "llama3-8b", "--devices", "8", "--max-seq-len", "--json"]) == 0
    rows = {(r["layout"], r["sp"]): r for r in json.loads(capsys.readouterr().out)["max_seq_len"]}
    alst, tsp = rows["alst", 8], rows["tsp", 8]
    assert alst["max_seq_len"] == pytest.approx(3_700_000, rel=0.25)
    assert tsp["max_seq_len"] >= 1.5 * alst["max_seq_len"]
    assert tsp["memory_bytes"]["total"] <= (80 - 4) * GIB
    assert main(["--model", "llama3-8b", "--devices", "8", "--max-seq-len"]) == 0
    table = capsys.readouterr().out
    assert "alst sp=8" in table and "limited by" in table


def test_host_memory_limits_offloaded_checkpoints():
    """Less host memory: TSP's length is capped by its offloaded checkpoints, and says so."""
    m = planner.PRESETS["llama3-8b"]
    lay = planner.Layout("tsp", 8, 8, 1)
    w = long_context("tsp", m, planner.Workload(seq_len=1), 8)
    roomy = longest(m, w, planner.Cluster(reserved_gb=4, host_memory_gb=None), lay)
    tight = longest(m, w, planner.Cluster(reserved_gb=4, host_memory_gb=512), lay)
    assert roomy.limit == "device" and tight.limit == "host"
    assert tight.seq_len < roomy.seq_len
    assert tight.memory.host * 8 <= 512 * GIB


def test_no_layout_fits_is_an_error_naming_the_limit(capsys):
    """A budget below every layout's model state: nothing fits, and the table says why."""
    found, _ = longest_per_layout(
        planner.PRESETS["llama3-70b"],
        planner.Workload(seq_len=1),
        planner.Cluster(devices=2, device_memory_gb=8),
        ("tsp", "alst"),
    )
    assert found and all(r.seq_len is None and r.limit == "device" for r in found)
    argv = ["--model", "llama3-70b", "--devices", "2", "--device-memory-gb", "8"]
    assert main([*argv, "--reserved-gb", "0", "--max-seq-len"]) == 0
    assert "none fits" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "llama3-8b", "--devices", "8"])  # neither --seq-len nor --max-seq-len
    assert "--seq-len" in capsys.readouterr().err


def test_offload_checkpoints_needs_full_recompute():
    with pytest.raises(ValueError, match="needs recompute='full'"):
        planner.Workload(seq_len=1024, offload_checkpoints=True)


def test_docs_quote_this_output_and_these_published_rows(capsys):
    """docs/planner.md's --max-seq-len block is the command's output, and its table of ALST's
    published lengths is what this planner predicts for them."""
    text = (Path(__file__).parents[1] / "docs/planner.md").read_text()
    command = "tsp-plan --model llama3-8b --devices 8 --max-seq-len"
    assert main(command.split()[1:]) == 0
    block = text.split(f"{command}\n```\n```\n", 1)[1].split("\n```", 1)[0]
    assert block == capsys.readouterr().out.rstrip("\n")
    rows = table("docs/planner.md", "| model | GPUs | published | predicted |")
    assert [(m, int(n), int(p.replace(",", ""))) for m, n, p, *_ in rows] == PUBLISHED
    for model, devices, _, predicted, ratio, limit, device, host in rows:
        n = int(devices)
        found, _ = alst_longest(model, n)
        published = {(m, d): p for m, d, p in PUBLISHED}[model, n]
        assert predicted == f"{found.seq_len:,}" and ratio == f"{found.seq_len / published:.2f}"
        assert limit == found.limit and device == f"{found.memory.total / GIB:.1f}"
        assert host == f"{found.memory.host * min(n, 8) / GIB:.0f}"
