"""Where a Hugging Face decoder-only causal LM keeps the parts TSP replaces: one description per
family, read by ``apply_tsp``, inference, FSDP2 and loading alike.

A ``Family`` names the attributes of the model (base model, layers, embedding, final norm,
rotary embedding, LM head) and of each decoder layer (attention and its projections, MLP and its
projections, the norms before and after attention and MLP, where it has them), the kind of its
RMSNorms (``weight`` or ``1 + weight``, their epsilon attribute), the config key of its gate
activation, its fused projections (Phi-3) and whether it has one rotary table per layer type
(Gemma-3); ``layer_forward`` runs a decoder layer's residual structure. Adding a family is one
entry in ``FAMILIES`` and its parity tests (``tests/models.py``). An embedding's scale, a layer's
sliding window and the q/k norms' width are read from the modules. ``family_of`` takes a model
whose class is not listed but whose parts are where the Llama description says as that structure.

Mixture-of-experts families (``moe``) have layers whose MLP is a sparse block: a router
(``router``), the experts (``experts.gate_up_proj [E, 2F, h]``, ``down_proj [E, h, F]``; TSP
gives each rank E/D whole experts: ``hf.moe``) and, in Qwen2-MoE, a shared expert with a sigmoid
gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# each expert's F, read from the config (``hf.moe`` imports it from here)
from .model_types import expert_intermediate_size as expert_intermediate_size
from .vision_plan import VisionSpec


@dataclass(frozen=True)
class Family:
    """Attribute names of one family's causal LM (defaults: the Llama layout)."""

    name: str
    classes: tuple[str, ...]  # the ``*ForCausalLM`` classes checked against TSP
    base: str = "model"  # the decoder stack's module (its path) on the causal LM
    layers: str = "layers"
    embedding: str = "embed_tokens"
    final_norm: str = "norm"
    rotary: str = "rotary_emb"
    lm_head: str = "lm_head"  # on the causal LM
    attention: str = "self_attn"  # on a decoder layer
    # a hybrid model's linear-attention layers hold this module instead (Qwen3-Next's Gated
    # DeltaNet, ``hf.linear_attention``); None: every layer has ``attention``
    linear_attention: str | None = None
    partial_rotary: bool = False  # its attention rotates part of each head (partial_rotary_factor)
    attention_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp: str = "mlp"
    mlp_projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    attention_norm: str | None = "input_layernorm"  # the pre-norm of the attention
    mlp_norm: str | None = "post_attention_layernorm"  # the pre-norm of the MLP
    attention_post_norm: str | None = None  # norms of the attention's / MLP's output (Gemma-3)
    mlp_post_norm: str | None = None
    norm_eps: str = "variance_epsilon"  # the RMSNorms' epsilon attribute
    norm_offset: float = 0.0  # RMSNorm as x̂·(offset + w), in float32: Gemma's (1 + w)
    activation: str = "hidden_act"  # the config's name of the gate's activation
    rope_per_layer_type: bool = False  # rotary(x, pos, layer_type): one table per layer type
    # Hugging Face projections stacking several of TSP's by rows, ``(fused, parts)`` (Phi-3's
    # ``qkv_proj``, ``gate_up_proj``; Qwen3.5's Gated DeltaNet ``in_proj_qkv``): split when TSP
    # is applied, stacked again in every Hugging Face-facing tensor (``hf_tensors``, export,
    # shard-on-read loading)
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    moe: bool = False  # layers may hold a sparse MoE block (an ``experts`` module) as MLP
    router: str = "gate"  # on a MoE block: the router, then the experts
    experts: str = "experts"
    # routing weights: float32 (Mixtral), else cast to the router logits' dtype (Qwen)
    router_float32: bool = False
    vision: VisionSpec | None = None  # a vision-language model's vision side (``hf.vision``)

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """Every RMSNorm of a decoder layer."""
        names = (self.attention_norm, self.mlp_norm, self.attention_post_norm, self.mlp_post_norm)
        return tuple(n for n in names if n is not None)

    def base_of(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.base)

    def layers_of(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self.base_of(model), self.layers)

    def mixer(self, layer: nn.Module) -> str:
        """The name of a layer's token mixer: ``attention``, or ``linear_attention`` on a hybrid
        model's linear-attention layers."""
        if self.linear_attention is not None and hasattr(layer, self.linear_attention):
            return self.linear_attention
        return self.attention

    def projection_blocks(self, layer: nn.Module) -> tuple[tuple[nn.Module, tuple[str, ...]], ...]:
        """``(attention, its projection names), (MLP, its projection names)`` of a layer (the
        attention alone where the MLP is a MoE block; no attention on a linear-attention
        layer)."""
        attention = ()
        if self.mixer(layer) == self.attention:
            attention = ((getattr(layer, self.attention), self.attention_projections),)
        if self.is_moe(getattr(layer, self.mlp)):
            return attention
        return (*attention, (getattr(layer, self.mlp), self.mlp_projections))

    def is_moe(self, mlp: nn.Module) -> bool:
        """Whether a layer's MLP module is a mixture-of-experts block."""
        return hasattr(mlp, self.experts)

    def unfuse(self, layer: nn.Module, config) -> None:
        """Replace a layer's fused projections by their parts (``nn.Linear`` views of its rows),
        as TSP's modules take them (``config``: the model's text config, the parts' rows)."""
        for module in (getattr(layer, self.mixer(layer)), getattr(layer, self.mlp)):
            for fused, parts in self.fused:
                linear = getattr(module, fused, None)
                if linear is None:
                    continue
                if linear.bias is not None:
                    raise ValueError(f"a fused {fused} with a bias is not supported")
                rows = _part_rows(parts, config)
                for part, w in zip(parts, linear.weight.split(rows)):
                    piece = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                    piece.weight = nn.Parameter(w, requires_grad=linear.weight.requires_grad)
                    setattr(module, part, piece)
                delattr(module, fused)

    def _fused_part(self, name: str) -> tuple[str, int, tuple[str, ...]] | None:
        """``(Hugging Face name, part index, parts)`` of a split projection's parameter."""
        prefix, _, leaf = name.rpartition(".")
        module_path, _, proj = prefix.rpartition(".")
        for fused, parts in self.fused:
            if proj in parts:
                return f"{module_path}.{fused}.{leaf}", parts.index(proj), parts
        return None

    def fused_name(self, name: str) -> tuple[str, int, int] | None:
        """``(Hugging Face name, part index, parts)`` of a parameter of a split projection
        (``...self_attn.k_proj.weight`` -> ``(...self_attn.qkv_proj.weight, 1, 3)``), else
        None."""
        found = self._fused_part(name)
        return None if found is None else (found[0], found[1], len(found[2]))

    def fused_rows(self, name: str, config) -> tuple[str, int] | None:
        """``(Hugging Face name, first row)`` of a split projection's parameter ``name`` in its
        fused tensor, else None."""
        found = self._fused_part(name)
        if found is None:
            return None
        hf_name, i, parts = found
        return hf_name, sum(_part_rows(parts, config)[:i])

    def has_projections(self, module: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether ``module`` has the projections ``names``, each itself or in a fused one."""
        fused = {p for f, parts in self.fused if hasattr(module, f) for p in parts}
        return all(hasattr(module, n) or n in fused for n in names)

    def sliding_window(self, attention: nn.Module) -> int | None:
        """Window of a layer's attention module (query i sees keys ``(i - window, i]``) or None:
        its own ``sliding_window`` where it has one (Qwen2 / Qwen3 set it per layer from
        ``attention.config.layer_types``; Qwen2-MoE on its windowed layers only), else its config's
        (Mistral, Mixtral: every layer) unless the config has per-layer types."""
        if hasattr(attention, "sliding_window"):
            return attention.sliding_window
        if getattr(attention.config, "layer_types", None) is not None:
            return None
        return getattr(attention.config, "sliding_window", None)

    def position_embeddings(self, model: nn.Module, x: torch.Tensor, pos: torch.Tensor) -> list:
        """The rotary ``(cos, sin)`` of every decoder layer for tokens ``x`` at positions
        ``pos``: one table for all, or one per layer type (``model.config.layer_types``)."""
        rotary = getattr(self.base_of(model), self.rotary)
        n = len(self.layers_of(model))
        if not self.rope_per_layer_type:
            return [rotary(x, pos)] * n
        types = model.config.get_text_config().layer_types[:n]
        tables = {t: rotary(x, pos, t) for t in set(types)}
        return [tables[t] for t in types]

    def layer_forward(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        attention: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        mlp: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One decoder layer on ``x`` with the given calls of its attention and MLP modules:
        attention, then MLP, each through its pre-norm and post-norm where the family has them,
        added to the residual stream."""
        for module, pre, post, call in (
            (self.mixer(layer), self.attention_norm, self.attention_post_norm, attention),
            (self.mlp, self.mlp_norm, self.mlp_post_norm, mlp),
        ):
            out = call(getattr(layer, module), x if pre is None else getattr(layer, pre)(x))
            out = out[0] if isinstance(out, tuple) else out  # gpt-oss's MLP: (out, scores)
            x = x + (out if post is None else getattr(layer, post)(out))
        return x


LLAMA = Family(
    "Llama",
    ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
)
# Llama's layout with (1 + w) RMSNorms (eps ``eps``), a scaled embedding (its module's
# ``embed_scale``, read by the TSP embeddings) and GELU-tanh (the config's ``hidden_act``)
GEMMA = Family("Gemma", ("GemmaForCausalLM",), norm_eps="eps", norm_offset=1.0)
# Gemma's, with a post-norm after attention and MLP (the pre-norm of the MLP renamed), per-head
# (1 + w) q/k norms, sliding-window layers and a rotary table per layer type
GEMMA3 = Family(
    "Gemma-3",
    ("Gemma3ForCausalLM",),
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
    fused=(
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ),
)
# post-norms only, and q/k norms over the whole projection (``engine.attention.qk_rms``)
OLMO2 = Family(
    "OLMo-2",
    ("Olmo2ForCausalLM",),
    attention_norm=None,
    mlp_norm=None,
    attention_post_norm="post_attention_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
)
# Llama's layout whose MLPs may be MoE blocks (Qwen3-MoE's ``mlp_only_layers`` stay dense;
# Qwen2-MoE adds a shared expert)
QWEN_MOE = Family("Qwen-MoE", ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"), moe=True)
MIXTRAL = Family("Mixtral", ("MixtralForCausalLM",), moe=True, router_float32=True)
# Llama's layout with attention sinks and q/k/v/o biases, alternating sliding-window and full
# layers, and a MoE block of biased experts behind a biased top-k-then-softmax router
GPT_OSS = Family("gpt-oss", ("GptOssForCausalLM",), moe=True, router="router")
# Llama's layout with (1 + w) RMSNorms, three Gated DeltaNet layers (``linear_attn``) for each
# full-attention layer, whose attention has an output gate, per-head q/k norms and partial rotary;
# MoE blocks with a gated shared expert
QWEN3_NEXT = Family(
    "Qwen3-Next",
    ("Qwen3NextForCausalLM",),
    norm_eps="eps",
    norm_offset=1.0,
    moe=True,
    linear_attention="linear_attn",
    partial_rotary=True,
)
# Qwen3-Next's layout (dense MLPs in ``Qwen3_5ForCausalLM``) whose Gated DeltaNet keeps q | k | v
# in one ``in_proj_qkv`` and z, b, a apart; its M-RoPE table is an ordinary one for text
QWEN3_5 = Family(
    "Qwen3.5",
    ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
    norm_eps="eps",
    norm_offset=1.0,
    moe=True,
    linear_attention="linear_attn",
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


def _part_rows(parts: tuple[str, ...], config) -> list[int]:
    """Rows of each part of a fused projection, from the model's config."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mlp = getattr(config, "intermediate_size", None)  # none in Qwen3.5-MoE: experts only
    linear = {"k": 0, "v": 0}  # the Gated DeltaNet's key and value widths
    if getattr(config, "linear_num_key_heads", None):
        linear["k"] = config.linear_num_key_heads * config.linear_key_head_dim
        linear["v"] = config.linear_num_value_heads * config.linear_value_head_dim
    rows = {
        "q_proj": config.num_attention_heads * d,
        "k_proj": config.num_key_value_heads * d,
        "v_proj": config.num_key_value_heads * d,
        "gate_proj": mlp,
        "up_proj": mlp,
        "in_proj_q": linear["k"],
        "in_proj_k": linear["k"],
        "in_proj_v": linear["v"],
    }
    return [rows[p] for p in parts]


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
