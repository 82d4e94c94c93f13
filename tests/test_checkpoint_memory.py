"""Peak host memory per rank of shard-on-read loading, a training-state save (DCP), the
streaming HF export and a DeepSpeed ZeRO-2 training-state save, at D=4, next to the rank's own
state and the full model (a 673 MB float32 Llama). Each phase's peak is the rise of VmHWM over the
RSS just before it (VmHWM is reset, freed heap memory handed back first), in fresh processes
whose glibc maps every allocation from 128 KiB on by itself: the kept ranks of the ``workers``
pool reuse memory earlier tests freed (their load rise was 49 MB lower late in a full suite run),
and docs/checkpoints.md quotes a fresh run."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import tempfile

import pytest
import torch
from checks import table

from tsp_ext import (
    TSPConfig,
    checkpoint,
    init_tsp_mesh,
    load_pretrained,
    save_pretrained,
    shard_batch,
)
from tsp_ext.hf.self_check import self_check
from tsp_ext.testing.launch import run_processes

pytestmark = pytest.mark.multiproc

BIG = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    vocab_size=32000,
    num_attention_heads=8,
    num_key_value_heads=8,
)
SHARD = 64 * 2**20  # export max_shard_size
GROUP = 64 * 2**20  # DeepSpeed save: max_group_bytes (one decoder layer, 51 MB, per group)
ALLOWANCE = 48 * 2**20  # allocator slack, libraries' buffers
SELF_CHECK = 40 * 2**20  # apply_tsp's self-check: a float64 miniature and its kernels' code
SPREAD = 8  # MB: how far a fresh run's rise may sit from the one docs/checkpoints.md quotes


M_MMAP_THRESHOLD = -3  # mallopt's parameter


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak(fn) -> int:
    """Rise of the resident high-water mark while ``fn()`` runs (freed heap memory is handed
    back to the system first, so that reusing it shows up too)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - before


def memory_worker(rank, world, source, out):
    # every allocation from 128 KiB on is its own mapping, returned at once when freed (glibc
    # otherwise raises this threshold as blocks are freed, and the rises vary by ~25 MB)
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    mesh = init_tsp_mesh(world)
    box = {}
    # apply_tsp's self-check, measured on its own: load_pretrained's own (the same config) then
    # finds the config proven
    meta = _meta_model(source)
    res = {
        "self_check": _peak(lambda: self_check(meta, mesh, mesh["tsp"].get_group(), TSPConfig()))
    }
    res["load"] = _peak(lambda: box.update(m=load_pretrained(source, mesh, dtype=torch.float32)))
    model = box["m"]
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg / exp_avg_sq
    opt.zero_grad(set_to_none=True)
    res["local_params"] = sum(p.numel() * p.element_size() for p in params)
    res["largest_local"] = max(p.numel() * p.element_size() for p in params)
    res["save"] = _peak(lambda: checkpoint.save(os.path.join(out, "state"), model, opt))
    res["export"] = _peak(
        lambda: save_pretrained(model, os.path.join(out, "hf"), max_shard_size=SHARD)
    )
    res.update(deepspeed_save(model, world, out))
    return res


def _meta_model(source: str):
    """The model ``load_pretrained(source, mesh)`` builds on the meta device (the same config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(source), dtype=torch.float32
        )


def deepspeed_save(model, world: int, out: str) -> dict[str, int]:
    """Peaks of a ZeRO-2 training-state save in groups of ``GROUP`` bytes and in one group, and
    the size of this rank's fp32 masters + Adam moments."""
    import tsp_ext.deepspeed as tds

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    engine, *_ = tds.initialize(
        model=model,
        config={**config, "tsp": {"size": world}},
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    )
    ids = torch.randint(0, BIG["vocab_size"], (1, 16))
    engine.backward(engine(**shard_batch({"input_ids": ids, "labels": ids}, engine.tsp_mesh)).loss)
    engine.step()  # creates the Adam moments
    path = os.path.join(out, "ds")
    save = lambda group: checkpoint.save(path, model, None, engine=engine, max_group_bytes=group)  # noqa: E731
    res = {"ds_save": _peak(lambda: save(GROUP))}
    res["ds_groups"] = len(checkpoint.inspect(path)["groups"])
    res["ds_save_one_group"] = _peak(lambda: save(2**40))
    res["ds_rank_state"] = 3 * 4 * sum(p.numel() for p in model.parameters())  # master + moments
    return res


@pytest.fixture(scope="module")
def tmp():
    """The ~5 GB this module writes go to memory (/dev/shm) where there is one, and are removed
    after it: on disk their writeback stalls the tests that follow. The peaks are the same: a
    mapped file page counts in a process's resident memory whether it is cached from disk or
    shared memory, and a written one in neither."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tsp_checkpoint_memory_", dir=shm) as path:
        yield path


@functools.cache
def measured(tmp: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    source = os.path.join(tmp, "source")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**BIG)).save_pretrained(source)
    full = sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source) if "safet" in f)
    return full, run_processes(memory_worker, 4, source, tmp, timeout=300)


def test_load_save_export_peaks_are_about_the_shard(tmp):
    full, ranks = measured(tmp)
    largest_full = BIG["vocab_size"] * BIG["hidden_size"] * 4  # the embedding / LM head
    for rank, r in enumerate(ranks):
        local, one = r["local_params"], r["largest_local"]
        # the self-check's miniature and the kernels it touches: the same for any model size
        assert r["self_check"] < SELF_CHECK, r
        assert r["load"] < local + 1.5 * one + ALLOWANCE and r["load"] < 0.5 * full, r
        # the save writes this rank's params and both Adam moments from where they live
        assert r["save"] < 1.5 * one + ALLOWANCE and r["save"] < 0.25 * full, r
        if rank == 0:  # the writer: one full tensor and the shards it was assembled from
            assert r["export"] < 2 * largest_full + ALLOWANCE, r
            assert r["export"] < 0.5 * full, r
        else:  # a TSP shard of one tensor at a time
            assert r["export"] < 1.5 * one + ALLOWANCE, r
        # DeepSpeed: one group's fp32 masters + moments at a time (its largest: the embedding)
        assert r["ds_groups"] >= 8, r  # about one per decoder layer
        assert r["ds_save"] < 1.5 * 3 * max(GROUP // len(ranks), one) + ALLOWANCE, r
        assert r["ds_save"] < 0.5 * r["ds_rank_state"], r
        assert r["ds_save_one_group"] > 0.8 * r["ds_rank_state"], r  # the whole rank's at once


def test_docs_table_is_this_measurement(tmp):
    """docs/checkpoints.md's table: the state sizes exactly, each measured rise within the
    spread the doc states (``SPREAD``) of the quoted one."""
    full, ranks = measured(tmp)
    mb = lambda n: round(n / 2**20)  # noqa: E731
    rows = table("docs/checkpoints.md", "| phase | rank 0 |")
    keys = ("self_check", "load", "save", "export", "ds_save", "ds_save_one_group")  # its order
    assert len(rows) == len(keys) and f"({ranks[0]['ds_groups']} groups)" in rows[4][0]
    for (name, first, rest, params, state, model), key in zip(rows, keys):
        assert params == f"{mb(ranks[0]['local_params'])} MB", name
        assert state in ("—", f"{mb(3 * ranks[0]['local_params'])} MB"), name
        assert model in ("", f"{mb(full)} MB") or model.startswith(f"{mb(full)} MB ("), name
        quoted = [int(n) for n in re.findall(r"\d+", first + " " + rest)]
        got = [mb(r[key]) for r in ranks]
        lo, hi = quoted[1], quoted[-1]  # "+a..b MB" or "+a MB" for ranks 1-3
        assert abs(got[0] - quoted[0]) <= SPREAD, (name, got, ranks)
        assert lo - SPREAD <= min(got[1:]) and max(got[1:]) <= hi + SPREAD, (name, got, ranks)
