"""User-facing options of TSP, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .engine.options import EngineOptions


@dataclass(frozen=True)
class TSPConfig:
    """Options of the TSP engine.

    Args:
        tsp_size: D, the number of ranks on the TSP axis (None: take it from the mesh).
        accum_dtype: dtype of partial-output and gradient accumulation across head groups and
            ring steps (float32 keeps bf16 models exact to fp32 rounding; float64 inputs always
            accumulate in float64).
        overlap: prefetch the next weight shard (broadcast / ring) while computing the current
            one, and post the next head group's K/V all-gather before the current group
            attends. Off makes every transfer synchronous and keeps one head group's buffers
            (projections, gathered K/V, their gradients) alive at a time: less memory at long
            context (debugging, profiling, the longest sequences).
        attn_backend: attention kernel: ``"auto"`` (fused where the device and dtype allow:
            ``cpu_flash`` on CPU; for bf16/fp16 on CUDA ``cuda_cudnn`` on Hopper and newer when
            the shapes repeat every step, else ``flash_attn`` / ``cuda_flash``; ``cuda_efficient``
            for fp32 on CUDA; else ``blockwise``) or one of those names
            (``tsp_ext.engine.attention_backends.BACKENDS``).
        attn_block: query and key block size of the ``blockwise`` attention kernel; bounds its
            transient score block to ``B x heads/D x attn_block^2``.
        window_exchange: in sliding-window layers, send each rank only the keys its queries
            see (point to point, ``engine.window``) where that saves at least half of the K/V
            all-gather's traffic; off: all-gather every key as in full-attention layers.
        recompute_mlp: recompute the MLP's gate/up projections shard by shard in backward (saves
            only X_p). Off keeps them: ``2 x B x S/D x F`` more saved elements per layer, two
            fewer matmuls per ring step in backward.
        mlp_tile: tokens per tile of an MLP ring step: a step's intermediates (gate/up
            pre-activations, their gradients) are ``mlp_tile x 2F/D`` instead of
            ``B·S/D x 2F/D``; the weight gradients accumulate over the tiles. None: no tiling.
        shard_vocab: shard the embedding and LM head by vocabulary rows (rank p keeps ⌊V/D⌋ or
            ⌈V/D⌉ rows, any V) and compute the loss with a fused ring LM head + cross-entropy
            that never builds the ``[S/D, V]`` logits. Off: both stay replicated and the model
            returns full-vocabulary logits, as Hugging Face does.
        loss_chunk: tokens per block of the fused LM-head loss; bounds its transient logits
            block to ``loss_chunk x ⌈V/D⌉`` (float32).
        checkpoint_layers: recompute each decoder layer in backward (its weight broadcasts,
            K/V gathers and ring included), keeping only its input ``[B, S/D, h]`` per layer
            instead of the engine's saved projections; one more forward per step.
        offload_checkpoints: keep those layer inputs in host memory until backward (pinned,
            copied on a side stream on CUDA; see ``tsp_ext.hf.checkpointing.HostStore``).
            Needs ``checkpoint_layers``.
        quantize_base: ``"nf4"`` (QLoRA): store the frozen projection shards of a PEFT LoRA
            model in 4-bit NormalFloat (``engine.nf4``, 0.5625 bytes a weight), send them so on
            the broadcast / ring and dequantize each just before use; None: as loaded.
        moe_schedule: how a mixture-of-experts layer's tokens meet its experts (each rank owns
            E/D whole experts): ``"ring"`` (the experts travel the ring, tokens stay),
            ``"all_to_all"`` (tokens go to their experts' owners and back) or ``"auto"``: per
            call, the one that moves fewer bytes (``engine.moe_traffic``).
    """

    tsp_size: int | None = None
    accum_dtype: torch.dtype = torch.float32
    overlap: bool = True
    attn_backend: str = "auto"
    attn_block: int = 512
    window_exchange: bool = True
    recompute_mlp: bool = True
    mlp_tile: int | None = 4096
    shard_vocab: bool = True
    loss_chunk: int = 1024
    checkpoint_layers: bool = False
    offload_checkpoints: bool = False
    quantize_base: str | None = None
    moe_schedule: str = "auto"

    def __post_init__(self) -> None:
        if self.quantize_base not in (None, "nf4"):
            raise ValueError(f"quantize_base={self.quantize_base!r}: use 'nf4' or None")
        if self.tsp_size is not None and self.tsp_size < 1:
            raise ValueError(f"tsp_size must be >= 1, got {self.tsp_size}")
        if self.offload_checkpoints and not self.checkpoint_layers:
            raise ValueError(
                "offload_checkpoints moves the decoder layers' checkpoints to host memory: "
                "set checkpoint_layers=True too"
            )
        self.engine_options()  # validates the engine's fields

    def engine_options(self) -> EngineOptions:
        """The options the engine's schedules read: every field but ``tsp_size``,
        ``shard_vocab``, ``quantize_base`` and the checkpointing ones (which ``apply_tsp``
        reads)."""
        return EngineOptions(**{f.name: getattr(self, f.name) for f in fields(EngineOptions)})

    def accum_for(self, dtype: torch.dtype) -> torch.dtype:
        """Accumulation dtype for activations of ``dtype`` (never less precise than them)."""
        return self.engine_options().accum_for(dtype)

    @classmethod
    def from_dict(cls, options: dict[str, Any], where: str = "the TSP options") -> TSPConfig:
        """A config from JSON-style options (e.g. a DeepSpeed ``"tsp"`` block): any field name,
        ``size`` as an alias of ``tsp_size``, dtypes as strings (``"float32"``). ``where``
        names the options in error messages."""
        kw = dict(options)
        if "size" in kw:
            if "tsp_size" in kw:
                raise ValueError(f'{where}: give the TSP size once, "size" or "tsp_size"')
            kw["tsp_size"] = kw.pop("size")
        known = {f.name for f in fields(cls)}
        unknown = set(kw) - known
        if unknown:
            raise ValueError(
                f"unknown keys in {where}: {sorted(unknown)} (known: {sorted(known | {'size'})})"
            )
        if isinstance(kw.get("accum_dtype"), str):
            name = kw["accum_dtype"].removeprefix("torch.")
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{where}: accum_dtype {kw['accum_dtype']!r} is not a dtype")
            kw["accum_dtype"] = dtype
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-style options ``from_dict`` reads back: ``size`` for the TSP size, dtypes by
        name (e.g. a DeepSpeed ``"tsp"`` block)."""
        options = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tsp_size"}
        options["accum_dtype"] = str(self.accum_dtype).removeprefix("torch.")
        return {"size": self.tsp_size, **options}

    def differences(self, other: TSPConfig) -> dict[str, tuple[Any, Any]]:
        """``{field: (self's value, other's value)}`` for every field that differs."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }
