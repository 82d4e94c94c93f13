"""Where a Hugging Face decoder-only causal LM keeps the parts TSP replaces: one description per
family, read by ``apply_tsp``, inference, FSDP2 and loading alike.

A ``Family`` names the attributes of the model (base model, layers, embedding, final norm,
rotary embedding, LM head) and of each decoder layer (attention and its projections, MLP and its
projections, the norms before attention and MLP), and runs a decoder layer's residual structure
(``layer_forward``), and the kind of its RMSNorms (``weight`` or ``1 + weight``, their epsilon
attribute). A family with this layer structure under other names, or with Gemma's norms, is one
entry in ``FAMILIES`` (and its parity tests, ``tests/models.py``); the TSP modules themselves still
read Llama's projection names, and an embedding's scale and the gate's activation are read from
the module and config. ``family_of`` takes a model whose class is not listed but whose parts are
where the Llama description says as that structure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    """Attribute names of one family's causal LM (defaults: the Llama layout)."""

    name: str
    classes: tuple[str, ...]  # the ``*ForCausalLM`` classes checked against TSP
    base: str = "model"  # the decoder stack's module on the causal LM
    layers: str = "layers"
    embedding: str = "embed_tokens"
    final_norm: str = "norm"
    rotary: str = "rotary_emb"
    lm_head: str = "lm_head"  # on the causal LM
    attention: str = "self_attn"  # on a decoder layer
    attention_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp: str = "mlp"
    mlp_projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    attention_norm: str = "input_layernorm"  # the pre-norm of the attention
    mlp_norm: str = "post_attention_layernorm"  # the pre-norm of the MLP
    norm_eps: str = "variance_epsilon"  # the RMSNorms' epsilon attribute
    norm_offset: float = 0.0  # RMSNorm as x̂·(offset + w), in float32: Gemma's (1 + w)

    def base_of(self, model: nn.Module) -> nn.Module:
        return getattr(model, self.base)

    def layers_of(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self.base_of(model), self.layers)

    def projection_blocks(self, layer: nn.Module) -> tuple[tuple[nn.Module, tuple[str, ...]], ...]:
        """``(attention, its projection names), (MLP, its projection names)`` of a layer."""
        return (
            (getattr(layer, self.attention), self.attention_projections),
            (getattr(layer, self.mlp), self.mlp_projections),
        )

    def sliding_window(self, attention: nn.Module) -> int | None:
        """Window of a layer's attention module (query i sees keys ``(i - window, i]``) or None:
        its own ``sliding_window`` where it has one (Qwen2 / Qwen3 set it per layer from
        ``config.layer_types``), else its config's (Mistral: every layer)."""
        if hasattr(attention, "sliding_window"):
            return attention.sliding_window
        return getattr(attention.config, "sliding_window", None)

    def layer_forward(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        attention: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        mlp: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One decoder layer on ``x`` with the given calls of its attention and MLP modules:
        pre-norm attention, then pre-norm MLP, each added to the residual stream."""
        x = x + attention(getattr(layer, self.attention), getattr(layer, self.attention_norm)(x))
        return x + mlp(getattr(layer, self.mlp), getattr(layer, self.mlp_norm)(x))


LLAMA = Family(
    "Llama",
    ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
)
# Llama's layout with (1 + w) RMSNorms (eps ``eps``), a scaled embedding (its module's
# ``embed_scale``, read by the TSP embeddings) and GELU-tanh (the config's ``hidden_act``)
GEMMA = Family("Gemma", ("GemmaForCausalLM",), norm_eps="eps", norm_offset=1.0)
FAMILIES = (LLAMA, GEMMA)

# Hugging Face ``hidden_act`` -> the engine's gate activation (``pointwise.GATE_ACTIVATIONS``)
GATE_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
}


def gate_activation(config) -> str:
    """The engine's name of a model's gated-MLP activation; ``ValueError`` if unsupported."""
    act = getattr(config, "hidden_act", "silu")
    if act not in GATE_ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r}: TSP's gated MLP supports {sorted(GATE_ACTIVATIONS)}")
    return GATE_ACTIVATIONS[act]


def supported_names() -> str:
    return ", ".join(c for f in FAMILIES for c in f.classes)


def family_of(model: nn.Module) -> Family:
    """The family of ``model`` (a Hugging Face causal LM, not a PEFT wrapper): its class's, else
    the first whose layout its modules follow; raises ``ValueError`` naming the layout expected."""
    name = type(model).__name__
    candidates = [f for f in FAMILIES if name in f.classes] or list(FAMILIES)
    for family in candidates:
        base = getattr(model, family.base, None)
        if hasattr(base, family.layers) and hasattr(model, family.lm_head):
            return family
    f = candidates[0]
    raise ValueError(
        f"{name} is not a Hugging Face decoder-only causal LM (expected .{f.base}.{f.layers} and "
        f".{f.lm_head}); supported: {supported_names()} and models of the same structure"
    )
