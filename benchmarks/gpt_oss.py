"""A tiny-width gpt-oss on one long sequence under TSP, against one process and the sequence-
parallel baselines that exist for Hugging Face models.

    python -m benchmarks.gpt_oss                      # S = 4096, D = 2 and 4
    python -m benchmarks.gpt_oss --json docs/benchmarks/gpt_oss_cpu.json
    python -m benchmarks.gpt_oss --seq 256 --tsp 2 --steps 1

``GptOssForCausalLM`` built from its config (``CONFIG``: h 128, 2 layers, a sliding-window (128)
then a full-attention layer, 8 query / 2 KV heads of 16, 8 experts of 128 with top-2, vocab
1024, YaRN positions; float32, eager attention, the only one with which Hugging Face's gpt-oss
applies its sinks), its sinks drawn from N(0, 1) so that they weigh in the softmax. Batch 1,
one random sequence of ``--seq`` tokens, forward + backward, along every path of
``benchmarks.model_paths``: one process, TSP, and DeepSpeed Ulysses and torch's ring context
parallelism on the eager model and switched to SDPA (Hugging Face refuses to build gpt-oss on
SDPA, whose kernel ignores the sinks; Ulysses and the ring replace SDPA).
"""

from __future__ import annotations

import functools

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from benchmarks import model_paths
from benchmarks.model_paths import markdown_table as markdown_table

CONFIG = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=131072,
)
BASELINES = ("ulysses", "ulysses-sdpa", "ring", "ring-sdpa")


def build_model() -> GptOssForCausalLM:
    """The same randomly initialised float32 model on every rank, its sinks ~ N(0, 1)."""
    cfg = GptOssConfig(**CONFIG, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    return model


bench = functools.partial(model_paths.bench, build_model, baselines=BASELINES)


def main(argv=None) -> None:
    model_paths.main(__doc__.splitlines()[0], build_model, CONFIG, BASELINES, argv)


if __name__ == "__main__":
    main()
