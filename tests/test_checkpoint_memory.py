"""Peak host memory per rank of shard-on-read loading, a training-state save (DCP) and the
streaming HF export, at D=4, next to the rank's own state and the full model (a 665 MB float32
Llama). Each phase's peak is the rise of VmHWM over the RSS just before it (VmHWM is reset)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tsp_ext import checkpoint, init_tsp_mesh, load_pretrained, save_pretrained
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
ALLOWANCE = 48 * 2**20  # allocator slack, libraries' buffers


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak(fn) -> int:
    """Rise of the resident high-water mark while ``fn()`` runs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - before


def memory_worker(rank, world, source, out):
    mesh = init_tsp_mesh(world)
    box = {}
    res = {"load": _peak(lambda: box.update(m=load_pretrained(source, mesh, dtype=torch.float32)))}
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
    return res


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
        assert r["load"] < local + 1.5 * one + ALLOWANCE and r["load"] < 0.5 * full, r
        # the save writes this rank's params and both Adam moments from where they live
        assert r["save"] < 1.5 * one + ALLOWANCE and r["save"] < 0.25 * full, r
        if rank == 0:  # the writer: a file being filled and its serialized copy + one tensor
            assert r["export"] < 2 * max(SHARD, largest_full) + SHARD + ALLOWANCE, r
            assert r["export"] < 0.5 * full, r
        else:  # a TSP shard of one tensor at a time
            assert r["export"] < 1.5 * one + ALLOWANCE, r
