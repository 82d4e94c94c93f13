"""QLoRA's frozen base under TSP: projection shards kept in 4-bit NormalFloat
(``engine.adapters.nf4``).

``TSPConfig(quantize_base="nf4")`` makes ``apply_tsp`` replace every frozen q/k/v/o/gate/up/down
shard of a PEFT LoRA model by an ``NF4Linear``: the packed bytes are what the rank stores and what
the head-group broadcast and the weight ring carry (``storage``); the schedules dequantize each
received shard just before use, in the activations' dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.adapters import nf4
from .families import family_of
from .lora import TSPLoraLinear


class NF4Linear(nn.Module):
    """A frozen linear shard stored NF4-packed (``packed``, uint8; not in the state dict: a
    quantized base is not training state and exports through its adapter). ``weight``
    dequantizes it (inference, merges); ``bias`` stays as it was (frozen)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.requires_grad:
            raise ValueError(
                "quantize_base='nf4' quantizes frozen base weights: fold a PEFT LoRA model "
                "(its base is frozen), or train without quantize_base"
            )
        self.shape, self.dtype = linear.weight.shape, linear.weight.dtype
        self.register_buffer("packed", nf4.pack(linear.weight), persistent=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return nf4.unpack(self.packed, self.shape, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def storage(proj: nn.Module) -> torch.Tensor:
    """What a projection's base shard travels as: NF4's packed bytes, or the weight itself."""
    base = proj.base_layer if isinstance(proj, TSPLoraLinear) else proj
    return base.packed if isinstance(base, NF4Linear) else base.weight


def quantize_projections(hf_model: nn.Module) -> None:
    """Replace every projection shard of a TSP model's decoder layers (the base layer of a LoRA
    projection) by its ``NF4Linear``."""
    family = family_of(hf_model)
    for layer in family.layers_of(hf_model):
        for block, names in family.projection_blocks(layer):
            for name in names:
                proj = getattr(block, name)
                if isinstance(proj, TSPLoraLinear):
                    proj.base_layer = NF4Linear(proj.base_layer)
                else:
                    setattr(block, name, NF4Linear(proj))
