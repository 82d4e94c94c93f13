"""TSP attention and MLP on a GPU (D = 1, one process): every CUDA attention backend in bf16 and
float32 against the Hugging Face modules on the same GPU. Skipped without CUDA; run by
``benchmarks/gpu_check.sh``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import rel_err
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRotaryEmbedding,
)

from tsp_ext import TSPAttention, TSPConfig, TSPGatedMLP, ZigzagLayout
from tsp_ext.engine.attention_kernels import available_backends
from tsp_ext.testing.launch import free_port

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# bf16 is compared with the float32 HF modules: rounding of bf16 activations, ~1e-2
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    yield dist.group.WORLD
    dist.destroy_process_group()


def _cases():
    if not torch.cuda.is_available():
        return []
    return [
        (b, dt) for dt in (torch.float32, torch.bfloat16) for b in available_backends("cuda", dt)
    ]


@pytest.mark.parametrize("backend, dtype", _cases())
def test_tsp_layer_on_cuda_matches_hf(group, backend, dtype):
    dev = torch.device("cuda")
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    attn, mlp = LlamaAttention(cfg, 0).to(dev), LlamaMLP(cfg).to(dev)
    rope = LlamaRotaryEmbedding(cfg).to(dev)
    B, S = 2, 1024
    x = torch.randn(B, S, cfg.hidden_size, device=dev)
    dy = torch.randn_like(x)
    cos, sin = rope(x, torch.arange(S, device=dev)[None].expand(B, S))
    xr = x.clone().requires_grad_()
    y_ref = attn(xr, position_embeddings=(cos, sin), attention_mask=None)[0] + mlp(xr)
    (y_ref * dy).sum().backward()

    tcfg = TSPConfig(attn_backend=backend)
    t_attn = TSPAttention.from_hf(attn, group, tcfg).to(dtype)
    t_mlp = TSPGatedMLP.from_hf(mlp, group, tcfg).to(dtype)
    lay = ZigzagLayout(S, 1)
    xt = x.to(dtype).requires_grad_()
    cs = tuple(t.to(dtype) for t in rope(x, lay.positions(0, dev)[None].expand(B, S)))
    y = t_attn(xt, position_embeddings=cs)[0] + t_mlp(xt)
    (y * dy.to(dtype)).sum().backward()
    errs = {"out": rel_err(y.float(), y_ref), "dx": rel_err(xt.grad.float(), xr.grad)}
    for mod, ref in ((t_attn, attn), (t_mlp, mlp)):
        for name, p in mod.named_parameters():
            errs[name] = rel_err(p.grad.float(), ref.get_parameter(name).grad)
    bad = {k: v for k, v in errs.items() if not v < TOL[dtype]}
    assert not bad, (backend, dtype, bad)
