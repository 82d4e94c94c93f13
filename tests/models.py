"""Tiny Hugging Face models built from their config classes (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    vocab_size=96,
    max_position_embeddings=512,
    attn_implementation="sdpa",
)

# name -> (model class, config class, overrides): GQA, D > n_kv, biases, q/k norms, tied weights
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama_tied": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=1)),
    # sliding windows: every layer (Mistral), the second layer only (Qwen2's layer_types)
    "mistral_window": (
        MistralForCausalLM,
        MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=6),
    ),
    "qwen2_window": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
    ),
    # (1 + w) norms, scaled embedding, GELU-tanh, tied embeddings (Gemma's defaults)
    "gemma": (
        GemmaForCausalLM,
        GemmaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    ),
    # post-norms, (1 + w) per-head q/k norms, a windowed and a full layer, a rotary table each
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # q/k/v fused in qkv_proj, gate/up in gate_up_proj
    "phi3": (
        Phi3ForCausalLM,
        Phi3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=None, eos_token_id=None),
    ),
    # IBM's scalars as Granite-3.1-2B sets them: the embedding times 12, each mixer's output
    # times 0.22, the softmax scale 1/64 (not 1/sqrt(8)), the logits divided by 8
    "granite": (
        GraniteForCausalLM,
        GraniteConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
        ),
    ),
    # post-norms only, q/k norms over the whole projection
    "olmo2": (
        Olmo2ForCausalLM,
        Olmo2Config,
        dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=None, eos_token_id=None),
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    ),
}


# mixture-of-experts models (``tests/test_moe.py``): 4 experts, top-2, the per-expert loop of
# Hugging Face (its grouped_mm takes no float64); Qwen3-MoE with a dense first layer
# (``mlp_only_layers``) and experts of an intermediate size no D = 4 divides, Qwen2-MoE with its
# gated shared expert and unnormalised top-k weights
MOE = dict(num_attention_heads=4, num_key_value_heads=2, experts_implementation="eager")
MOE_FAMILIES = {
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        dict(
            **MOE,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=18,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig,
        dict(
            **MOE,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=20,
        ),
    ),
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig,
        dict(
            **MOE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
    ),
    # attention sinks, q/k/v/o biases, a windowed and a full layer; biased router and experts,
    # gate / up interleaved, a SwiGLU clamp low enough to clip some activations
    "gpt_oss": (
        GptOssForCausalLM,
        GptOssConfig,
        dict(
            **MOE,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            swiglu_limit=0.5,
            attn_implementation="eager",  # Hugging Face's gpt-oss runs its sinks in eager only
        ),
    ),
}


# hybrid linear attention (``tests/test_qwen3_next.py``): a Gated DeltaNet layer (4 key / 8 value
# heads: D = 3 splits them 2, 1, 1) and a gated full-attention layer (RoPE on 2 of 8 dims), both
# with MoE blocks of 4 experts, top-2, and a gated shared expert (Qwen3.5: dense MLPs)
HYBRID = dict(
    head_dim=8,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
HYBRID_MOE = dict(
    **MOE,
    **HYBRID,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)
HYBRID_FAMILIES = {
    "qwen3_next": (Qwen3NextForCausalLM, Qwen3NextConfig, HYBRID_MOE),
    "qwen3_5": (
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, **HYBRID),
    ),
    "qwen3_5_moe": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, HYBRID_MOE),
}


def build(name: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """The same randomly initialised model on every rank (fixed seed), in ``dtype``."""
    model_cls, cfg_cls, kw = {**FAMILIES, **MOE_FAMILIES, **HYBRID_FAMILIES}[name]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **kw, **overrides})).to(dtype)
    with torch.no_grad():  # make norms and biases non-trivial so their gradients are tested
        for n, p in model.named_parameters():
            if p.dim() == 1 or n.endswith("_bias"):  # gpt-oss's experts' biases are [E, .]
                p.add_(torch.randn_like(p) * 0.2)
            elif n.endswith(("mlp.gate.weight", "mlp.router.weight")):  # zero: ties in top-k
                p.normal_(0, 1.0)
    return model


# every projection TSP folds, as PEFT names them
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora(name: str, dtype: torch.dtype, targets, dropout: float = 0.0, **lora_kw):
    """``build(name, dtype)`` with a PEFT LoRA adapter (r = 4, alpha = 8) on ``targets``, the
    same on every rank; its B's are non-zero so that every gradient is exercised."""
    from peft import LoraConfig, get_peft_model

    model = build(name, dtype)
    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, **lora_kw)
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return peft


def batch(vocab: int, B: int, S: int, seed: int = 1, pad_last: int = 0):
    """``input_ids``/``labels`` (and a right-padding ``attention_mask`` if ``pad_last``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if pad_last:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[-1, S - pad_last :] = 0
        out["attention_mask"] = mask
        out["labels"] = ids.masked_fill(mask == 0, -100)
    return out


def causal_lm_loss(model, data) -> torch.Tensor:
    """The unmodified model's token-mean causal-LM loss, computed in the logits' dtype."""
    return lm_loss(model(input_ids=data["input_ids"]).logits, data["labels"])


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss (shift, ignore -100, token mean) in the logits' dtype.

    Hugging Face's own loss upcasts float64 logits *down* to float32; float64 references use this
    instead so that they are float64-exact (for float32 models the two are the same).
    """
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
