"""TSP gated MLP (SwiGLU): weight shards travel a ring while each rank keeps its tokens.

Rank p holds slice p of the intermediate dimension (rows of gate/up, columns of down) and the
tokens of zigzag shard p. Forward:

    cur = (G_p, U_p, Dn_p); Y_p = 0
    for t in 0..D-1:                       # cur is the shard of owner p - t
        if t < D-1: send cur -> p+1, recv next <- p-1      # async, overlaps the matmuls
        Y_p += (silu(X_p·Gᵀ) ⊙ (X_p·Uᵀ))·Dnᵀ
        wait; cur = next

Backward runs the same weight ring plus a second ring of gradient accumulators one step behind:
at step t >= 1 rank p adds its tokens' contribution to shard p - t's accumulator and passes it
on, so after the last hop every accumulator lands at its owner with all D contributions (the
owner adds its own, computed at t = 0). dX_p accumulates locally. Saved per rank: X_p and the
rank's own shards; the intermediate activations are recomputed shard by shard in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .config import TSPConfig
from .shard_ring import GradientRing, circulate


def _swiglu_backward(x, dy, g, u, dn, acc: torch.dtype, hidden=None):
    """Gradients of ``_swiglu`` for one shard: ``(dX, dG, dU, dDn)``, weight grads in ``acc``.

    ``hidden``: the saved gate/up pre-activations ``[2, B, T, F/D]``; recomputed if None.
    """
    hg, hu = hidden if hidden is not None else (F.linear(x, g), F.linear(x, u))  # [B, T, F/D]
    sig = torch.sigmoid(hg)
    act = hg * sig
    dm = dy @ dn  # [B, T, F/D]
    dhu = dm * act
    dhg = dm * hu * sig * (1 + hg * (1 - sig))
    x2, dy2 = x.flatten(0, 1).to(acc), dy.flatten(0, 1).to(acc)
    d_dn = dy2.t() @ (act * hu).flatten(0, 1).to(acc)
    d_g = dhg.flatten(0, 1).to(acc).t() @ x2
    d_u = dhu.flatten(0, 1).to(acc).t() @ x2
    dx = dhg @ g + dhu @ u
    return dx, d_g, d_u, d_dn


class _RingSchedule:
    """Weight ring of one call: shard shapes, group, options."""

    def __init__(self, group, config: TSPConfig, x: torch.Tensor, weights) -> None:
        self.group, self.config = group, config
        self.ring = comm.Ring(group)
        self.D, self.p = self.ring.size, self.ring.rank
        self.shapes = [w.shape for w in weights]
        self.acc = config.accum_for(x.dtype)

    def shards(self, weights):
        """Yield ``(t, (G, U, Dn))`` of owner p - t; the next one arrives while the caller works."""
        packed = comm.pack(weights)  # a copy: it may serve as a receive buffer
        for t, cur in circulate(self.ring, packed, self.config.overlap, reuse=True):
            yield t, comm.unpack(cur, self.shapes)


def tsp_mlp_forward(sched: _RingSchedule, x: torch.Tensor, weights, keep_hidden: bool = False):
    """Forward ring: ``X_p [B, T, h]`` -> ``Y_p [B, T, h]``, plus, if ``keep_hidden``, every
    step's gate/up pre-activations ``[D, 2, B, T, F/D]`` (else None)."""
    y = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    hidden = None
    for t, (g, u, dn) in sched.shards(weights):
        hg, hu = F.linear(x, g), F.linear(x, u)
        if keep_hidden:
            if hidden is None:
                hidden = hg.new_empty(sched.D, 2, *hg.shape)
            hidden[t, 0], hidden[t, 1] = hg, hu
        y += F.linear(F.silu(hg) * hu, dn)
    return y.to(x.dtype), hidden


def tsp_mlp_backward(sched: _RingSchedule, dy: torch.Tensor, x: torch.Tensor, weights, hidden=None):
    """Backward rings: returns ``dX_p`` and the fully reduced gradients of this rank's shards.
    ``hidden``: what ``tsp_mlp_forward(keep_hidden=True)`` returned, or None to recompute."""
    dy = dy.contiguous()
    dx = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    owner_grads = GradientRing(sched.ring)
    for t, (g, u, dn) in sched.shards(weights):
        h_t = hidden[t] if hidden is not None else None
        dx_t, *dw = _swiglu_backward(x, dy, g, u, dn, sched.acc, h_t)
        dx += dx_t
        owner_grads.add(t, comm.pack(dw, sched.acc))
    grads = comm.unpack(owner_grads.result(), sched.shapes)
    return dx.to(x.dtype), [gr.to(w.dtype) for gr, w in zip(grads, weights)]


class _TSPMLPFunction(torch.autograd.Function):
    """Autograd boundary of the ring schedule: saves X_p and the rank's own shards (plus the
    gate/up pre-activations, ``[D, 2, B, S/D, F/D]``, when ``config.recompute_mlp`` is off)."""

    @staticmethod
    def forward(ctx, group, config, x, g, u, dn):
        sched = _RingSchedule(group, config, x, (g, u, dn))
        keep = not config.recompute_mlp and any(ctx.needs_input_grad)
        y, hidden = tsp_mlp_forward(sched, x, (g, u, dn), keep_hidden=keep)
        ctx.sched = sched
        ctx.save_for_backward(x, hidden, g, u, dn)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, hidden, *weights = ctx.saved_tensors
        dx, (d_g, d_u, d_dn) = tsp_mlp_backward(ctx.sched, dy, x, weights, hidden)
        return None, None, dx, d_g, d_u, d_dn


class TSPGatedMLP(nn.Module):
    """SwiGLU MLP on a TSP axis: ``down(silu(gate(x)) * up(x))`` with slice p of the
    intermediate dimension. Input and output ``[B, S/D, h]`` (this rank's tokens)."""

    shard_dims = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        group,
        config: TSPConfig | None = None,
        *,
        dtype=None,
        device=None,
    ) -> None:
        super().__init__()
        D, _ = comm.size_and_rank(group)
        if intermediate_size % D:
            raise ValueError(
                f"intermediate_size={intermediate_size} is not divisible by tsp_size={D}: choose a "
                "TSP size that divides the MLP width"
            )
        self.group, self.config = group, config or TSPConfig()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        f = intermediate_size // D
        kw = {"dtype": dtype, "device": device, "bias": False}
        self.gate_proj = nn.Linear(hidden_size, f, **kw)
        self.up_proj = nn.Linear(hidden_size, f, **kw)
        self.down_proj = nn.Linear(f, hidden_size, **kw)

    @classmethod
    def from_hf(cls, mlp: nn.Module, group, config: TSPConfig | None = None) -> TSPGatedMLP:
        """Build from a Hugging Face gated MLP (gate/up/down projections, SiLU, no biases)."""
        act = getattr(mlp.config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"TSP gated MLP supports SiLU (SwiGLU) only, the model uses {act!r}")
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError("TSP gated MLP does not support MLP biases (mlp_bias=True)")
        w = mlp.gate_proj.weight
        h, F_ = w.shape[1], w.shape[0]
        mod = cls(h, F_, group, config, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            for name, param in mod.named_parameters():
                param.copy_(mod.local_slice(name, mlp.get_parameter(name)))
        return mod

    def local_index(self, name: str) -> tuple[slice, ...]:
        """Index of this rank's slice in the full (Hugging Face) tensor behind ``name``."""
        D, p = comm.size_and_rank(self.group)
        f = self.intermediate_size // D
        rows = slice(p * f, (p + 1) * f)
        return (slice(None), rows) if self.shard_dims[name] == 1 else (rows,)

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full (Hugging Face) tensor behind parameter ``name``."""
        return full[self.local_index(name)]

    def assemble(self, name: str, shards: torch.Tensor) -> torch.Tensor:
        """Full Hugging Face tensor from every rank's shard of ``name``, ``shards [D, ...]``."""
        return torch.cat(list(shards), dim=self.shard_dims[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [B, S/D, {self.hidden_size}], got {tuple(x.shape)}")
        return _TSPMLPFunction.apply(
            self.group,
            self.config,
            x,
            self.gate_proj.weight,
            self.up_proj.weight,
            self.down_proj.weight,
        )
