"""The vocabulary of a model family's spec (``hf.families`` holds the entries): torch-free.

A ``Family`` names the attributes of the model (base model, layers, embedding, final norm,
rotary embedding, LM head) and of each decoder layer: its token mixers (``TokenMixer``: softmax
attention, or a hybrid's Gated DeltaNet on its linear-attention layers) and channel mixers
(``ChannelMixer``: a gated MLP, or a mixture of experts of a given expert form), each a *kind*
that one TSP module replaces (``hf.layers``), picked per layer by the module the layer holds; the
norms before and after them, the kind of its RMSNorms (``weight`` or ``1 + weight``, their
epsilon attribute), the config key of its gate activation, its fused projections and how they
split, whether it has one rotary table per layer type, and its ``model_type`` s with the facts
their configs do not state (``ModelType``). An embedding's scale, a layer's sliding window and
the q/k norms' width are read from the modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class TokenMixer:
    """A kind of token mixer a decoder layer may hold: the TSP module that replaces it
    (``kind``: a key of ``hf.layers.TOKEN_MIXERS``), its attribute on the layer, its projections
    (Hugging Face ``nn.Linear`` names: LoRA / QLoRA targets) and the config ``layer_types`` it
    runs."""

    kind: str
    module: str
    projections: tuple[str, ...] = ()
    layer_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChannelMixer:
    """A kind of channel mixer (``kind``: a key of ``hf.layers.CHANNEL_MIXERS``) at a decoder
    layer's ``module``: a gated MLP (``projections``), or a mixture-of-experts block: a router
    (``router``), the experts (``experts``) in ``expert_form`` ``"stacked"`` (``gate_up_proj
    [E, 2F, h]``, ``down_proj [E, h, F]``) or ``"clamped"`` (gpt-oss's biased experts, gate and
    up interleaved, clamped SwiGLU), routing weights in float32 (``router_float32``: Mixtral)
    or in the router logits' dtype (Qwen), and a gated shared expert of ``projections`` where the
    block has one (Qwen2-MoE)."""

    kind: str
    module: str = "mlp"
    projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    router: str = "gate"
    experts: str = "experts"
    expert_form: str = "stacked"
    router_float32: bool = False

    def holds(self, module: Any) -> bool:
        """Whether a layer's channel-mixer module is of this kind (a MoE block has experts)."""
        return hasattr(module, self.experts) == (self.kind == "moe")


@dataclass(frozen=True)
class ModelType:
    """The facts of one ``model_type`` that its config's keys do not state."""

    name: str
    qkv_bias: bool = False  # q/k/v projections with a bias whatever ``attention_bias`` says
    qk_norm: bool = False  # an RMSNorm over each head's q and k (Qwen3's)


@dataclass(frozen=True)
class VisionSpec:
    """Where a vision-language model keeps its vision side and how it encodes (``hf.vision``)."""

    inner: str = "model"  # the module holding the vision modules and the language model
    modules: tuple[str, ...] = ("visual",)  # on ``inner``: every vision parameter (tower, merger)
    grids: bool = True  # Qwen-VL: flattened patches described by image_grid_thw / video_grid_thw
    mrope: bool = True  # 3-D positions (``get_rope_index``)
    videos: bool = True
    deepstack: bool = False  # features added after the first decoder layers (Qwen3-VL)


SOFTMAX_ATTENTION = TokenMixer(
    "attention",
    "self_attn",
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("full_attention", "sliding_attention"),
)
# Qwen3-Next's and Qwen3.5's Gated DeltaNet (``hf.linear_attention`` knows its weights' names)
GATED_DELTA_NET = TokenMixer("gated_delta_net", "linear_attn", layer_types=("linear_attention",))
GATED_MLP = ChannelMixer("gated_mlp")
MOE = ChannelMixer("moe")


@dataclass(frozen=True)
class Family:
    """One family's spec (defaults: the Llama layout)."""

    name: str
    classes: tuple[str, ...]  # the ``*ForCausalLM`` classes checked against TSP
    model_types: tuple[ModelType, ...] = ()  # the config ``model_type`` s of those classes
    base: str = "model"  # the decoder stack's module (its path) on the causal LM
    layers: str = "layers"
    embedding: str = "embed_tokens"
    final_norm: str = "norm"
    rotary: str = "rotary_emb"
    lm_head: str = "lm_head"  # on the causal LM
    # per decoder layer, the first kind whose module it holds (hybrids: several)
    token_mixers: tuple[TokenMixer, ...] = (SOFTMAX_ATTENTION,)
    channel_mixers: tuple[ChannelMixer, ...] = (GATED_MLP,)
    partial_rotary: bool = False  # its attention rotates part of each head (partial_rotary_factor)
    attention_norm: str | None = "input_layernorm"  # the pre-norm of the token mixer
    mlp_norm: str | None = "post_attention_layernorm"  # the pre-norm of the channel mixer
    attention_post_norm: str | None = None  # norms of the mixers' outputs (Gemma-3)
    mlp_post_norm: str | None = None
    norm_eps: str = "variance_epsilon"  # the RMSNorms' epsilon attribute
    norm_offset: float = 0.0  # RMSNorm as x̂·(offset + w), in float32: Gemma's (1 + w)
    activation: str = "hidden_act"  # the config's name of the gate's activation
    rope_per_layer_type: bool = False  # rotary(x, pos, layer_type): one table per layer type
    # Hugging Face projections stacking several of TSP's by rows, ``(fused, parts)`` (Phi-3's
    # ``qkv_proj``, ``gate_up_proj``; Qwen3.5's Gated DeltaNet ``in_proj_qkv``): split when TSP
    # is applied (``hf.layers.unfuse``), stacked again in every Hugging Face-facing tensor
    # (``hf_tensors``, export, shard-on-read loading)
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    vision: VisionSpec | None = None  # a vision-language model's vision side (``hf.vision``)
    # config keys of scalars outside the mixers (Granite's; None: 1): the embedding's output is
    # multiplied by the first, each mixer's output by the second before the residual add, and
    # the logits are divided by the third
    embedding_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None

    @property
    def attention(self) -> str:
        """The layers' softmax-attention module."""
        return SOFTMAX_ATTENTION.module

    @property
    def attention_projections(self) -> tuple[str, ...]:
        return SOFTMAX_ATTENTION.projections

    @property
    def mlp(self) -> str:
        """The layers' channel-mixer module (one name for every kind of a family)."""
        return self.channel_mixers[0].module

    @property
    def mlp_projections(self) -> tuple[str, ...]:
        return GATED_MLP.projections

    @property
    def moe(self) -> ChannelMixer | None:
        """The family's mixture-of-experts kind, if its layers may hold one."""
        return next((c for c in self.channel_mixers if c.kind == "moe"), None)

    @property
    def hybrid(self) -> bool:
        """Whether its layers mix tokens with more than one kind (Qwen3-Next)."""
        return len(self.token_mixers) > 1

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """Every RMSNorm of a decoder layer."""
        names = (self.attention_norm, self.mlp_norm, self.attention_post_norm, self.mlp_post_norm)
        return tuple(n for n in names if n is not None)

    def scalar(self, config: Any, key: str | None) -> float:
        """The value of one of the family's scalars (its config key ``key``) in ``config``: 1.0
        where the family has none."""
        return 1.0 if key is None else float(config_value(config.get_text_config(), key))

    def base_of(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.base)

    def layers_of(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self.base_of(model), self.layers)

    def token_mixer(self, layer: nn.Module) -> TokenMixer:
        """The kind of a layer's token mixer: the first whose module the layer holds (else the
        first, whose absence the checks report)."""
        held = (m for m in self.token_mixers if hasattr(layer, m.module))
        return next(held, self.token_mixers[0])

    def mixer(self, layer: nn.Module) -> str:
        """The name of a layer's token-mixer module."""
        return self.token_mixer(layer).module

    def channel_mixer(self, layer: nn.Module) -> ChannelMixer:
        """The kind of a layer's channel mixer (Qwen3-MoE's ``mlp_only_layers`` keep a gated
        MLP in a MoE family); the first if none matches."""
        module = getattr(layer, self.mlp, None)
        return next((c for c in self.channel_mixers if c.holds(module)), self.channel_mixers[0])

    def projection_blocks(self, layer: nn.Module) -> tuple[tuple[nn.Module, tuple[str, ...]], ...]:
        """``(module, its projection names)`` of a layer's mixers that are made of projections:
        its softmax attention and its gated MLP (not a MoE block's experts, nor a Gated
        DeltaNet)."""
        blocks = []
        for kind in (self.token_mixer(layer), self.channel_mixer(layer)):
            if kind.projections and kind.kind != "moe":
                blocks.append((getattr(layer, kind.module), kind.projections))
        return tuple(blocks)

    def is_moe(self, mlp: nn.Module) -> bool:
        """Whether a layer's MLP module is a mixture-of-experts block."""
        return self.moe is not None and self.moe.holds(mlp)

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
        return hf_name, sum(part_rows(parts, config)[:i])

    def has_projections(self, module: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether ``module`` has the projections ``names``, each itself or in a fused one."""
        fused = {p for f, parts in self.fused if hasattr(module, f) for p in parts}
        return all(hasattr(module, n) or n in fused for n in names)

    def sliding_window(self, attention: nn.Module) -> int | None:
        """Window of a layer's attention module (query i sees keys ``(i - window, i]``) or None:
        its own ``sliding_window`` where it has one (Qwen2 / Qwen3 set it per layer from
        ``attention.config.layer_types``; Qwen2-MoE on its windowed layers only), else its
        config's (Mistral, Mixtral: every layer) unless the config has per-layer types."""
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
        residual: float = 1.0,
    ) -> torch.Tensor:
        """One decoder layer on ``x`` with the given calls of its attention and MLP modules:
        attention, then MLP, each through its pre-norm and post-norm where the family has them,
        times ``residual`` (the ``residual_multiplier``), added to the residual stream."""
        for module, pre, post, call in (
            (self.mixer(layer), self.attention_norm, self.attention_post_norm, attention),
            (self.mlp, self.mlp_norm, self.mlp_post_norm, mlp),
        ):
            out = call(getattr(layer, module), x if pre is None else getattr(layer, pre)(x))
            out = out[0] if isinstance(out, tuple) else out  # gpt-oss's MLP: (out, scores)
            out = out if post is None else getattr(layer, post)(out)
            x = x + (out if residual == 1.0 else out * residual)
        return x


def part_rows(parts: tuple[str, ...], config) -> list[int]:
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


def config_value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
