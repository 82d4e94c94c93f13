"""End-to-end TSP engine demo: one Llama block's attention + MLP trained on D ranks.

Launch: ``torchrun --standalone --nproc_per_node 2 recipes/engine_demo.py``. Every rank holds
1/D of the weights and 1/D of the tokens; rank 0 also trains the unmodified Hugging Face modules
on the full sequence and reports how far the two runs drift apart (they should not).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding

from tsp_ext import TSPAttention, TSPGatedMLP, ZigzagLayout, comm

log = logging.getLogger("engine_demo")


def block(attn, mlp, x, pe):
    """A pre-norm-free residual block: ``x + attn(x)`` then ``+ mlp``."""
    h = x + attn(x, position_embeddings=pe)[0]
    return h + mlp(h)


def main(seq_len: int = 2048, steps: int = 5) -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    D, p = comm.size_and_rank(group)
    logging.basicConfig(level=logging.INFO if p == 0 else logging.WARNING, format="%(message)s")
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    attn, mlp, rope = LlamaAttention(cfg, 0), LlamaMLP(cfg), LlamaRotaryEmbedding(cfg)
    t_attn, t_mlp = TSPAttention.from_hf(attn, group), TSPGatedMLP.from_hf(mlp, group)
    lay = ZigzagLayout(seq_len, D)
    x = torch.randn(1, seq_len, cfg.hidden_size)
    target = torch.randn_like(x)
    x_l, target_l = lay.shard(x, p), lay.shard(target, p)
    pe_l = rope(x_l, lay.positions(p)[None])
    pe = rope(x, torch.arange(seq_len)[None])
    tsp_params = [*t_attn.parameters(), *t_mlp.parameters()]
    ref_params = [*attn.parameters(), *mlp.parameters()]
    opt = torch.optim.SGD(tsp_params, lr=1e-2)
    ref_opt = torch.optim.SGD(ref_params, lr=1e-2)
    n_params = sum(t.numel() for t in tsp_params)
    log.info(
        f"TSP D={D}, S={seq_len}: {n_params} of {sum(t.numel() for t in ref_params)} "
        f"weights and {seq_len // D} of {seq_len} tokens per rank"
    )
    for step in range(steps):
        # global mean-squared error: local sums, summed over ranks inside autograd
        local = ((block(t_attn, t_mlp, x_l, pe_l) - target_l) ** 2).sum()
        loss = comm.sum_over_ranks(local, group) / target.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if p == 0:
            ref_loss = ((block(attn, mlp, x, pe) - target) ** 2).mean()
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            drift = abs(loss.item() - ref_loss.item())
            log.info(f"step {step}: loss {ref_loss.item():.6f}  |TSP - reference| {drift:.2e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
