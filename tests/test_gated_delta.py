"""Gated DeltaNet (Qwen3-Next's linear attention): the pure-PyTorch kernels against float64 twins
of Hugging Face's, and the TSP layer against Hugging Face's ``Qwen3NextGatedDeltaNet`` on the
same full sequence: training (output, every gradient), packed documents, prefill + decode, and
what autograd saves and the state exchange sends."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers.models.qwen3_next.modeling_qwen3_next as mq
from checks import doc_positions, error_message, rel_err
from hybrid import float64_twin, twins
from transformers import Qwen3NextConfig

from tsp_ext import ZigzagLayout, pad_sequence, padded_length
from tsp_ext.engine.kernels.gated_delta import chunk_gated_delta, recurrent_gated_delta
from tsp_ext.engine.linear_attention import schedule as engine_la
from tsp_ext.engine.linear_attention.schedule import LinearAttentionSpec, group_shapes
from tsp_ext.hf.cache import LinearStateCacheLayer
from tsp_ext.hf.linear_attention import TSPGatedDeltaNet

TOL = 1e-10
CHUNK = 37  # tokens per zigzag chunk: S = 2D·37, longer than and not a multiple of 64
# two rows' documents, S = 168 (a multiple of 2D, D <= 4); 84 starts a chunk at every D
PACKED = ((70, 98), (23, 61, 84))
PROMPT, STEPS, LEFT_PAD = 101, 3, 5


def make_config() -> Qwen3NextConfig:
    """4 key / 8 value heads: at D = 3 groups of 2, 1, 1 key heads."""
    return Qwen3NextConfig(
        hidden_size=48,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        vocab_size=64,
    )


def hf_layer(dtype, twin: bool) -> mq.Qwen3NextGatedDeltaNet:
    """The Hugging Face module in ``dtype`` with slow decays (states carry over chunks); ``twin``:
    its forward, norm and kernels computing in float64 instead of float32."""
    torch.manual_seed(0)
    mod = mq.Qwen3NextGatedDeltaNet(make_config(), 0)
    with torch.no_grad():
        mod.A_log.copy_(torch.empty(8).uniform_(0.01, 0.1).log())
        mod.dt_bias.normal_(0, 0.5)
        mod.norm.weight.normal_(1, 0.3)
    mod = mod.to(dtype)
    return float64_twin(mod) if twin else mod


def _training(rank, world, dtype, twin, B, S, docs=None) -> dict:
    """TSP layer vs the reference on S tokens, a few masked (``docs``: packed rows, each
    document run alone through the reference): output, dx and every parameter's gradient."""
    ref = hf_layer(dtype, twin)
    torch.manual_seed(1)
    x = torch.randn(B, S, ref.hidden_size, dtype=dtype)
    dy = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    if docs is None:
        mask = torch.ones(B, S, dtype=dtype)
        mask[0, 10:15] = mask[-1, S - 7 :] = 0  # padded tokens: hidden states zeroed
        yr = ref(xr, attention_mask=mask)
    else:
        rows = []
        for b, row in enumerate(docs):
            ends = torch.tensor(row).cumsum(0).tolist()
            rows.append(torch.cat([ref(xr[b : b + 1, e - n : e]) for n, e in zip(row, ends)], 1))
        yr = torch.cat(rows)
    (yr * dy).sum().backward()
    lay = ZigzagLayout(S, world)
    if docs is None:
        kw = {"attention_mask": lay.shard(mask, rank)}
    else:
        kw = {"position_ids": lay.shard(doc_positions(docs), rank)}
    mod = TSPGatedDeltaNet.from_hf(ref, dist.group.WORLD)
    xl = lay.shard(x, rank).requires_grad_()
    shapes = []
    params = {p.data_ptr() for p in mod.parameters()}

    def pack(t):  # saved tensors, the head groups' checkpoint inputs included, but parameters
        if t.data_ptr() not in params:
            shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yl = mod(xl, **kw)
    (yl * lay.shard(dy, rank)).sum().backward()
    errs = {
        "out": rel_err(yl, lay.shard(yr.detach(), rank)),
        "dx": rel_err(xl.grad, lay.shard(xr.grad, rank)),
    }
    full = dict(ref.named_parameters())
    for name, p in mod.named_parameters():
        errs[name] = rel_err(p.grad, mod.local_slice(name, full[name].grad))
    # x-sized tensors and smaller only: nothing of S rows, no broadcast weight shard
    weights = {w for r in range(world) for w in group_shapes(mod.spec, r)}
    errs["saved"] = [s for s in shapes if s in weights or (world > 1 and S in s)]
    return errs


def _inference(rank, world) -> dict:
    """Prefill of PROMPT tokens (row 0 left-padded), then STEPS decode tokens (1, then 2 in one
    step), against the twin reference on all tokens (causal: each position's output is the same
    either way)."""
    ref = hf_layer(torch.float64, twin=True)
    B, L = 2, PROMPT + STEPS
    torch.manual_seed(2)
    x = torch.randn(B, L, ref.hidden_size, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :LEFT_PAD] = False
    with torch.no_grad():
        want = ref(x, attention_mask=mask.double())
    mod = TSPGatedDeltaNet.from_hf(ref, dist.group.WORLD)
    cache = LinearStateCacheLayer()
    Sp = padded_length(PROMPT, world)
    lay = ZigzagLayout(Sp, world)
    real = lay.positions(rank) < PROMPT
    xl = lay.shard(pad_sequence(x[:, :PROMPT], world, 0.0), rank)
    key_valid = pad_sequence(mask[:, :PROMPT], world, True)
    y = mod.prefill(xl, None, cache, PROMPT, key_valid)
    errs = {
        "prefill": rel_err(
            y[:, real], lay.shard(pad_sequence(want[:, :PROMPT], world, 0.0), rank)[:, real]
        )
    }
    for t, n in ((PROMPT, 1), (PROMPT + 1, 2)):  # one token, then two in one step
        index = torch.arange(t, t + n)
        y = mod.decode(x[:, t : t + n], None, cache, index, mask[:, : t + n])
        errs[f"decode{t - PROMPT}"] = rel_err(y, want[:, t : t + n])
    errs["seq_len"] = cache.get_seq_length() == L and cache.nbytes() > 0
    full = dict(ref.named_parameters())  # export: every rank's shards assemble HF's tensors
    errs["gathered"] = all(
        torch.equal(mod.gather_full(n, p), full[n]) for n, p in mod.named_parameters()
    )
    errs["no_cache"] = error_message(lambda: mod(xl, cache=cache))
    return errs


def worker(rank, world):
    sent = []
    exchange = engine_la.exchange_states

    def spy(cm, group):
        sent.append((tuple(cm.shape), cm.nbytes))
        return exchange(cm, group)

    engine_la.exchange_states = spy
    out = {("train", 64): _training(rank, world, torch.float64, True, 2, 2 * world * CHUNK)}
    engine_la.exchange_states = exchange
    out["sent"] = sent
    out[("train", 32)] = _training(rank, world, torch.float32, False, 2, 2 * world * CHUNK)
    out[("train", 16)] = _training(rank, world, torch.bfloat16, False, 1, 2 * world * CHUNK)
    out[("packed", 64)] = _training(rank, world, torch.float64, True, 2, 168, PACKED)
    # chunks of 2 tokens: the conv's halo spans several chunks
    out[("short", 64)] = _training(rank, world, torch.float64, True, 2, 4 * world)
    out["infer"] = _inference(rank, world)
    return out


@functools.cache
def results(workers, world):
    return workers.run(worker, world)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gated_delta_net_matches_hf(workers, world):
    spec = LinearAttentionSpec(48, 4, 8, 8, 12, 4, 1e-6, world)
    for rank, out in enumerate(results(workers, world)):
        for case in (("train", 64), ("train", 32), ("train", 16), ("packed", 64), ("short", 64)):
            errs = dict(out[case])
            assert errs.pop("saved") == [], f"D={world} rank={rank} {case}: saved full tensors"
            tol = {64: TOL, 32: 1e-5, 16: 3e-2}[case[1]]
            bad = {k: v for k, v in errs.items() if not v < tol}
            assert not bad and len(errs) == 9, f"D={world} rank={rank} {case}: {errs}"
        infer = dict(out["infer"])
        assert infer.pop("seq_len") is True and infer.pop("gathered") is True
        assert "no cache in training" in infer.pop("no_cache")
        assert max(infer.values()) < TOL, f"D={world} rank={rank}: {infer}"
        # each exchange: [C | M] of 2 chunks of B = 2 rows, for every head group (fwd + recompute)
        heads = [spec.v_heads(r).stop - spec.v_heads(r).start for r in range(world)]
        want = [((2, 2, n, 8, 20), 2 * 2 * n * 8 * (8 + 12) * 8) for n in heads]
        assert sorted(out["sent"]) == sorted(want * 2)


def _kernel_inputs(B=2, T=150, H=3, dk=8, dv=12):
    torch.manual_seed(3)
    f = torch.float64
    q, k = (F.normalize(torch.randn(B, T, H, dk, dtype=f), dim=-1) for _ in "qk")
    v = torch.randn(B, T, H, dv, dtype=f)
    g = -F.softplus(torch.randn(B, T, H, dtype=f)) * 0.1
    beta = torch.rand(B, T, H, dtype=f)
    return q, k, v, g, beta, torch.randn(B, H, dk, dv, dtype=f)


def test_kernels_match_hf_float64_twins():
    q, k, v, g, beta, s0 = _kernel_inputs()
    ns, qs = twins(mq.Qwen3NextGatedDeltaNet), q * q.shape[-1] ** -0.5
    for state in (None, s0):
        o, s = chunk_gated_delta(qs, k, v, g, beta, state)
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            ro, rs = ns[name](q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True)
            assert rel_err(o, ro) < 1e-12 and rel_err(s, rs) < 1e-12, name
        ro, rs = recurrent_gated_delta(qs, k, v, g, beta, s0 if state is None else state)
        if state is not None:
            assert rel_err(o, ro) < 1e-12 and rel_err(s, rs) < 1e-12


def test_kernel_resets_match_documents_run_alone():
    q, k, v, g, beta, s0 = _kernel_inputs()
    qs = q * q.shape[-1] ** -0.5
    resets = torch.zeros(2, 150, dtype=torch.bool)
    resets[0, 70] = resets[1, 0] = resets[1, 23] = resets[1, 100] = True
    o, s = chunk_gated_delta(qs, k, v, g, beta, s0, resets)
    for b in range(2):
        cuts = [0, *resets[b, 1:].nonzero().flatten().add(1).tolist(), 150]
        state = None if resets[b, 0] else s0[b : b + 1]
        for i, (a, e) in enumerate(zip(cuts, cuts[1:])):
            part = (t[b : b + 1, a:e] for t in (qs, k, v, g, beta))
            ro, state = chunk_gated_delta(*part, state if i == 0 else None)
            assert rel_err(o[b : b + 1, a:e], ro) < 1e-12
        assert rel_err(s[b : b + 1], state) < 1e-12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_kernel_matches_the_pytorch_one():
    """On CUDA with flash-linear-attention installed the chunked kernel is fla's: outputs, final
    state and the gradients of every input (the initial state's included) against the
    pure-PyTorch kernel in float32, with resets, on [v | 0] / [0 | I] as the layer calls it."""
    pytest.importorskip("fla")
    from tsp_ext.engine.kernels.gated_delta import uses_fla

    *inputs, s0 = (t.float() for t in _kernel_inputs(dv=8))
    q, k, v, g, beta = inputs
    q = q * q.shape[-1] ** -0.5
    v = torch.cat([v, torch.zeros_like(v)], dim=-1)
    s0 = torch.cat([s0, torch.eye(8).expand_as(s0)], dim=-1)
    resets = torch.zeros(2, 150, dtype=torch.bool)
    resets[0, 70] = True
    runs = {}
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v, g, beta, s0)]
        o, s = chunk_gated_delta(*leaves, resets.to(device))
        assert uses_fla(leaves[0]) == (device == "cuda")
        ((o * o.detach().sin()).sum() + (s * s.detach().cos()).sum()).backward()
        runs[device] = [o, s, *(t.grad for t in leaves)]
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dg", "dbeta", "ds0"), *runs.values()):
        assert rel_err(b.cpu(), a.detach()) < 1e-4, name


def test_spec_refuses_more_ranks_than_key_heads():
    msg = error_message(lambda: LinearAttentionSpec(48, 4, 8, 8, 12, 4, 1e-6, 5))
    assert "cannot be split over tsp_size=5" in msg
