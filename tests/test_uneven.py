"""Any TSP size on any checkpoint: uneven head groups, shared KV heads, MLP slices and vocabularies.

Full-model parity with Hugging Face (loss, logits, every gradient, eval logits) at D = 2, 3, 4 on
models whose head counts, MLP width and vocabulary D does not divide; per-rank parameter bytes;
state gathering and grad-norm roles; and the per-rank shapes of large layouts on the fake
process group (no step).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from checks import gemma_norm_tol, rel_err
from models import batch, build, lm_loss
from torch.utils._python_dispatch import TorchDispatchMode

from tsp_ext import (
    TSPConfig,
    apply_tsp,
    full_grads,
    full_state_dict,
    gather_sequence,
    init_tsp_mesh,
    shard_batch,
)
from tsp_ext.dp.grad_norm import clip_grad_norm_
from tsp_ext.engine.attention.heads import AttentionSpec
from tsp_ext.hf.families import family_of
from tsp_ext.hf.layers import unfuse

pytestmark = pytest.mark.multiproc

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# F = 53 and V = 97 are divisible by none of 2, 3, 4; head_dim = 8 throughout
UNEVEN = dict(intermediate_size=53, vocab_size=97)
# name -> (family, config overrides): query / KV heads
MODELS = {
    "llama_9_3": ("llama", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72)),
    "qwen2_14_2": ("qwen2", dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=112)),
    "qwen3_12_4": ("qwen3", dict(num_attention_heads=12, num_key_value_heads=4, head_dim=8)),
    "mistral_6_6": ("mistral", dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48)),
    "gemma_6_2": ("gemma", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)),
    "gemma3_6_2": ("gemma3", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)),
    "phi3_6_3": ("phi3", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)),
    "olmo2_9_3": ("olmo2", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72)),
    "mistral_w_6_2": (
        "mistral_window",
        dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, sliding_window=5),
    ),
    "tied_6_3": ("llama_tied", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)),
}
# (model, dtype, batch, seq_len, right-padding of the last sequence)
CASES = [
    ("llama_9_3", torch.float64, 2, 21, 0),
    ("qwen2_14_2", torch.float64, 1, 24, 4),
    ("qwen3_12_4", torch.float64, 2, 18, 0),
    ("mistral_6_6", torch.float64, 1, 20, 0),
    ("mistral_w_6_2", torch.float64, 2, 33, 3),  # S = 6-7x the window
    ("gemma_6_2", torch.float64, 1, 19, 2),
    ("gemma3_6_2", torch.float64, 1, 22, 0),
    ("phi3_6_3", torch.float64, 2, 17, 1),
    ("olmo2_9_3", torch.float64, 1, 20, 0),  # KV heads shared by head groups
    ("tied_6_3", torch.float64, 2, 16, 3),
    ("llama_9_3", torch.float32, 1, 24, 0),
]


def make(name: str, dtype: torch.dtype):
    family, kw = MODELS[name]
    return build(family, dtype, **{**UNEVEN, **kw})


def reference(model, data):
    """The unmodified model on the full batch: loss, logits, grads by name."""
    out = model(**data)
    loss = lm_loss(out.logits, data["labels"])
    loss.backward()
    return loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def parity_case(mesh, name, dtype, B, S, pad):
    model = make(name, dtype)
    ref = copy.deepcopy(model)
    data = batch(model.config.vocab_size, B, S, pad_last=pad)
    ref_loss, ref_logits, ref_grads = reference(ref, data)
    split = copy.deepcopy(model)  # fused projections (Phi-3) as the parts TSP shards
    family = family_of(split)
    for layer in family.layers_of(split):
        unfuse(family, layer, split.config)
    full_bytes = {n: p.numel() * p.element_size() for n, p in split.named_parameters()}

    apply_tsp(model, mesh, config=TSPConfig(loss_chunk=5))
    local_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    out = model(**shard_batch(data, mesh), return_logits=True)
    out.loss.backward()
    logits = gather_sequence(out.logits.detach(), mesh, seq_len=S)
    real = data.get("attention_mask", torch.ones(B, S)).bool()
    errs = {"loss": rel_err(out.loss.detach(), ref_loss)}
    errs["logits"] = rel_err(logits[real], ref_logits[real])
    grads = full_grads(model)
    for pname, g in ref_grads.items():
        errs[pname] = rel_err(grads[pname], g)
    state = full_state_dict(model)
    errs["state"] = max(rel_err(state[n], p) for n, p in ref.state_dict().items())
    # gradient norm: each distinct value once (shared KV heads on their first user only)
    ref_norm = torch.cat([g.reshape(-1) for g in ref_grads.values()]).double().norm()
    errs["grad_norm"] = rel_err(clip_grad_norm_(model, 1e9), ref_norm)
    model.eval()
    with torch.no_grad():
        ids = {"input_ids": data["input_ids"]}
        eval_logits = gather_sequence(model(**shard_batch(ids, mesh)).logits, mesh, seq_len=S)
    errs["eval_logits"] = rel_err(eval_logits[real], ref_logits[real])
    return errs, {"full": full_bytes, "local": local_bytes}


def parity_worker(rank, world):
    mesh = init_tsp_mesh(world)
    return {(c[0], str(c[1]), *c[2:]): parity_case(mesh, *c) for c in CASES}


@functools.cache
def parity(workers, world):
    return workers.run(parity_worker, world, timeout=420)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_uneven_models_match_hf(workers, world):
    for rank, per_case in enumerate(parity(workers, world)):
        for case, (errs, _) in per_case.items():
            tol = TOL[getattr(torch, case[1].split(".")[1])]
            family = MODELS[case[0]][0]
            if family in ("qwen3", "gemma3", "olmo2"):
                tol = max(tol, 1e-6)  # HF runs their q/k norms in float32 (see test_engine)
            bad = {k: v for k, v in errs.items() if not v < gemma_norm_tol(family, k, tol)}
            assert not bad, f"D={world} rank={rank} {case}: {bad}"
            assert len(errs) > 15  # every parameter of two layers and the five checks


def _unit(name: str, model_name: str) -> int:
    """Elements of one head (attention), one row (MLP, vocabulary) of tensor ``name``."""
    family, kw = MODELS[model_name]
    h = kw.get("hidden_size", 32)
    if "_proj.bias" in name:
        return 8
    return 8 * h if "self_attn" in name else h


@pytest.mark.parametrize("world", [3, 4])
def test_uneven_parameter_bytes_within_one_head_or_row(workers, world):
    """Per rank and sharded tensor: q/o within one head, MLP and vocabulary within one row of
    1/D of the full tensor; K/V hold every KV head their queries use (shared heads replicated)."""
    results = parity(workers, world)
    for case in results[0]:
        name = case[0]
        _, kw = MODELS[name]
        ratio = kw["num_attention_heads"] // kw["num_key_value_heads"]
        total_local = [sum(r[case][1]["local"].values()) for r in results]
        full = results[0][case][1]["full"]
        for rank, per_case in enumerate(results):
            local = per_case[case][1]["local"]
            for pname, n in local.items():
                if n == full[pname] or "norm" in pname:
                    continue  # replicated
                unit = _unit(pname, name) * (8 if case[1] == "torch.float64" else 4)
                dev = abs(n - full[pname] / world)
                if "k_proj" in pname or "v_proj" in pname:
                    # the KV heads of ⌈n_h/D⌉ consecutive query heads: at most ⌈⌈n_h/D⌉/g⌉ + 1
                    heads = -(-kw["num_attention_heads"] // world)
                    assert n <= (-(-heads // ratio) + 1) * unit, (pname, rank, n)
                else:
                    assert dev <= unit, (world, name, rank, pname, n, full[pname] / world)
        # the largest and smallest rank differ by at most one unit per sharded tensor
        assert max(total_local) > 0 and min(total_local) > 0


def on_fake_group(fn, rank: int, world: int, *args):
    """``fn(rank, world, *args)`` in this process as rank ``rank`` of a fake process group of
    ``world`` (shape-only collectives; no processes to start), which is torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "the test process has a process group of its own"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def shape_worker(rank, world, n_heads, n_kv, head_dim, hidden, ffn, vocab):
    """Build the TSP modules of a large layout on the fake process group; return their shapes."""
    from torch import nn

    from tsp_ext import TSPAttention, TSPGatedMLP
    from tsp_ext.hf.vocab import TSPVocabEmbedding

    group = dist.group.WORLD
    spec = AttentionSpec(hidden, n_heads, n_kv, head_dim, world, head_dim**-0.5)
    with torch.device("meta"):
        attn = TSPAttention(spec, group)
        mlp = TSPGatedMLP(hidden, ffn, group)
        emb = TSPVocabEmbedding.from_hf(nn.Embedding(vocab, hidden), group)
    shapes = {n: tuple(p.shape) for m in (attn, mlp) for n, p in m.named_parameters()}
    shapes["embed"] = tuple(emb.weight.shape)
    shapes["kv_index"] = attn.local_index("k_proj.weight")[0]
    shapes["roles"] = {n: attn.role(n).value for n, _ in attn.named_parameters()}
    return shapes


# (query heads, KV heads, D, hidden, F, V) of real checkpoints' shapes (Qwen2.5-7B, Llama-2-13B)
LARGE = [(28, 4, 8, 3584, 18944, 152064), (40, 8, 16, 5120, 13824, 32001)]


@pytest.mark.parametrize("n_heads, n_kv, world, hidden, ffn, vocab", LARGE)
def test_large_layouts_shapes_on_fake_group(n_heads, n_kv, world, hidden, ffn, vocab):
    d = hidden // n_heads
    args = (n_heads, n_kv, d, hidden, ffn, vocab)
    first, last = (on_fake_group(shape_worker, r, world, *args) for r in (0, world - 1))
    hq, g = -(-n_heads // world), n_heads // n_kv
    lq = n_heads // world
    assert first["q_proj.weight"] == (hq * d, hidden)
    assert last["q_proj.weight"] == (lq * d, hidden)
    assert first["o_proj.weight"] == (hidden, hq * d)
    # KV heads of the first group: heads 0..hq-1 use KV heads 0..(hq-1)//g
    assert first["k_proj.weight"] == (((hq - 1) // g + 1) * d, hidden)
    last_q0 = n_heads - lq
    assert last["k_proj.weight"] == (((n_heads - 1) // g - last_q0 // g + 1) * d, hidden)
    assert last["kv_index"].stop == n_kv * d
    assert first["gate_proj.weight"] == (-(-ffn // world), hidden)
    assert last["down_proj.weight"] == (hidden, ffn // world)
    assert first["embed"] == (-(-vocab // world), hidden)
    assert last["embed"] == (vocab // world, hidden)
    assert first["roles"]["k_proj.weight"] == "sharded"


def test_refuses_tsp_larger_than_heads():
    with pytest.raises(ValueError, match="the largest valid TSP size is 9"):
        AttentionSpec(72, 9, 3, 8, tsp_size=10, scaling=1.0)


@pytest.mark.parametrize(
    "n_heads, n_kv, D, shared",
    [(9, 3, 2, True), (14, 2, 4, True), (12, 4, 3, True), (6, 6, 4, False), (8, 2, 4, True)],
)
def test_head_layout(n_heads, n_kv, D, shared):
    spec = AttentionSpec(8 * n_heads, n_heads, n_kv, 8, D, 1.0)
    sizes = [spec.n_q(p) for p in range(D)]
    assert sum(sizes) == n_heads and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first n mod D groups have one more
    assert any(spec.first_kv_copied(p) for p in range(1, D)) == shared  # a KV head in 2 groups
    g = n_heads // n_kv
    for p in range(D):
        q, k = spec.q_heads(p), spec.kv_heads(p)
        assert {i // g for i in range(q.start, q.stop)} == set(range(k.start, k.stop))
    # each KV head is counted by exactly one group
    counted = [
        spec.kv_heads(p).start + j
        for p in range(D)
        for j in range(spec.counted_kv(p).start, spec.counted_kv(p).stop)
    ]
    assert counted == list(range(n_kv))


class _Transfers(TorchDispatchMode):
    """Records ``(op, elements)`` of every collective and point-to-point transfer (c10d ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            leaves = pytree.tree_leaves(args)
            size = sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))
            self.seen.append((func.__name__.split(".")[0], size))
        return func(*args, **(kwargs or {}))


def kv_transfer_worker(rank, world):
    """Attention backward of 9 query / 3 KV heads at D = 4 (KV heads 1 and 2 each on two ranks):
    the c10d transfers it makes and the shared heads of this rank."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from tsp_ext import TSPAttention

    cfg = LlamaConfig(**MODELS["llama_9_3"][1], num_hidden_layers=1, intermediate_size=53)
    torch.manual_seed(0)
    attn = TSPAttention.from_hf(LlamaAttention(cfg, layer_idx=0).double(), dist.group.WORLD)
    x = torch.randn(1, 6, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(6)[None] + 6 * rank)
    y, _ = attn(x, position_embeddings=(cos, sin))
    with _Transfers() as transfers:
        y.sum().backward()
    shared = [(i, list(users)) for i, users in attn.spec.shared_kv(rank)]
    return transfers.seen, shared, attn.spec.head_dim * cfg.hidden_size


def test_shared_kv_gradients_are_summed_among_their_users_one_head_at_a_time(workers):
    # before: one [n_kv * d, h] buffer per K/V tensor, all-reduced over the whole TSP group
    # (local KV head, ranks using it) of each rank's shared heads: KV 1 on ranks 1-2, KV 2 on 2-3
    expected = [[], [(0, [1, 2])], [(0, [1, 2]), (1, [2, 3])], [(0, [2, 3])]]
    for rank, (seen, shared, head) in enumerate(workers.run(kv_transfer_worker, 4)):
        assert shared == expected[rank], (rank, shared)
        assert not [op for op, _ in seen if "allreduce" in op], (rank, seen)
        p2p = [(op, n) for op, n in seen if op in ("send", "recv_")]
        # wk and wv rows of one KV head per message; a pair (send, receive) per shared head
        assert p2p and all(n == 2 * head for _, n in p2p) if shared else not p2p, (rank, seen)
        assert len(p2p) == 2 * len(shared), (rank, p2p)
