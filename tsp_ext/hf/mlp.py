"""``TSPGatedMLP``: the Hugging Face SwiGLU MLP replaced by its slice of the intermediate dim.

The ring schedule is ``tsp_ext.engine.feed_forward.mlp``; this module holds the slices under the
Hugging Face names and builds them from a Hugging Face module.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TSPConfig
from ..engine.decode import decode_mlp
from ..engine.feed_forward.mlp import MlpSpec, tsp_mlp
from ..engine.parallel import comm
from ..engine.sharding.partition import check_split, split_range, split_sizes
from .families import LLAMA, gate_activation
from .lora import adapters_of, plan_of
from .nf4 import storage
from .sharding import ShardedModule
from .spec import Family


class TSPGatedMLP(ShardedModule):
    """Gated MLP on a TSP axis: ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU) with slice p of the
    intermediate dimension (``⌊F/D⌋`` or ``⌈F/D⌉`` rows, the first ``F mod D`` ranks one
    more). Input and output ``[B, S/D, h]`` (this rank's tokens). A projection may be a
    ``TSPLoraLinear`` (PEFT LoRA, ``hf.lora``): its adapter joins the ring."""

    shard_dims = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        group,
        config: TSPConfig | None = None,
        *,
        activation: str = "silu",
        dtype=None,
        device=None,
    ) -> None:
        super().__init__()
        D, p = comm.size_and_rank(group)
        check_split(intermediate_size, D, "intermediate_size", "use a smaller TSP size")
        self.group, self.options = group, (config or TSPConfig()).engine_options()
        self.activation = activation  # the gate's (``pointwise.GATE_ACTIVATIONS``)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.sizes = split_sizes(intermediate_size, D)  # rows of every rank's slice
        f = self.sizes[p]
        kw = {"dtype": dtype, "device": device, "bias": False}
        self.gate_proj = nn.Linear(hidden_size, f, **kw)
        self.up_proj = nn.Linear(hidden_size, f, **kw)
        self.down_proj = nn.Linear(f, hidden_size, **kw)

    @classmethod
    def from_hf(
        cls, mlp: nn.Module, group, config: TSPConfig | None = None, family: Family = LLAMA
    ) -> TSPGatedMLP:
        """Build from a Hugging Face gated MLP of ``family`` (gate/up/down projections, no
        biases; the gate's activation from its config: ``families.gate_activation``)."""
        activation = gate_activation(mlp.config, family.activation)
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError("TSP gated MLP does not support MLP biases (mlp_bias=True)")
        w = mlp.gate_proj.weight
        h, F_ = w.shape[1], w.shape[0]
        mod = cls(h, F_, group, config, activation=activation, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            for name, param in mod.named_parameters():
                param.copy_(mod.local_slice(name, mlp.get_parameter(name)))
        return mod

    def index_of(self, name: str, rank: int) -> tuple[slice, ...]:
        """Index of rank ``rank``'s slice in the full (Hugging Face) tensor behind ``name``."""
        rows = split_range(self.intermediate_size, len(self.sizes), rank)
        return (slice(None), rows) if self.shard_dims[name] == 1 else (rows,)

    def spec(self) -> MlpSpec:
        """The ring schedule's description of this layer."""
        return MlpSpec(self.group, self.options, tuple(self.sizes), self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [B, S/D, {self.hidden_size}], got {tuple(x.shape)}")
        w = tuple(storage(p) for p in (self.gate_proj, self.up_proj, self.down_proj))
        adapted = adapters_of(self, ("gate_proj", "up_proj", "down_proj"))
        if not adapted:
            return tsp_mlp(x, *w, self.spec())
        plan = plan_of(adapted, ("gate_proj", "up_proj"), "down_proj", self.training)
        pieces = {
            f"a_{n}": comm.replicated(adapted[f"{n}_proj"].a, self.group) for n in plan.inputs
        }
        for n in ("gate", "up"):
            if f"{n}_proj" in adapted:
                pieces[f"b_{n}"] = adapted[f"{n}_proj"].b
        if plan.output is not None:
            pieces["a_down"] = adapted["down_proj"].a
            pieces["b_down"] = comm.replicated(adapted["down_proj"].b, self.group)
        return tsp_mlp(x, *w, self.spec(), lora=plan, adapters=pieces)

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Inference: the MLP of tokens ``x [B, Tq, h]`` that every rank holds (a decode step),
        tensor-parallel over the slices (active LoRA adapters merged); the same on every rank."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        w = (p.merged_weight() if hasattr(p, "merged_weight") else p.weight for p in projs)
        acc = self.options.accum_for(x.dtype)
        return decode_mlp(x, *w, self.group, acc, self.activation)
