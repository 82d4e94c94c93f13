"""End-to-end TSP demo: a small Llama trained with ``apply_tsp`` on D processes.

Launch: ``torchrun --standalone --nproc_per_node 2 recipes/tsp_demo.py``. Every rank holds 1/D of
each layer's weights and 1/D of the tokens. The first rank also trains the unmodified Hugging Face
model on the full batch and logs how far the two runs are apart (float32 rounding, no more).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from tsp_ext import apply_tsp, init_tsp_mesh, shard_batch

log = logging.getLogger("tsp_demo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    mesh = init_tsp_mesh(tsp_size=int(os.environ.get("WORLD_SIZE", 1)))  # all ranks on TSP
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model) if rank == 0 else None
    n_full = sum(p.numel() for p in model.parameters())
    apply_tsp(model, mesh)
    n_local = sum(p.numel() for p in model.parameters())
    D = mesh["tsp"].size()
    log.info(
        f"TSP D={D}, S={args.seq_len}: {n_local} of {n_full} parameters and "
        f"{args.seq_len // D} of {args.seq_len} tokens per rank"
    )

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3) if ref is not None else None
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len), generator=gen)
        data = {"input_ids": ids, "labels": ids}
        out = model(**shard_batch(data, mesh))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        if ref is not None:
            ref_loss = ref(**data).loss
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            gap = abs(out.loss.item() - ref_loss.item())
            log.info(f"step {step}: loss {out.loss.item():.5f}  |TSP - single process| {gap:.1e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
