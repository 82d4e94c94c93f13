"""Token-local modules whose weights are replicated on every TSP rank.

Each rank applies them to its own tokens, so each rank's weight gradient covers only its tokens;
every use goes through ``comm.replicated`` so the gradient is summed over the TSP group inside
autograd (with any DP engine's hooks still seeing an ordinary parameter gradient). The small
ones (norm weights, biases) share one all-reduce per step (``bucketed_grads``). They take
over the Hugging Face modules' parameters as they are (same objects, same names), so tied
embeddings stay tied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.kernels.pointwise import rms_norm_keeping_input
from ..engine.parallel.comm import bucketed_replicated, replicated
from ..storage import gathered_per_use
from .lora import ADAPTER_MARK
from .sharding import Role, ShardedModule, param_roles


class TSPRMSNorm(nn.Module):
    """RMSNorm with a replicated weight: ``weight * normalize(x)`` (Llama family), or with an
    ``offset`` Gemma's ``normalize(x) * (offset + weight)`` in float32; autograd keeps only its
    input and one float32 per token (``rms_norm_keeping_input``)."""

    def __init__(self, weight: nn.Parameter, eps: float, group, offset: float = 0.0) -> None:
        super().__init__()
        self.weight, self.variance_epsilon, self.group = weight, eps, group
        self.offset = offset

    @classmethod
    def from_hf(cls, norm: nn.Module, group, eps: str = "variance_epsilon", offset: float = 0.0):
        """From a Hugging Face RMSNorm whose epsilon is its attribute ``eps``."""
        return cls(norm.weight, getattr(norm, eps), group, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = replicated(self.weight, self.group)
        return rms_norm_keeping_input(x, weight, self.variance_epsilon, self.offset)


class TSPEmbedding(nn.Module):
    """Token embedding with a replicated ``[V, h]`` table; ``ids [B, S/D] -> [B, S/D, h]``,
    times ``scale`` where the model scales its embeddings (Gemma)."""

    def __init__(
        self, weight: nn.Parameter, padding_idx: int | None, group, scale: float | None = None
    ) -> None:
        super().__init__()
        self.weight, self.padding_idx, self.group = weight, padding_idx, group
        self.scale = scale

    @classmethod
    def from_hf(cls, emb: nn.Embedding, group) -> TSPEmbedding:
        return cls(emb.weight, emb.padding_idx, group, embedding_scale(emb))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, replicated(self.weight, self.group), self.padding_idx)
        return scaled(x, self.scale)


def embedding_scale(emb: nn.Module) -> float | None:
    """The factor a Hugging Face embedding module multiplies its output by (Gemma's
    ``embed_scale`` buffer, sqrt(h) rounded to float32), or None."""
    scale = getattr(emb, "embed_scale", None)
    return None if scale is None else float(scale)


def scaled(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``x * scale`` with the factor in x's dtype, as Hugging Face applies it (None: ``x``)."""
    return x if scale is None else x * torch.tensor(scale, dtype=x.dtype, device=x.device)


class TSPLMHead(nn.Module):
    """Output projection with a replicated ``[V, h]`` weight; logits for the local tokens."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group) -> None:
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    @classmethod
    def from_hf(cls, head: nn.Linear, group) -> TSPLMHead:
        return cls(head.weight, head.bias, group)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else replicated(self.bias, self.group)
        return F.linear(h, replicated(self.weight, self.group), bias)


def replicated_vectors(model: nn.Module) -> tuple[str, ...]:
    """Names of a TSP model's small replicated parameters, used once per step: 1-D ones (norm
    weights, o_proj biases), the LoRA adapters' replicated pieces (``[r, h]`` / ``[h, r]``) and
    the MoE routers' and shared-expert gates' weights (``[E, h]`` / ``[1, h]``) and the Gated
    DeltaNet layers' depthwise conv weights (``[C, 1, K]``)."""
    roles = param_roles(model)
    small = {
        id(p) for m in model.modules() if isinstance(m, ShardedModule) for p in m.small_replicated()
    }
    return tuple(
        n
        for n, p in model.named_parameters()
        if (p.dim() == 1 or ADAPTER_MARK in n or id(p) in small) and roles[n] is Role.REPLICATED
    )


def bucketed_grads(model: nn.Module):
    """Context of one training forward: the replicated vectors' gradients are summed over the TSP
    group by one all-reduce at the end of backward instead of one per use. Parameters a DP engine
    gathers per layer (FSDP2 DTensors, ZeRO-3) keep their per-use all-reduce."""
    named = dict(model.named_parameters())  # an adapter merged away (merge_and_unload) is gone
    params = [named[n] for n in model.tsp.bucketed if n in named]
    stays_put = [p for p in params if not gathered_per_use(p)]
    return bucketed_replicated([p for p in stays_put if p.requires_grad], model.tsp.group)
