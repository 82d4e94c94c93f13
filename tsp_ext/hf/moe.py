"""``TSPSparseMoe``: a Hugging Face mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral,
gpt-oss) with E/D whole experts per rank, and the global load-balancing loss.

The schedules (experts on a ring, or tokens by all-to-all) are ``tsp_ext.engine.feed_forward.moe``.
The router ``[E, h]`` is replicated (its gradient summed over the TSP group) and routes each rank's
own tokens as Hugging Face's does (gpt-oss's router has a bias, replicated the same way, and
takes the top k of the logits, then their softmax); Qwen2-MoE's shared expert is a
``TSPGatedMLP`` (its own ring) behind its replicated sigmoid gate.
``collect_router_logits`` gathers every MoE layer's logits during a call, from which
``load_balancing_loss`` gives Hugging Face's auxiliary loss over the whole TSP group's tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from ..config import TSPConfig
from ..engine.feed_forward.moe import ExpertsSpec, decode_experts, router_logits, tsp_experts
from ..engine.feed_forward.moe_clamped import ClampedSwiGLU
from ..engine.parallel import comm
from ..engine.sharding.partition import check_split, split_range, split_sizes
from .families import FAMILIES, expert_intermediate_size, gate_activation
from .mlp import TSPGatedMLP
from .sharding import ShardedModule
from .spec import Family

_collected: list[torch.Tensor] | None = None


class TSPExperts(ShardedModule):
    """This rank's E_p whole experts, ``gate_up_proj [E_p, 2F, h]`` and ``down_proj [E_p, h,
    F]`` as Hugging Face stores them (experts ``split_range(E, D, p)``: ``⌊E/D⌋`` or ``⌈E/D⌉``,
    the first ``E mod D`` ranks one more); with ``activation`` a ``ClampedSwiGLU``, gpt-oss's
    ``gate_up_proj [E_p, h, 2F]`` (gate/up interleaved), ``gate_up_proj_bias [E_p, 2F]``,
    ``down_proj [E_p, F, h]`` and ``down_proj_bias [E_p, h]``. ``schedule``: how tokens and
    experts meet (``engine.feed_forward.moe``: ``"ring"``, ``"all_to_all"`` or ``"auto"``)."""

    shard_dims = {"gate_up_proj": 0, "down_proj": 0, "gate_up_proj_bias": 0, "down_proj_bias": 0}

    def __init__(
        self,
        n_experts: int,
        hidden_size: int,
        intermediate_size: int,
        group,
        config: TSPConfig | None = None,
        *,
        activation: str | ClampedSwiGLU = "silu",
        dtype=None,
        device=None,
    ) -> None:
        super().__init__()
        D, p = comm.size_and_rank(group)
        check_split(n_experts, D, "the number of experts", "use a smaller TSP size")
        config = config or TSPConfig()
        self.group, self.options = group, config.engine_options()
        self.schedule = config.moe_schedule
        self.activation = activation
        self.n_experts, self.hidden_size = n_experts, hidden_size
        self.intermediate_size = intermediate_size
        E, F_, kw = (
            split_sizes(n_experts, D)[p],
            intermediate_size,
            {"dtype": dtype, "device": device},
        )
        if isinstance(activation, ClampedSwiGLU):
            self.gate_up_proj = nn.Parameter(torch.empty(E, hidden_size, 2 * F_, **kw))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * F_, **kw))
            self.down_proj = nn.Parameter(torch.empty(E, F_, hidden_size, **kw))
            self.down_proj_bias = nn.Parameter(torch.empty(E, hidden_size, **kw))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, hidden_size, **kw))
            self.down_proj = nn.Parameter(torch.empty(E, hidden_size, F_, **kw))

    @classmethod
    def from_hf(cls, experts: nn.Module, group, config: TSPConfig | None, activation):
        """This rank's experts of a Hugging Face experts module (``gate_up_proj [E, 2F, h]``,
        ``down_proj [E, h, F]``; gpt-oss's four with a ``ClampedSwiGLU`` ``activation``)."""
        gate_up = experts.gate_up_proj
        E, F2, h = gate_up.shape
        if isinstance(activation, ClampedSwiGLU):
            E, h, F2 = gate_up.shape
        kw = {"activation": activation, "dtype": gate_up.dtype, "device": gate_up.device}
        mod = cls(E, h, F2 // 2, group, config, **kw)
        with torch.no_grad():
            for name, param in mod.named_parameters():
                param.copy_(mod.local_slice(name, getattr(experts, name)))
                param.requires_grad_(gate_up.requires_grad)
        return mod

    def index_of(self, name: str, rank: int) -> tuple[slice, ...]:
        return (split_range(self.n_experts, dist.get_world_size(self.group), rank),)

    def weights(self) -> tuple[nn.Parameter, ...]:
        """The experts' weights in the engine's order (``engine.feed_forward.moe.tsp_experts``'s
        ``ws``)."""
        if isinstance(self.activation, ClampedSwiGLU):
            return self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias
        return self.gate_up_proj, self.down_proj

    def spec(self) -> ExpertsSpec:
        """The MoE schedules' description of this layer."""
        return ExpertsSpec(
            self.group,
            self.options,
            self.n_experts,
            activation=self.activation,
            schedule=self.schedule,
        )

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x [B, S/D, h]`` with each token's experts ``index`` and weights ``weight [B·S/D,
        k]`` -> ``[B, S/D, h]``."""
        return tsp_experts(x, index, weight, ws=self.weights(), spec=self.spec())

    @torch.no_grad()
    def decode(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return decode_experts(x, index, weight, ws=self.weights(), spec=self.spec())


@dataclass(frozen=True)
class TopK:
    """How a router picks and weighs each token's experts: the top ``k`` of the softmax,
    renormalized over the k if ``normalize``, the weights in float32 if ``float32_weights``
    (else the logits' dtype); ``logits_first``: gpt-oss's routing instead, the softmax of the
    top k logits."""

    k: int
    normalize: bool
    float32_weights: bool
    logits_first: bool = False


class TSPSparseMoe(nn.Module):
    """A sparse MoE block on a TSP axis: ``[B, S/D, h]`` -> ``[B, S/D, h]``, each token the
    weighted sum of its top-k experts (plus, in Qwen2-MoE, the gated shared expert). ``gate``:
    the replicated router (Hugging Face's module, ``weight [E, h]``, gpt-oss's ``bias [E]``),
    ``experts``: a ``TSPExperts``; ``top_k``: the routing."""

    def __init__(
        self,
        gate: nn.Module,
        experts: TSPExperts,
        group,
        *,
        top_k: TopK,
        shared_expert: TSPGatedMLP | None = None,
        shared_expert_gate: nn.Module | None = None,
        router_name: str = "gate",
    ) -> None:
        super().__init__()
        self.router_name = router_name  # the router keeps its Hugging Face name (gpt-oss: router)
        self.add_module(router_name, gate)
        self.experts, self.group, self.top_k = experts, group, top_k
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    @classmethod
    def from_hf(
        cls, block: nn.Module, group, config: TSPConfig | None, family: Family
    ) -> TSPSparseMoe:
        """Build from a Hugging Face MoE block of ``family`` (checked by ``check_moe_block``)."""
        kind = family.moe
        router, experts = getattr(block, kind.router), getattr(block, kind.experts)
        clamped = kind.expert_form == "clamped"
        if clamped:
            activation = ClampedSwiGLU(experts.alpha, experts.limit)
        else:
            activation = gate_activation(experts.config, family.activation)
        shared = getattr(block, "shared_expert", None)
        if shared is not None:
            shared = TSPGatedMLP.from_hf(shared, group, config, family)
        return cls(
            router,
            TSPExperts.from_hf(experts, group, config, activation),
            group,
            top_k=TopK(
                router.top_k,
                normalize=getattr(router, "norm_topk_prob", True),
                float32_weights=kind.router_float32,
                logits_first=clamped,
            ),
            shared_expert=shared,
            shared_expert_gate=getattr(block, "shared_expert_gate", None),
            router_name=kind.router,
        )

    def router_module(self) -> nn.Module:
        """The router (Hugging Face's module, under its Hugging Face name)."""
        return getattr(self, self.router_name)

    def routers(self) -> list[nn.Parameter]:
        """The replicated weights that pick and weigh experts: the router's (and gpt-oss's
        router bias) and, in Qwen2-MoE, the shared expert's gate."""
        gates = [g for g in (self.router_module(), self.shared_expert_gate) if g is not None]
        return [g.weight for g in gates] + [g.bias for g in gates if _bias(g) is not None]

    def small_replicated(self) -> list[nn.Parameter]:
        return self.routers()

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hugging Face's top-k routing of ``logits [n, E]``: the weights ``[n, k]`` (softmax in
        float32, renormalized over the k if the model does; float32 or the logits' dtype) and
        the experts' indices ``[n, k]``. gpt-oss (``top_k.logits_first``): the softmax of the top
        k logits, in their dtype."""
        rule = self.top_k
        if rule.logits_first:
            top, index = torch.topk(logits, rule.k, dim=-1)
            return F.softmax(top, dim=-1, dtype=top.dtype), index
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, rule.k, dim=-1)
        if rule.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top if rule.float32_weights else top.to(logits.dtype)), index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = _bias(self.router_module())
        bias = None if bias is None else comm.replicated(bias, self.group)
        logits = router_logits(x, comm.replicated(self.router_module().weight, self.group), bias)
        if _collected is not None:
            _collected.append(logits)
        weight, index = self.route(logits)
        y = self.experts(x, index, weight)
        if self.shared_expert is not None:
            y = y + self._shared_gate(x) * self.shared_expert(x)
        # gpt-oss's decoder layer unpacks (output, router scores), as its MLP returns them
        return (y, None) if self.top_k.logits_first else y

    def _shared_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE's ``sigmoid(x · w)`` ``[B, S/D, 1]`` (``w [1, h]`` replicated; x kept as
        its norm's input, as the router keeps it)."""
        w = comm.replicated(self.shared_expert_gate.weight, self.group)
        return torch.sigmoid(router_logits(x, w)).view(*x.shape[:-1], 1)

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Inference: the block on tokens ``x [B, Tq, h]`` that every rank holds (a decode
        step), each rank with its experts (and its slice of the shared expert); the same on
        every rank."""
        logits = F.linear(x.reshape(-1, x.shape[-1]), *_weight_and_bias(self.router_module()))
        weight, index = self.route(logits)
        y = self.experts.decode(x, index, weight)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * (
                self.shared_expert.decode(x)
            )
        return y


def _weight_and_bias(gate: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return gate.weight, _bias(gate)


def _bias(gate: nn.Module) -> torch.Tensor | None:
    """A router's bias (gpt-oss's), else None."""
    return getattr(gate, "bias", None)


@contextmanager
def collect_router_logits():
    """Within the block, every ``TSPSparseMoe`` call appends its router logits ``[n, E]``
    (differentiable) to the list this yields, in layer order."""
    global _collected
    previous, _collected = _collected, []
    try:
        yield _collected
    finally:
        _collected = previous


def load_balancing_loss(logits: list[torch.Tensor], n_experts: int, top_k: int, group):
    """Hugging Face's auxiliary load-balancing loss (Switch Transformer's) over every layer's
    router ``logits [n, E]`` of the whole TSP group's tokens: ``E · Σ_e f_e · P_e``, with
    ``f_e`` the share of top-k assignments to expert e and ``P_e`` its mean router
    probability, both over all layers and tokens. The per-expert sums are summed over the group
    (``P``'s differentiably), so every rank gets the single-process value and its tokens'
    gradient. In float32, as Hugging Face computes it; tokens are not masked (a TSP batch has no
    attention mask)."""
    device = logits[0].device
    counts = torch.zeros(n_experts + 1, dtype=torch.float32, device=device)  # + rows
    prob_sum = torch.zeros(n_experts, dtype=torch.float32, device=device)
    for layer in logits:
        probs = F.softmax(layer, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        counts[:n_experts] += torch.bincount(chosen.reshape(-1), minlength=n_experts)
        counts[n_experts] += probs.shape[0]
        prob_sum = prob_sum + probs.float().sum(dim=0)
    comm.all_reduce(counts, group)
    prob_sum = comm.sum_over_ranks(prob_sum, group)
    rows = counts[n_experts]
    return torch.sum(counts[:n_experts] / rows * (prob_sum / rows)) * n_experts


def n_experts_of(config) -> int:
    """The number of routed experts (Qwen-MoE's ``num_experts``, Mixtral's
    ``num_local_experts``)."""
    return getattr(config, "num_experts", None) or config.num_local_experts


def check_moe_block(name: str, i: int, block: nn.Module, family: Family) -> None:
    """Raise ``ValueError`` naming the model and what is supported unless layer ``i``'s MoE
    ``block`` is one TSP runs: a MoE kind of the family's spec, a top-k router over the config's
    experts, experts of the config's shapes without biases (the clamped form's: with theirs), no
    router jitter."""
    supported = ", ".join(c for f in FAMILIES if f.moe is not None for c in f.classes)
    if family.moe is None:
        raise ValueError(
            f"{name} layer {i}: its mixture-of-experts MLP is not supported; TSP runs the MoE "
            f"blocks of {supported}"
        )
    kind = family.moe
    router, experts = getattr(block, kind.router, None), getattr(block, kind.experts)
    clamped = kind.expert_form == "clamped"
    if clamped:
        E, h, F_ = experts.num_experts, experts.hidden_size, experts.intermediate_size
    else:
        cfg = experts.config
        E, h, F_ = n_experts_of(cfg), cfg.hidden_size, expert_intermediate_size(cfg)
    weight = getattr(router, "weight", None)
    if weight is None or tuple(weight.shape) != (E, h) or not hasattr(router, "top_k"):
        raise ValueError(
            f"{name} layer {i}: the router {type(router).__name__} is not a top-k router with a "
            f"weight [{E}, {h}]; TSP runs the top-k softmax routers of {supported}"
        )
    bias = _bias(router)
    if bias is not None and (not clamped or tuple(bias.shape) != (E,)):
        have = tuple(bias.shape)
        raise ValueError(
            f"{name} layer {i}: the router's bias is {have}; TSP takes a router bias [{E}] only "
            "with gpt-oss's experts"
        )
    if not 1 <= router.top_k <= E:
        raise ValueError(
            f"{name} layer {i}: num_experts_per_tok={router.top_k} must be between 1 and the "
            f"number of experts ({E})"
        )
    shapes = {"gate_up_proj": (E, 2 * F_, h), "down_proj": (E, h, F_)}
    if clamped:
        shapes = {
            "gate_up_proj": (E, h, 2 * F_),
            "gate_up_proj_bias": (E, 2 * F_),
            "down_proj": (E, F_, h),
            "down_proj_bias": (E, h),
        }
    for key, shape in shapes.items():
        got = getattr(experts, key, None)
        if got is None or tuple(got.shape) != shape:
            have = None if got is None else tuple(got.shape)
            raise ValueError(
                f"{name} layer {i}: experts.{key} is {have}, the config says {shape} (E = {E} "
                f"experts of intermediate size {F_}); TSP needs experts as the config describes"
            )
    if not clamped and any(hasattr(experts, f"{k}_bias") for k in shapes):
        raise ValueError(f"{name} layer {i}: expert biases are not supported under TSP")
    if getattr(block, "jitter_noise", 0):
        raise ValueError(
            f"{name}: router_jitter_noise={block.jitter_noise} is not supported under TSP; set "
            "router_jitter_noise=0"
        )


def with_aux_loss(model: nn.Module, out, logits: list[torch.Tensor], requested: bool | None):
    """``out`` (a model output) with Hugging Face's MoE outputs where ``output_router_logits``
    is on (``requested``, else the config's): ``aux_loss`` over the whole TSP group's tokens,
    added to ``loss`` times ``router_aux_loss_coef``, and the local ``router_logits``."""
    if requested is None:
        requested = getattr(model.config, "output_router_logits", False)
    if not requested or not logits:
        return out
    if not isinstance(out, ModelOutput):
        raise ValueError("output_router_logits needs return_dict=True on a TSP model")
    block = next(m for m in model.modules() if isinstance(m, TSPSparseMoe))
    aux = load_balancing_loss(logits, block.experts.n_experts, block.top_k.k, block.group)
    if out.get("loss") is not None:
        coef = getattr(model, "router_aux_loss_coef", model.config.router_aux_loss_coef)
        out["loss"] = out["loss"] + coef * aux.to(out["loss"].device)
    out["aux_loss"] = aux
    out["router_logits"] = tuple(logits)
    return out
