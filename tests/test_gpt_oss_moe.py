"""gpt-oss's mixture-of-experts block under TSP against Hugging Face's ``GptOssMLP``: the router
with its bias (top k of the logits, then their softmax), experts with biases, gate/up
interleaved and the clamped SwiGLU; output and every gradient under both schedules at D = 1, 2,
4 and with uneven experts per rank, and the decode path."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from checks import rel_err
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from tsp_ext import TSPConfig, ZigzagLayout
from tsp_ext.engine.feed_forward.moe_traffic import SCHEDULES
from tsp_ext.engine.sharding.partition import split_range
from tsp_ext.hf.families import GPT_OSS
from tsp_ext.hf.moe import TSPSparseMoe, check_moe_block

pytestmark = pytest.mark.multiproc

FAMILY = GPT_OSS
H, F, K, LIMIT = 32, 16, 4, 7.0
SHAPES = {1: (2, 12), 2: (2, 12), 3: (2, 12), 4: (3, 8)}  # (B, S): 24 tokens, S a multiple of 2D
EXPERTS = {1: (8,), 2: (8,), 3: (8,), 4: (8, 6)}  # 8 on 3 ranks: 3, 3, 2; 6 on 4: 2, 2, 1, 1
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
SCALE = {"experts.gate_up_proj": 0.7, "router.weight": 0.3}  # else 0.5: some |gate|, |up| > 7


def hf_block(n_experts: int, dtype: torch.dtype) -> GptOssMLP:
    """``GptOssMLP`` in ``dtype`` with random weights and biases, the same on every rank, scaled
    so that some gate and up values pass the clamp limit."""
    cfg = GptOssConfig(
        hidden_size=H,
        intermediate_size=F,
        num_local_experts=n_experts,
        num_experts_per_tok=K,
        swiglu_limit=LIMIT,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(n_experts)
    block = GptOssMLP(cfg).to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, SCALE.get(name, 0.5))
    return block


def clamped(block: GptOssMLP, x: torch.Tensor) -> tuple[int, int]:
    """How many gate values of routed (token, expert) pairs pass ``limit``, and up values ±limit."""
    x2 = x.reshape(-1, H)
    _, _, index = block.router(x2)
    ex = block.experts
    hid = torch.einsum("nh,nkhf->nkf", x2, ex.gate_up_proj[index]) + ex.gate_up_proj_bias[index]
    return int((hid[..., ::2] > LIMIT).sum()), int((hid[..., 1::2].abs() > LIMIT).sum())


def block_case(rank: int, world: int, n_experts: int, schedule: str, dtype: torch.dtype) -> dict:
    """Errors of the TSP block on this rank's zigzag shard against ``GptOssMLP`` on the whole
    batch: output, every gradient (this rank's experts' slices), decode; and the clamp counts."""
    B, S = SHAPES[world]
    ref = hf_block(n_experts, dtype)
    block = copy.deepcopy(ref)
    torch.manual_seed(100)
    x = torch.randn(B, S, H, dtype=dtype)
    dy = torch.randn(B, S, H, dtype=dtype)
    xr = x.clone().requires_grad_()
    y_ref, _ = ref(xr)
    y_ref.backward(dy)

    config = TSPConfig(moe_schedule=schedule)
    tsp = TSPSparseMoe.from_hf(block, dist.group.WORLD, config, FAMILY)
    layout = ZigzagLayout(S, world)
    xl = layout.shard(x, rank).requires_grad_()
    y, _ = tsp(xl)  # (output, router scores), as GptOssMLP returns them
    y.backward(layout.shard(dy, rank))
    errs = {"out": rel_err(y.detach(), layout.shard(y_ref.detach(), rank))}
    errs["x"] = rel_err(xl.grad, layout.shard(xr.grad, rank))
    errs["router.weight"] = rel_err(tsp.router_module().weight.grad, ref.router.weight.grad)
    errs["router.bias"] = rel_err(tsp.router_module().bias.grad, ref.router.bias.grad)
    mine = split_range(n_experts, world, rank)
    for name, p in tsp.experts.named_parameters():
        full = getattr(ref.experts, name)
        assert p.shape == full[mine].shape, (name, p.shape)
        errs[f"experts.{name}"] = rel_err(p.grad, full.grad[mine])
    with torch.no_grad():
        tokens = x[:, :2]  # a decode step's tokens, replicated
        errs["decode"] = rel_err(tsp.decode(tokens), ref(tokens)[0])
    return {"errs": errs, "clamped": clamped(ref, x), "experts": tsp.experts.down_proj.shape[0]}


def cases(world: int) -> list[tuple[int, str, torch.dtype]]:
    """``(E, schedule, dtype)`` of each case at D = world: float64 for every E and schedule, and
    at D = 2 float32 (the grouped GEMMs, ``torch._grouped_mm`` on CPU) on both schedules."""
    out = [(E, s, torch.float64) for E in EXPERTS[world] for s in SCHEDULES]
    return out + [(8, s, torch.float32) for s in SCHEDULES if world == 2]


def worker(rank: int, world: int) -> dict:
    return {case: block_case(rank, world, *case) for case in cases(world)}


@functools.cache
def results(workers, world: int) -> list[dict]:
    return workers.run(worker, world, timeout=200)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gpt_oss_block_output_grads_and_decode_match_hf(workers, world):
    for rank, run in enumerate(results(workers, world)):
        assert list(run) == cases(world)
        for (E, schedule, dtype), case in run.items():
            bad = {k: v for k, v in case["errs"].items() if not v < TOL[dtype]}
            assert not bad, f"D={world} rank={rank} E={E} {schedule} {dtype}: {bad}"
            gates, ups = case["clamped"]
            assert gates > 0 and ups > 0, (E, gates, ups)  # the clamps' gradients are exercised
            mine = split_range(E, world, rank)
            assert case["experts"] == mine.stop - mine.start


def test_check_moe_block_takes_gpt_oss_biases_of_the_config_shapes():
    block = hf_block(8, torch.float64)
    check_moe_block("GptOssForCausalLM", 1, block, FAMILY)
    wrong = copy.deepcopy(block)
    wrong.experts.down_proj_bias = torch.nn.Parameter(torch.zeros(8, H + 1))
    with pytest.raises(ValueError, match=r"down_proj_bias is \(8, 33\), the config says \(8, 32\)"):
        check_moe_block("GptOssForCausalLM", 1, wrong, FAMILY)
    block.router.bias = torch.nn.Parameter(torch.zeros(7))
    with pytest.raises(ValueError, match=r"router's bias is \(7,\); TSP takes a router bias \[8\]"):
        check_moe_block("GptOssForCausalLM", 1, block, FAMILY)
