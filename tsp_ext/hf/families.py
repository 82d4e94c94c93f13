"""One spec per model family (``hf.spec``'s ``Family``), torch-free: where a Hugging Face
causal LM keeps the parts TSP replaces, which kind of token and channel mixer each decoder layer
holds, the flags that change the maths, the Hugging Face names of its weights and its
``model_type`` s (the planner reads them). ``apply_tsp``, loading, export, inference, FSDP2 and
the self-check read these entries, and nothing else names a family.

A family of an existing kind is one entry in ``FAMILIES`` and its parity tests
(``tests/models.py``); a new kind of mixer is one engine module, one hf module and its entry in
``hf.layers``. ``family_of`` takes a model whose class is not listed but whose parts are where
the Llama description says as that structure (``apply_tsp``'s self-check then proves it exact or
refuses it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import (
    GATED_DELTA_NET,
    GATED_MLP,
    MOE,
    SOFTMAX_ATTENTION,
    ChannelMixer,
    Family,
    ModelType,
    VisionSpec,
    config_value,
)

if TYPE_CHECKING:
    from torch import nn


LLAMA = Family(
    "Llama",
    ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    (
        ModelType("llama"),
        ModelType("mistral"),
        ModelType("qwen2", qkv_bias=True),
        ModelType("qwen3", qk_norm=True),
    ),
)
# Llama's layout with (1 + w) RMSNorms (eps ``eps``), a scaled embedding (its module's
# ``embed_scale``, read by the TSP embeddings) and GELU-tanh (the config's ``hidden_act``)
GEMMA = Family(
    "Gemma", ("GemmaForCausalLM",), (ModelType("gemma"),), norm_eps="eps", norm_offset=1.0
)
# Gemma's, with a post-norm after attention and MLP (the pre-norm of the MLP renamed), per-head
# (1 + w) q/k norms, sliding-window layers and a rotary table per layer type
GEMMA3 = Family(
    "Gemma-3",
    ("Gemma3ForCausalLM",),
    (ModelType("gemma3_text"),),
    mlp_norm="pre_feedforward_layernorm",
    attention_post_norm="post_attention_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    norm_eps="eps",
    norm_offset=1.0,
    activation="hidden_activation",
    rope_per_layer_type=True,
)
# Llama's layout with q/k/v stacked in ``qkv_proj`` and gate/up in ``gate_up_proj``
PHI3 = Family(
    "Phi-3",
    ("Phi3ForCausalLM",),
    (ModelType("phi3"),),
    fused=(
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ),
)
# Llama's layout (GraniteSWA: sliding-window layers) with IBM's scalars: the embedding times
# ``embedding_multiplier``, each mixer's output times ``residual_multiplier`` and the logits
# divided by ``logits_scaling`` (its softmax scale, ``attention_multiplier``, is the attention
# module's ``scaling``, which TSP reads)
GRANITE = Family(
    "Granite",
    ("GraniteForCausalLM", "GraniteSWAForCausalLM"),
    (ModelType("granite"), ModelType("granite_swa")),
    embedding_multiplier="embedding_multiplier",
    residual_multiplier="residual_multiplier",
    logits_divisor="logits_scaling",
)
# post-norms only, and q/k norms over the whole projection (``engine.attention.qk_rms``)
OLMO2 = Family(
    "OLMo-2",
    ("Olmo2ForCausalLM",),
    (ModelType("olmo2"),),
    attention_norm=None,
    mlp_norm=None,
    attention_post_norm="post_attention_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
)
# Llama's layout whose MLPs may be MoE blocks (Qwen3-MoE's ``mlp_only_layers`` stay dense;
# Qwen2-MoE adds a shared expert)
QWEN_MOE = Family(
    "Qwen-MoE",
    ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"),
    (ModelType("qwen2_moe", qkv_bias=True), ModelType("qwen3_moe", qk_norm=True)),
    channel_mixers=(MOE, GATED_MLP),
)
MIXTRAL = Family(
    "Mixtral",
    ("MixtralForCausalLM",),
    (ModelType("mixtral"),),
    channel_mixers=(ChannelMixer("moe", router_float32=True),),
)
# Llama's layout with attention sinks and q/k/v/o biases, alternating sliding-window and full
# layers, and a MoE block of biased experts behind a biased top-k-then-softmax router
GPT_OSS = Family(
    "gpt-oss",
    ("GptOssForCausalLM",),
    (ModelType("gpt_oss", qkv_bias=True),),
    channel_mixers=(ChannelMixer("moe", router="router", expert_form="clamped"),),
)
# Llama's layout with (1 + w) RMSNorms, three Gated DeltaNet layers (``linear_attn``) for each
# full-attention layer, whose attention has an output gate, per-head q/k norms and partial rotary;
# MoE blocks with a gated shared expert
QWEN3_NEXT = Family(
    "Qwen3-Next",
    ("Qwen3NextForCausalLM",),
    (ModelType("qwen3_next", qk_norm=True),),
    token_mixers=(GATED_DELTA_NET, SOFTMAX_ATTENTION),
    channel_mixers=(MOE, GATED_MLP),
    norm_eps="eps",
    norm_offset=1.0,
    partial_rotary=True,
)
# Qwen3-Next's layout (dense MLPs in ``Qwen3_5ForCausalLM``) whose Gated DeltaNet keeps q | k | v
# in one ``in_proj_qkv`` and z, b, a apart; its M-RoPE table is an ordinary one for text
QWEN3_5 = Family(
    "Qwen3.5",
    ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
    (ModelType("qwen3_5_text", qk_norm=True), ModelType("qwen3_5_moe_text", qk_norm=True)),
    token_mixers=(GATED_DELTA_NET, SOFTMAX_ATTENTION),
    channel_mixers=(MOE, GATED_MLP),
    norm_eps="eps",
    norm_offset=1.0,
    partial_rotary=True,
    fused=(("in_proj_qkv", ("in_proj_q", "in_proj_k", "in_proj_v")),),
)
# vision-language models: a language model of the Llama layout (Qwen2 with q/k/v biases, Qwen3
# with q/k norms, or any stock one) under ``model.language_model``, its 3-D M-RoPE table
# computed by the Hugging Face module, and a vision side (``hf.vision``)
QWEN25_VL = Family(
    "Qwen2.5-VL",
    ("Qwen2_5_VLForConditionalGeneration",),
    base="model.language_model",
    vision=VisionSpec(),
)
QWEN3_VL = Family(
    "Qwen3-VL",
    ("Qwen3VLForConditionalGeneration",),
    base="model.language_model",
    vision=VisionSpec(deepstack=True),
)
LLAVA = Family(
    "LLaVA",
    ("LlavaForConditionalGeneration",),
    base="model.language_model",
    vision=VisionSpec(
        modules=("vision_tower", "multi_modal_projector"), grids=False, mrope=False, videos=False
    ),
)
FAMILIES = (
    LLAMA,
    GEMMA,
    GEMMA3,
    PHI3,
    GRANITE,
    OLMO2,
    QWEN_MOE,
    MIXTRAL,
    GPT_OSS,
    QWEN3_NEXT,
    QWEN3_5,
    QWEN25_VL,
    QWEN3_VL,
    LLAVA,
)


def model_type_of(config: Any) -> tuple[Family, ModelType]:
    """The family and facts of a config (object or ``config.json`` dict) by its
    ``model_type``; one not listed: the Llama structure, as ``family_of`` takes it."""
    name = config_value(config, "model_type")
    for family in FAMILIES:
        for model_type in family.model_types:
            if model_type.name == name:
                return family, model_type
    return LLAMA, ModelType(name)


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer (Qwen-MoE's ``num_experts``, Mixtral's
    ``num_local_experts``); 0 for a dense model."""
    return config_value(config, "num_experts") or config_value(config, "num_local_experts") or 0


def expert_intermediate_size(config: Any) -> int:
    """Each expert's intermediate size ``F`` (Qwen-MoE's ``moe_intermediate_size``, Mixtral's
    ``intermediate_size``)."""
    return config_value(config, "moe_intermediate_size") or config_value(
        config, "intermediate_size"
    )


# Hugging Face ``hidden_act`` -> the engine's gate activation (``pointwise.GATE_ACTIVATIONS``)
GATE_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
}


def gate_activation(config, key: str = "hidden_act") -> str:
    """The engine's name of a model's gated-MLP activation (``config.<key>``, the family's
    ``activation``); ``ValueError`` if unsupported."""
    act = getattr(config, key, None)
    if act not in GATE_ACTIVATIONS:
        raise ValueError(f"{key}={act!r}: TSP's gated MLP supports {sorted(GATE_ACTIVATIONS)}")
    return GATE_ACTIVATIONS[act]


def supported_names() -> str:
    return ", ".join(c for f in FAMILIES for c in f.classes)


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def family_of(model: nn.Module) -> Family:
    """The family of ``model`` (a Hugging Face causal LM, not a PEFT wrapper): its class's, else
    the first whose layout its modules follow; raises ``ValueError`` naming the layout expected."""
    name = type(model).__name__
    candidates = [f for f in FAMILIES if name in f.classes]
    if not candidates and getattr(getattr(model, "config", None), "vision_config", None):
        names = ", ".join(c for f in FAMILIES if f.vision for c in f.classes)
        raise ValueError(
            f"{name} is a vision-language model TSP does not support yet; supported: {names}"
        )
    for family in candidates or [f for f in FAMILIES if f.vision is None]:
        base = _submodule(model, family.base)
        if hasattr(base, family.layers) and hasattr(model, family.lm_head):
            return family
    candidates = candidates or list(FAMILIES)
    f = candidates[0]
    raise ValueError(
        f"{name} is not a Hugging Face decoder-only causal LM (expected .{f.base}.{f.layers} and "
        f".{f.lm_head}); supported: {supported_names()} and models of the same structure"
    )
