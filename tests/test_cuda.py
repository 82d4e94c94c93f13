"""TSP on a GPU (D = 1, one process): the attention and MLP layers on every CUDA attention backend,
and the whole model (vocab-sharded embedding, fused LM-head loss, norms), in bf16 and float32
against the Hugging Face modules on the same GPU. Skipped without CUDA; run by
``benchmarks/gpu_check.sh``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from checks import rel_err
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRotaryEmbedding,
)

from tsp_ext import (
    TSPAttention,
    TSPConfig,
    TSPGatedMLP,
    ZigzagLayout,
    apply_tsp,
    full_grads,
    init_tsp_mesh,
    shard_batch,
)
from tsp_ext.engine.kernels.backends import available_backends
from tsp_ext.testing.launch import free_port

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# bf16 is compared with the float32 HF modules: rounding of bf16 activations, ~1e-2
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _config(**kw) -> LlamaConfig:
    """A small GQA Llama (8 query heads, 2 KV heads, h = 256)."""
    base = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8)
    return LlamaConfig(**base, num_key_value_heads=2, attn_implementation="sdpa", **kw)


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
    cfg = _config(num_hidden_layers=1, vocab_size=64)
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


def _model_loss_and_grads(model, data, mesh=None):
    loss = model(**(shard_batch(data, mesh) if mesh else data)).loss
    loss.backward()
    grads = full_grads(model) if mesh else {n: p.grad for n, p in model.named_parameters()}
    return loss.detach().float(), {n: g.float() for n, g in grads.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tsp_model_on_cuda_matches_hf(group, dtype):
    """Loss and every gradient of the whole model (the GEMMs into float32 accumulators included)
    against the float32 HF model: within 1e-4 in float32; in bf16, within twice the error of the
    HF model run in bf16 (+ 5e-3)."""
    dev = torch.device("cuda")
    cfg = _config(num_hidden_layers=2, vocab_size=512)
    ids = torch.randint(cfg.vocab_size, (2, 1024), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids.to(dev), "labels": ids.to(dev)}

    def llama(dt):
        torch.manual_seed(0)
        return LlamaForCausalLM(copy.deepcopy(cfg)).to(dev, dt)  # apply_tsp edits its config

    ref_loss, ref_grads = _model_loss_and_grads(llama(torch.float32), data)
    mesh = init_tsp_mesh(1)
    loss, grads = _model_loss_and_grads(apply_tsp(llama(dtype), mesh), data, mesh)
    errs = {"loss": rel_err(loss, ref_loss)}
    errs.update({n: rel_err(grads[n], g) for n, g in ref_grads.items()})
    if dtype == torch.float32:
        bound = dict.fromkeys(errs, 1e-4)
    else:
        hf_loss, hf_grads = _model_loss_and_grads(llama(dtype), data)
        hf = {"loss": rel_err(hf_loss, ref_loss)}
        hf.update({n: rel_err(hf_grads[n], g) for n, g in ref_grads.items()})
        bound = {n: 2 * e + 5e-3 for n, e in hf.items()}
    bad = {n: (e, bound[n]) for n, e in errs.items() if not e < bound[n]}
    assert not bad, (dtype, bad)
