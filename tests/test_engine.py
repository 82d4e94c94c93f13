"""TSP attention and gated MLP against the Hugging Face modules on the same full batch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from checks import rel_err
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP

from tsp_ext import (
    TSPAttention,
    TSPConfig,
    TSPGatedMLP,
    ZigzagLayout,
    pad_sequence,
    padded_length,
)
from tsp_ext.engine.kernels.backends import available_backends

pytestmark = pytest.mark.multiproc

TOL = {"float64": 1e-10, "float32": 1e-5}

# name -> (config class, kwargs); head layouts chosen to cover MHA, GQA, D > n_kv and biases
CONFIGS = {
    "mha": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "gqa": (LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=4)),
    "kv_lt_d": (LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2)),
    "mqa_bias": (
        LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True),
    ),
    "qk_norm": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    # any D: 9 query / 3 KV heads (groups of 5 + 4 at D = 2, KV head 1 shared; 3 + 2 + 2 + 2 at
    # D = 4) and an MLP width of 53, divisible by none of 2, 3, 4
    "uneven": (
        LlamaConfig,
        dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72, intermediate_size=53),
    ),
}
# (config, dtype, batch, seq_len): 30 and 21 are not multiples of 2D for D = 2, 4
CASES = [
    ("mha", "float64", 2, 32),
    ("gqa", "float64", 1, 30),
    ("kv_lt_d", "float64", 2, 24),
    ("mqa_bias", "float64", 2, 21),
    ("qk_norm", "float64", 2, 16),
    ("gqa", "float32", 2, 32),
    ("qk_norm", "float32", 1, 21),
    ("uneven", "float64", 2, 21),
    ("uneven", "float32", 1, 24),
]
UNEVEN_CASES = tuple(c for c in CASES if c[0] == "uneven")


def make_config(name: str):
    cls, kw = CONFIGS[name]
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=64,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return cls(**{**base, **kw})


def _parity_case(rank, world, name, dtype_name, B, S, backend):
    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD
    cfg = make_config(name)
    torch.manual_seed(0)
    attn_cls = Qwen3Attention if isinstance(cfg, Qwen3Config) else LlamaAttention
    attn = attn_cls(cfg, layer_idx=0).to(dtype)
    mlp = (Qwen3MLP if isinstance(cfg, Qwen3Config) else LlamaMLP)(cfg).to(dtype)
    for p in [*attn.parameters(), *mlp.parameters()]:  # non-trivial norms and biases
        torch.nn.init.normal_(p, std=0.3)
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(B, S, cfg.hidden_size, dtype=dtype)
    dy = torch.randn(B, S, cfg.hidden_size, dtype=dtype)
    cos, sin = rope(x, torch.arange(S)[None].expand(B, S))

    # reference: the HF modules on the full batch
    xa, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, _ = attn(xa, position_embeddings=(cos, sin), attention_mask=None)
    ym = mlp(xm)
    (ya * dy).sum().backward()
    (ym * dy).sum().backward()

    # TSP: this rank's zigzag shard of the padded sequence
    lay = ZigzagLayout(padded_length(S, world), world)
    pos = lay.positions(rank)
    real = pos < S
    cos_l, sin_l = rope(x, pos[None].expand(B, -1))
    # a small block makes the blockwise kernel skip, fully compute and mask blocks at these lengths
    tsp_cfg = TSPConfig(attn_backend=backend, attn_block=4)
    t_attn = TSPAttention.from_hf(attn, group, tsp_cfg)
    # one KV head at a time (``head_bucket``): two or more buckets wherever a group has 2+ KV heads
    bucketed = TSPConfig(attn_backend=backend, attn_block=4, head_bucket=1, overlap=False)
    t_attn_bucketed = TSPAttention.from_hf(attn, group, bucketed)
    # buckets of two: a remainder bucket of one where a group has an odd number of KV heads
    t_attn_pairs = TSPAttention.from_hf(attn, group, TSPConfig(attn_backend=backend, head_bucket=2))
    t_mlp = TSPGatedMLP.from_hf(mlp, group, tsp_cfg)
    t_mlp_kept = TSPGatedMLP.from_hf(
        mlp, group, TSPConfig(attn_backend=backend, recompute_mlp=False, mlp_tile=5)
    )
    t_mlp_tiled = TSPGatedMLP.from_hf(mlp, group, TSPConfig(attn_backend=backend, mlp_tile=3))

    def local(t):  # this rank's real tokens of a full [B, S, ...] tensor
        return lay.shard(pad_sequence(t, world, 0.0), rank)[:, real]

    errs = {}
    for mod_name, ref_mod, t_mod, ref_x, ref_y in (
        ("attn", attn, t_attn, xa, ya),
        ("attn_bucketed", attn, t_attn_bucketed, xa, ya),
        ("attn_pairs", attn, t_attn_pairs, xa, ya),
        ("mlp", mlp, t_mlp, xm, ym),
        ("mlp_kept", mlp, t_mlp_kept, xm, ym),  # gate/up activations saved, in tiles of 5
        ("mlp_tiled", mlp, t_mlp_tiled, xm, ym),  # tiles of 3 tokens (the last one shorter)
    ):
        xl = lay.shard(pad_sequence(x, world, 0.0), rank).requires_grad_()
        if mod_name.startswith("attn"):
            yl, _ = t_mod(xl, position_embeddings=(cos_l, sin_l))
        else:
            yl = t_mod(xl)
        (yl * lay.shard(pad_sequence(dy, world, 0.0), rank)).sum().backward()
        errs[f"{mod_name}.out"] = rel_err(yl[:, real], local(ref_y.detach()))
        errs[f"{mod_name}.dx"] = rel_err(xl.grad[:, real], local(ref_x.grad))
        ref_params = dict(ref_mod.named_parameters())
        for pname, p in t_mod.named_parameters():
            expected = t_mod.local_slice(pname, ref_params[pname].grad)
            errs[f"{mod_name}.{pname}.grad"] = rel_err(p.grad, expected)
    return errs


def parity_worker(rank, world, cases, backend):
    return {c: _parity_case(rank, world, *c, backend) for c in cases}


@functools.cache
def parity_results(workers, world: int, backend: str) -> dict:
    return workers.run(parity_worker, world, tuple(CASES), backend)


# every attention kernel this machine can run for both dtypes (CUDA kernels: gpu_check)
BACKENDS = sorted(
    set(available_backends("cpu", torch.float64)) & set(available_backends("cpu", torch.float32))
)


def test_head_buckets_cover_a_group_with_a_remainder():
    """``AttentionSpec.buckets``: 9 query / 3 KV heads on one rank in buckets of 2 KV heads:
    (kv 0-1, q 0-5) and the remainder (kv 2, q 6-8); each bucket's map is the kernels' GQA."""
    from tsp_ext.engine.attention.heads import AttentionSpec

    spec = AttentionSpec(72, 9, 3, 8, tsp_size=1, scaling=1.0)
    assert [(b.kv, b.q, b.kv_map) for b in spec.buckets(0, 2)] == [
        (slice(0, 2), slice(0, 6), None),
        (slice(2, 3), slice(6, 9), None),
    ]
    assert spec.buckets(0, None) == spec.buckets(0, 3) == spec.buckets(0, 7)


def test_a_bucket_cuts_the_group_shards_to_its_heads():
    """``HeadBucket.shards`` and ``AttentionSpec.part``: group 1 of 8 query / 4 KV heads at D = 2
    (q 4-7, kv 2-3), its second bucket of one KV head: q heads 6-7, kv head 3, as rows of q/k/v
    and the gate, columns of o (head_dim 2)."""
    from tsp_ext.engine.attention.heads import AttentionSpec

    spec = AttentionSpec(16, 8, 4, 2, tsp_size=2, scaling=1.0)
    bucket = spec.buckets(1, 1)[1]
    part = spec.part(1, bucket)
    assert (part.q, part.kv, part.q_rows, part.kv_rows) == (
        slice(6, 8), slice(3, 4), slice(12, 16), slice(6, 8),
    )  # fmt: skip
    rows = {"wq": 8, "wg": 8, "wk": 4, "wv": 4, "bq": 8, "bk": 4}
    w = {n: torch.arange(r * 16.0).view(r, 16) if n[0] == "w" else torch.arange(r * 1.0)
         for n, r in rows.items()}  # fmt: skip
    w["wo"] = torch.arange(16 * 8.0).view(16, 8)
    cut = bucket.shards(w, spec.head_dim)
    for n in ("wq", "wg", "bq"):
        assert torch.equal(cut[n], w[n][4:8])
    for n in ("wk", "bk"):
        assert torch.equal(cut[n], w[n][2:4])
    assert torch.equal(cut["wo"], w["wo"][:, 4:8])
    assert bucket.whole() == (slice(0, 1), slice(0, 2), None)


def test_cpu_backends_are_covered():
    assert {"blockwise", "cpu_flash"} <= set(BACKENDS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_hf_modules(workers, world, backend):
    results = parity_results(workers, world, backend)
    for rank, per_case in enumerate(results):
        for case, errs in per_case.items():
            tol = TOL[case[1]]
            if case[0] == "qk_norm":
                # HF's Qwen3 q/k RMSNorm runs in float32 even for float64 models (we match it),
                # so a 1-ulp float32 flip between the two summation orders is legitimate
                tol = max(tol, 1e-6)
            bad = {k: v for k, v in errs.items() if not v < tol}
            assert not bad, f"D={world} rank={rank} case={case}: {bad}"
            assert len(errs) >= 10  # outputs, input grads and every weight grad were compared


def test_uneven_layout_at_d3(workers):
    """9 heads at D = 3 with 3 KV heads: 3 each; MLP rows 18 + 18 + 17; both CPU kernels."""
    for backend in BACKENDS:
        for rank, per_case in enumerate(workers.run(parity_worker, 3, UNEVEN_CASES, backend)):
            for case, errs in per_case.items():
                bad = {k: v for k, v in errs.items() if not v < TOL[case[1]]}
                assert not bad, f"D=3 rank={rank} case={case} {backend}: {bad}"
