"""generate() on TSP models: token-for-token the single-process Hugging Face model's output, the
same tokens on every rank, 1/D of the KV cache and weights per rank, and clear errors."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from checks import error_message
from models import build
from transformers import DynamicCache

from tsp_ext import TSPCache, TSPConfig, apply_tsp, init_tsp_mesh
from tsp_ext.engine.decode import KV_BLOCK
from tsp_ext.hf.families import family_of

pytestmark = pytest.mark.multiproc

NEW = 32  # new tokens per greedy case: prompt + NEW crosses a 32-token KV block in every cache
# the families' own cases generate fewer (past every window still): their decode path is shared
SHORT = {"mistral_window": 24, "gemma": 24, "gemma3": 24, "phi3": 24, "olmo2": 24, "granite": 24}
SHORT.update(qwen3_moe=16, mixtral=16, qwen2_moe=16)  # test_moe's


def new_tokens(family: str) -> int:
    return SHORT.get(family, NEW)


# (family, dtype, batch, prompt length, left padding of the first prompt, TSPConfig overrides):
# MHA (llama_tied), GQA (llama, mistral, qwen3), one KV head (qwen2: D > n_kv at D = 2, 4; llama
# at D = 4), prompt lengths that are not multiples of 2·D, a replicated vocabulary, sliding windows
# (every layer; one layer of two, with Gemma's scaled embedding and (1 + w) norms), fused Phi-3
CASES = [
    ("llama", torch.float64, 2, 21, 5, {}),
    ("llama_tied", torch.float32, 1, 13, 0, {}),
    ("mistral", torch.float32, 2, 19, 3, {}),
    ("qwen2", torch.float64, 1, 30, 0, {}),
    ("qwen3", torch.float32, 2, 21, 4, {}),
    ("llama", torch.float32, 1, 11, 0, {"shard_vocab": False}),
    ("mistral_window", torch.float64, 2, 21, 5, {}),  # prompt and decode past the window
    ("gemma3", torch.float64, 2, 15, 3, {}),  # a windowed and a full layer; Gemma's parts
    ("phi3", torch.float32, 1, 13, 0, {}),
    ("gemma", torch.float32, 1, 11, 0, {}),
    ("olmo2", torch.float64, 2, 14, 2, {}),
    ("granite", torch.float64, 2, 15, 3, {}),  # scaled embedding, residuals and logits
]


def prompt(B: int, S: int, pad: int, seed: int = 3):
    """Token ids ``[B, S]`` and a tokenizer-style mask: the first prompt left-padded by ``pad``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_model(family: str, dtype: torch.dtype, **overrides):
    model = build(family, dtype, **overrides)
    model.generation_config.update(eos_token_id=None, pad_token_id=0)  # always NEW tokens
    return model.eval()


def weight_bytes(model, sharded_only: bool) -> int:
    """Parameter bytes (each tensor once); ``sharded_only`` leaves the replicated norms out."""
    return sum(p.nbytes for n, p in model.named_parameters() if not (sharded_only and "norm" in n))


def greedy_case(rank, mesh, family, dtype, B, S, pad, overrides, model_kw=None, reference=True):
    """Greedy tokens, KV and weight bytes of the TSP model; with ``reference``, rank 0 also
    returns the single-process model's tokens and KV bytes."""
    model = hf_model(family, dtype, **(model_kw or {}))
    ids, mask = prompt(B, S, pad)
    out = {}
    if reference and rank == 0:  # the same on every rank: computed once
        ref = copy.deepcopy(model)
        new = new_tokens(family)
        r = ref.generate(ids, attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True)
        out["ref"] = r.sequences
        out["ref_kv"] = sum(layer.keys.nbytes + layer.values.nbytes for layer in r.cache.layers)
    out["ref_weights"] = weight_bytes(model, sharded_only=True)
    apply_tsp(model, mesh, config=TSPConfig(**overrides))
    new = new_tokens(family)
    g = model.generate(ids, attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True)
    out["tokens"] = g.sequences
    out["kv"] = g.cache.kv_bytes()
    out["cached_tokens"] = g.cache.layers[0].token_index.numel()
    out["weights"] = weight_bytes(model, sharded_only=True)
    return out


def sampling_case(rank, mesh, reference: bool):
    """Sampling after a different seed on every rank: the same tokens on every rank (the
    generator state is synced), and (``reference``) the reference's tokens for rank 0's seed."""
    model = hf_model("mistral", torch.float32)
    ids, mask = prompt(2, 15, 2)
    kw = dict(attention_mask=mask, max_new_tokens=32, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(7)
    ref = copy.deepcopy(model).generate(ids, **kw) if reference and rank == 0 else None
    apply_tsp(model, mesh)
    torch.manual_seed(7 + rank)
    return {"tokens": model.generate(ids, **kw), "ref": ref}


def beam_case(rank, mesh, reference: bool):
    model = hf_model("llama", torch.float64)
    ids, mask = prompt(2, 17, 4)
    kw = dict(attention_mask=mask, max_new_tokens=16, num_beams=3)
    ref = copy.deepcopy(model).generate(ids, **kw) if reference and rank == 0 else None
    apply_tsp(model, mesh)
    out = model.generate(ids, **kw)
    return {"tokens": out, "ref": ref}


def error_cases(rank, mesh):
    model = apply_tsp(hf_model("llama", torch.float32), mesh)
    other = apply_tsp(hf_model("qwen2", torch.float32), mesh)
    ids, _ = prompt(1, 9, 0)
    long_ids = torch.ones(1, model.config.max_position_embeddings + 1, dtype=torch.long)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])  # two documents in one prompt row
    return {
        "too long": error_message(lambda: model.generate(long_ids, max_new_tokens=1)),
        "assisted": error_message(lambda: model.generate(ids, assistant_model=other)),
        "contrastive": error_message(lambda: model.generate(ids, penalty_alpha=0.6, top_k=4)),
        "ranks differ": error_message(lambda: model.generate(ids + rank, max_new_tokens=2)),
        "dynamic cache": error_message(
            lambda: model(input_ids=ids, cache=DynamicCache(config=model.config))
        ),
        "other layout": error_message(lambda: model.generate(ids, cache=TSPCache(other))),
        "packed": error_message(
            lambda: model(input_ids=ids, position_ids=packed, cache=TSPCache(model))
        ),
    }


def worker(rank, world):
    """Every case at D = world; each single-process reference once, on rank 0: the greedy ones
    at D = 1, sampling and beams at D = 2 (``reference_runs``)."""
    mesh = init_tsp_mesh(world)
    out = {c[:5]: greedy_case(rank, mesh, *c, reference=world == 1) for c in CASES}
    if world > 1:
        out["sampling"] = sampling_case(rank, mesh, reference=world == 2)
        out["beams"] = beam_case(rank, mesh, reference=world == 2)
    if world == 2:  # what test_errors reads
        out["errors"] = error_cases(rank, mesh)
    return out


@functools.cache
def results(workers, world):
    return workers.run(worker, world, timeout=300)


def reference_runs(workers) -> dict:
    """Rank 0's runs that hold the single-process references: the greedy cases' at D = 1 (by
    case), sampling's and beams' at D = 2 (by mode)."""
    at_2 = results(workers, 2)[0]
    return {**results(workers, 1)[0], "sampling": at_2["sampling"], "beams": at_2["beams"]}


# any TSP size: 14 query / 2 KV heads, F = 53, V = 97 at D = 3 — groups of 5, 5, 4 query heads;
# KV head 0 on ranks 0 and 1, KV head 1 on ranks 1 and 2 (rank 1 holds both)
UNEVEN = ("qwen2", torch.float64, 2, 19, 4)
UNEVEN_MODEL = dict(
    num_attention_heads=14,
    num_key_value_heads=2,
    hidden_size=112,
    intermediate_size=53,
    vocab_size=97,
)


def uneven_worker(rank, world):
    return greedy_case(rank, init_tsp_mesh(world), *UNEVEN, {}, model_kw=UNEVEN_MODEL)


def test_greedy_matches_hf_with_uneven_heads_mlp_and_vocab(workers):
    runs = workers.run(uneven_worker, 3, timeout=300)
    ref = runs[0]["ref"]
    assert ref.shape[1] == UNEVEN[3] + NEW
    for rank, run in enumerate(runs):
        assert torch.equal(run["tokens"], ref), f"rank={rank}"
    # every rank caches all tokens of the KV heads its queries use: ranks 0 and 2 one head each,
    # rank 1 both (the shared heads are cached by both their users)
    assert [run["kv"] for run in runs] == [runs[0]["ref_kv"] // 2, runs[0]["ref_kv"]] + [
        runs[0]["ref_kv"] // 2
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_greedy_matches_hf_token_for_token(workers, world):
    runs = results(workers, world)
    for case in CASES:
        ref = reference_runs(workers)[case[:5]]["ref"]
        assert ref.shape[1] == case[3] + new_tokens(case[0])
        for rank, run in enumerate(runs):
            assert torch.equal(run[case[:5]]["tokens"], ref), f"D={world} rank={rank} {case}"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_kv_cache_and_weights_are_one_dth(workers, world):
    runs = results(workers, world)
    for family, dtype, B, S, pad, overrides in CASES:
        key = (family, dtype, B, S, pad)
        ref_kv = reference_runs(workers)[key]["ref_kv"]
        kv = [run[key]["kv"] for run in runs]
        assert sum(kv) == ref_kv, (key, kv)  # every cached token on exactly one rank
        model = build(family, dtype)
        c = max(world // model.config.num_key_value_heads, 1)
        tokens = S + new_tokens(family) - 1  # the last generated token is never fed back
        window = family_of(model).sliding_window(model.model.layers[0].self_attn)
        if window is not None:  # a windowed layer 0 keeps the last window - 1 tokens, as HF's
            tokens = window - 1
        for run in runs:  # a KV head's replicas split its tokens by blocks of KV_BLOCK
            assert abs(run[key]["cached_tokens"] - tokens / c) <= KV_BLOCK, (key, run[key])
        if c == 1:
            assert kv == [ref_kv // world] * world, (key, kv)
        if c == 1 and not overrides:  # (shard_vocab=False replicates the embedding and head)
            weights = [run[key]["weights"] for run in runs]
            assert weights == [runs[0][key]["ref_weights"] // world] * world, (key, weights)


@pytest.mark.parametrize("world", [2, 4])
def test_sampling_and_beams_agree_across_ranks(workers, world):
    runs = results(workers, world)
    for mode in ("sampling", "beams"):
        ref = reference_runs(workers)[mode]["ref"]
        for rank, run in enumerate(runs):
            assert torch.equal(run[mode]["tokens"], ref), f"{mode} D={world} rank={rank}"


def test_errors(workers):
    errors = results(workers, 2)[0]["errors"]
    expected = {
        "too long": "max_position_embeddings",
        "assisted": "assisted decoding",
        "contrastive": "contrastive search",
        "ranks differ": "different input_ids",
        "dynamic cache": "needs a TSPCache",
        "other layout": "was built for",
        "packed": "restart inside a row (packed documents)",
    }
    for what, words in expected.items():
        assert words in errors[what], (what, errors[what])
