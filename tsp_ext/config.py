"""User-facing options of TSP, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .engine.options import EngineOptions


@dataclass(frozen=True)
class TSPConfig(EngineOptions):
    """Options of TSP: the engine's (``EngineOptions``, whose docstring describes each:
    ``accum_dtype``, ``overlap``, ``attn_backend``, ``attn_block``, ``head_bucket``,
    ``window_exchange``, ``recompute_mlp``, ``mlp_tile``, ``loss_chunk``, ``moe_schedule``) and
    the model's below.

    Args:
        tsp_size: D, the number of ranks on the TSP axis (None: take it from the mesh).
        shard_vocab: shard the embedding and LM head by vocabulary rows (rank p keeps ⌊V/D⌋ or
            ⌈V/D⌉ rows, any V) and compute the loss with a fused ring LM head + cross-entropy
            that never builds the ``[S/D, V]`` logits. Off: both stay replicated and the model
            returns full-vocabulary logits, as Hugging Face does.
        checkpoint_layers: recompute each decoder layer in backward (its weight broadcasts,
            K/V gathers and ring included), keeping only its input ``[B, S/D, h]`` per layer
            instead of the engine's saved projections; one more forward per step.
        checkpoint_every: with ``checkpoint_layers``, keep only every k-th layer's input and
            recompute the k layers from it in backward (stored inputs ÷ k; the recomputed
            layers' saved tensors × k while their backward runs). 1: every layer's.
        offload_checkpoints: keep those layer inputs in host memory until backward (pinned,
            copied on a side stream on CUDA; see ``tsp_ext.hf.checkpointing.HostStore``).
            Needs ``checkpoint_layers``.
        checkpoint_device_bytes: with ``offload_checkpoints``, the bytes of those inputs kept
            on the device (the first layers'; the rest go to host memory): a device with room
            left spends it instead of host memory and copies. 0: all in host memory.
        quantize_base: ``"nf4"`` (QLoRA): store the frozen projection shards of a PEFT LoRA
            model in 4-bit NormalFloat (``engine.adapters.nf4``, 0.5625 bytes a weight), send them
            so on the broadcast / ring and dequantize each just before use; None: as loaded.
        self_check: before any weight moves, fold a miniature of the model's own config (its
            class and flags, small widths, one layer of every kind) on the same mesh and compare
            its outputs, loss, logits and every gradient with the unmodified miniature in
            float64 (``hf.self_check``); a mismatch refuses the model with a ``ValueError``
            naming the first module that differs. 0.1-0.6 s for a dense or MoE model, about
            2.4 s for a hybrid at D = 4 (2 CPU cores), once per config and process.
            Off: the model is folded unproven (only for a model already proven this way).
    """

    tsp_size: int | None = None
    shard_vocab: bool = True
    checkpoint_layers: bool = False
    checkpoint_every: int = 1
    offload_checkpoints: bool = False
    checkpoint_device_bytes: int = 0
    quantize_base: str | None = None
    self_check: bool = True

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
        if self.checkpoint_every < 1 or (self.checkpoint_every > 1 and not self.checkpoint_layers):
            raise ValueError(
                f"checkpoint_every={self.checkpoint_every}: an interval of layers recomputed from "
                "one kept input is >= 1 layers and needs checkpoint_layers=True"
            )
        if self.checkpoint_device_bytes < 0 or (
            self.checkpoint_device_bytes and not self.offload_checkpoints
        ):
            raise ValueError(
                f"checkpoint_device_bytes={self.checkpoint_device_bytes}: the device share of "
                "offloaded layer inputs is >= 0 and needs offload_checkpoints=True"
            )
        super().__post_init__()  # the engine's fields

    def engine_options(self) -> EngineOptions:
        """The options the engine's schedules read: the ``EngineOptions`` fields alone (the
        others are ``apply_tsp``'s)."""
        return EngineOptions(**{f.name: getattr(self, f.name) for f in fields(EngineOptions)})

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
