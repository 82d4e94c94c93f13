"""A tiny-width Qwen3-Next (hybrid linear attention) on one long sequence under TSP, against one
process and the sequence-parallel baselines that exist for Hugging Face models.

    python -m benchmarks.qwen3_next                      # S = 4096, D = 2 and 4
    python -m benchmarks.qwen3_next --json docs/benchmarks/qwen3_next_cpu.json
    python -m benchmarks.qwen3_next --seq 256 --tsp 2 --steps 1

``Qwen3NextForCausalLM`` built from its config (``CONFIG``: h 128, 4 layers, three Gated DeltaNet
layers (4 key / 8 value heads of 32, conv 4) then a gated full-attention layer (8 query / 2 KV
heads of 32, RoPE on a quarter of each head), MoE blocks of 8 experts of 64 with top-2 and a
gated shared expert of 128, vocab 1024; float32, SDPA, Hugging Face's pure-PyTorch gated-delta
kernels: no ``fla`` on CPU), its decays slowed (``A_log`` ~ log U(1e-4, 1e-3): a state keeps
e^-1 of itself after some 800 to 8,000 tokens, as a trained model's long-memory heads do) so
that what a rank's tokens read depends on the tokens before them on the other ranks. Batch 1,
one random sequence of ``--seq`` tokens, forward + backward, along every path of
``benchmarks.model_paths``: one process, TSP, DeepSpeed Ulysses and torch's ring context
parallelism (each shards the tokens and leaves the linear layers to run on a rank's own
tokens).
"""

from __future__ import annotations

import functools

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from benchmarks import model_paths
from benchmarks.model_paths import markdown_table as markdown_table

CONFIG = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=128,
    max_position_embeddings=131072,
)
BASELINES = ("ulysses", "ring")


def build_model() -> Qwen3NextForCausalLM:
    """The same randomly initialised float32 model on every rank, its decays slowed."""
    cfg = Qwen3NextConfig(**CONFIG, attn_implementation="sdpa", experts_implementation="eager")
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(1e-4, 1e-3).log_()
    return model


bench = functools.partial(model_paths.bench, build_model, baselines=BASELINES)


def main(argv=None) -> None:
    model_paths.main(__doc__.splitlines()[0], build_model, CONFIG, BASELINES, argv)


if __name__ == "__main__":
    main()
