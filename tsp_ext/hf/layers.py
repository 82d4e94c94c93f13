"""A decoder layer's mixers by kind: which TSP module replaces each kind a family's spec names
(``hf.families``: ``TokenMixer`` / ``ChannelMixer``), and the check that a layer's modules are
ones it folds exactly.

A new kind of mixer is its schedule in ``engine``, its TSP module (a ``ShardedModule`` with
``from_hf``) and one entry here: ``TOKEN_MIXERS`` or ``CHANNEL_MIXERS``, with its check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .attention import TSPAttention
from .families import FAMILIES
from .linear_attention import TSPGatedDeltaNet, check_linear_attention
from .mlp import TSPGatedMLP
from .moe import TSPSparseMoe, check_moe_block
from .sharding import ShardedModule
from .spec import Family, TokenMixer, part_rows


@dataclass(frozen=True)
class MixerKind:
    """The TSP module of one kind of mixer, and its check of a Hugging Face module of that kind
    (``check(model_name, layer_index, module, family)`` raises ``ValueError`` naming what TSP
    does not fold)."""

    tsp_class: type[ShardedModule]
    check: Callable[[str, int, nn.Module | None, Family], None]


def _check_attention(name: str, i: int, attn: nn.Module | None, f: Family) -> None:
    if attn is None or not f.has_projections(attn, f.attention_projections):
        raise ValueError(
            f"{name} layer {i}: attention without {'/'.join(f.attention_projections)} is "
            "not supported"
        )
    window = f.sliding_window(attn)
    if window is not None and window < 2:
        raise ValueError(
            f"{name} layer {i}: sliding_window={window}; TSP supports windows of 2 or more "
            "tokens (or None for full causal attention)"
        )


def _check_gated_mlp(name: str, i: int, mlp: nn.Module | None, f: Family) -> None:
    if mlp is None or not f.has_projections(mlp, f.mlp_projections):
        kind = "mixture-of-experts" if hasattr(mlp, "experts") else "non-gated"
        raise ValueError(
            f"{name} layer {i}: {kind} MLPs are not supported (need {'/'.join(f.mlp_projections)})"
        )


TOKEN_MIXERS: dict[str, MixerKind] = {
    "attention": MixerKind(TSPAttention, _check_attention),
    "gated_delta_net": MixerKind(
        TSPGatedDeltaNet, lambda name, i, module, f: check_linear_attention(name, i, module)
    ),
}
CHANNEL_MIXERS: dict[str, MixerKind] = {
    "gated_mlp": MixerKind(TSPGatedMLP, _check_gated_mlp),
    "moe": MixerKind(TSPSparseMoe, check_moe_block),
}


def check_layer(name: str, i: int, layer: nn.Module, f: Family) -> None:
    """Raise ``ValueError`` unless decoder layer ``i`` of model class ``name`` holds mixers of
    its family's kinds that TSP folds (a token mixer of another family's kind is named)."""
    token = f.token_mixer(layer)
    if not hasattr(layer, token.module):
        other = _other_token_mixer(layer, f)
        if other is not None:
            TOKEN_MIXERS[other.kind].check(name, i, getattr(layer, other.module), f)
            owners = ", ".join(c for g in FAMILIES if other in g.token_mixers for c in g.classes)
            layers = other.layer_types[0].replace("_", "-")  # "linear-attention"
            raise ValueError(f"{name} layer {i}: {layers} layers are supported in {owners} only")
    TOKEN_MIXERS[token.kind].check(name, i, getattr(layer, token.module, None), f)
    mlp = getattr(layer, f.mlp, None)
    if mlp is not None and hasattr(mlp, "experts") and f.moe is None:
        check_moe_block(name, i, mlp, f)  # names the MoE families
    CHANNEL_MIXERS[f.channel_mixer(layer).kind].check(name, i, mlp, f)


def _other_token_mixer(layer: nn.Module, f: Family) -> TokenMixer | None:
    """A token mixer of another family's kind that ``layer`` holds instead of ``f``'s."""
    kinds = {m for g in FAMILIES for m in g.token_mixers} - set(f.token_mixers)
    return next((m for m in kinds if hasattr(layer, m.module)), None)


def layer_types(f: Family) -> set[str]:
    """The config ``layer_types`` the family's token mixers run."""
    return {t for m in f.token_mixers for t in m.layer_types}


def unfuse(f: Family, layer: nn.Module, config) -> None:
    """Replace a layer's fused projections by their parts (``nn.Linear`` views of its rows),
    as TSP's modules take them (``config``: the model's text config, the parts' rows)."""
    for module in (getattr(layer, f.mixer(layer)), getattr(layer, f.mlp)):
        for fused, parts in f.fused:
            linear = getattr(module, fused, None)
            if linear is None:
                continue
            if linear.bias is not None:
                raise ValueError(f"a fused {fused} with a bias is not supported")
            rows = part_rows(parts, config)
            for part, w in zip(parts, linear.weight.split(rows)):
                piece = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                piece.weight = nn.Parameter(w, requires_grad=linear.weight.requires_grad)
                setattr(module, part, piece)
            delattr(module, fused)
