"""Where a Hugging Face decoder-only causal LM keeps the parts TSP replaces: one description per
family, read by ``apply_tsp``, inference, FSDP2 and loading alike.

A ``Family`` names the attributes of the model (base model, layers, embedding, final norm,
rotary embedding, LM head) and of each decoder layer (attention and its projections, MLP and its
projections, the norms before attention and MLP), and runs a decoder layer's residual structure
(``layer_forward``). A family with this layer structure under other model-level names is one
entry in ``FAMILIES`` (and its parity tests, ``tests/models.py``); the TSP modules themselves still
read Llama's projection names. ``family_of`` takes a model whose class is not listed but whose
parts are where the Llama description says as that structure.
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
FAMILIES = (LLAMA,)


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
