"""Saved bytes bytes per rank shrink as 1/D; no full-sequence or full-weight tensor is saved."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from checks import table
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding

from tsp_ext import TSPAttention, TSPConfig, TSPGatedMLP, ZigzagLayout
from tsp_ext.hf.replicated import TSPRMSNorm
from tsp_ext.memory import SavedTensorBytes

pytestmark = pytest.mark.multiproc

SEQ, HIDDEN, FFN = 240, 48, 64  # sizes distinct from each other and from every S/D
DOCS = [50, 1, 70, 119]  # "attn_packed": packed documents straddling chunks and ranks


def memory_worker(rank, world):
    group = dist.group.WORLD
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    attn, mlp, rope = LlamaAttention(cfg, 0), LlamaMLP(cfg), LlamaRotaryEmbedding(cfg)
    lay = ZigzagLayout(SEQ, world)
    x = torch.randn(1, SEQ, HIDDEN)
    docs = torch.cat([torch.arange(n) for n in DOCS])[None]  # per-document positions
    doc_mask = ((docs == 0).cumsum(1)[0, :, None] == (docs == 0).cumsum(1)[0, None, :]).tril()
    result = {}
    configs = {"mlp": TSPConfig(), "mlp_kept": TSPConfig(recompute_mlp=False)}
    modules = (("attn", attn), ("attn_packed", attn), ("mlp", mlp), ("mlp_kept", mlp))
    for name, hf in modules:
        packed = name == "attn_packed"
        if world == 1:  # the unmodified module on the full sequence, for reference
            xr = x.clone().requires_grad_()
            pos = docs if packed else torch.arange(SEQ)[None]
            mask = doc_mask[None, None] if packed else None
            with SavedTensorBytes() as rec:
                if hf is attn:
                    hf(xr, position_embeddings=rope(xr, pos), attention_mask=mask)
                else:
                    hf(xr)
            result[f"hf_{name}"] = rec.nbytes
        cls = TSPAttention if hf is attn else TSPGatedMLP
        tsp = cls.from_hf(hf, group, configs.get(name))
        xl = lay.shard(x, rank).requires_grad_()
        with SavedTensorBytes() as rec:
            if packed:
                pos = lay.shard(docs, rank)
                tsp(xl, position_embeddings=rope(xl, pos), position_ids=pos)
            elif hf is attn:
                tsp(xl, position_embeddings=rope(xl, lay.positions(rank)[None]))
            else:
                tsp(xl)
        result[name] = rec.nbytes
        result[f"{name}_shapes"] = rec.shapes
        if not packed and name != "mlp_kept":  # fed by the RMSNorm that makes X_p, as in a layer
            norm = TSPRMSNorm(torch.nn.Parameter(torch.rand(HIDDEN) + 0.5), 1e-6, group)
            with SavedTensorBytes() as rec:
                xn = norm(xl)
                if hf is attn:
                    tsp(xn, position_embeddings=rope(xl, lay.positions(rank)[None]))
                else:
                    tsp(xn)
            result[f"norm_{name}"] = rec.nbytes
            with SavedTensorBytes() as rec:
                norm(xl)
            result["norm"] = rec.nbytes
    result["weight_shapes"] = [tuple(p.shape) for m in (attn, mlp) for p in m.parameters()]
    return result


@functools.cache
def measured(workers, world):
    return workers.run(memory_worker, world)


@pytest.mark.parametrize("module", ["attn", "attn_packed", "mlp", "mlp_kept"])
def test_saved_bytes_shrink_as_one_over_d(workers, module):
    base = measured(workers, 1)[0][module]
    assert base > 0
    # TSP at D = 1 saves no more than the Hugging Face module does
    assert base <= measured(workers, 1)[0][f"hf_{module}"]
    for world in (2, 4):
        for rank, res in enumerate(measured(workers, world)):
            ratio = res[module] * world / base
            assert 0.9 <= ratio <= 1.1, (module, world, rank, res[module], base)


@pytest.mark.parametrize("module", ["attn", "mlp"])
def test_a_norms_output_is_kept_as_the_norms_input(workers, module):
    """Fed by TSP's RMSNorm (as in a decoder layer), attention and MLP keep X_p as the norm's
    input, which the norm keeps anyway: the pair saves exactly the norm's bytes plus the
    module's without X_p (one ``[B, S/D, h]`` tensor less per module)."""
    for world in (1, 2, 4):
        for rank, res in enumerate(measured(workers, world)):
            x_p = (SEQ // world) * HIDDEN * 4  # float32
            assert res[f"norm_{module}"] == res["norm"] + res[module] - x_p, (world, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_nothing_full_size_is_saved(workers, world):
    for res in measured(workers, world):
        full_weights = set(res["weight_shapes"])
        for module in ("attn", "attn_packed", "mlp", "mlp_kept"):
            for shape in res[f"{module}_shapes"]:
                assert SEQ not in shape, f"{module} saved a full-sequence tensor {shape}"
                assert shape not in full_weights, f"{module} saved a full weight {shape}"


def test_engine_docs_table_is_what_this_measures(workers):
    """docs/engine.md quotes this module's measurements (rank 0): they match exactly."""
    rows = {r[0]: r[1:] for r in table("docs/engine.md", "| module | HF, 1 process |")}
    one = measured(workers, 1)[0]
    for name, key in [
        ("attention", "attn"),
        ("gated MLP (recompute)", "mlp"),
        ("gated MLP (`recompute_mlp=False`)", "mlp_kept"),
    ]:
        got = [one[f"hf_{key}"]] + [measured(workers, w)[0][key] for w in (1, 2, 4)]
        assert rows[name] == [f"{n:,}" for n in got], name
