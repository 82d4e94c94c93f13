"""How the engine's schedules run: the options they read, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_backends import BACKENDS


@dataclass(frozen=True)
class EngineOptions:
    """Options of the attention, MLP and vocabulary schedules (``TSPConfig.engine_options()``
    builds them from the user-facing config, which documents each field).

    Args:
        accum_dtype: dtype of partial-output and gradient accumulation (float64 inputs always
            accumulate in float64).
        overlap: prefetch the next weight shard / K/V while computing the current one.
        attn_backend: ``"auto"`` or a name in ``BACKENDS``.
        attn_block: query and key block size of the ``blockwise`` kernel.
        window_exchange: under a sliding window, exchange only the keys each rank's queries
            see (``engine.window``) where that pays; off: all-gather every key.
        recompute_mlp: recompute the MLP's gate/up projections in backward.
        mlp_tile: tokens per tile of an MLP ring step (None: all of the rank's at once).
        loss_chunk: tokens per block of the fused LM-head loss.
        moe_schedule: ``"ring"``, ``"all_to_all"`` or ``"auto"`` (``engine.moe``).
    """

    accum_dtype: torch.dtype = torch.float32
    overlap: bool = True
    attn_backend: str = "auto"
    attn_block: int = 512
    window_exchange: bool = True
    recompute_mlp: bool = True
    mlp_tile: int | None = 4096
    loss_chunk: int = 1024
    moe_schedule: str = "auto"

    def __post_init__(self) -> None:
        if not self.accum_dtype.is_floating_point:
            raise ValueError(f"accum_dtype must be a floating dtype, got {self.accum_dtype}")
        if self.attn_backend != "auto" and self.attn_backend not in BACKENDS:
            raise ValueError(
                f"attn_backend={self.attn_backend!r} is not 'auto' or one of {sorted(BACKENDS)}"
            )
        if self.attn_block < 1:
            raise ValueError(f"attn_block must be >= 1, got {self.attn_block}")
        if self.mlp_tile is not None and self.mlp_tile < 1:
            raise ValueError(f"mlp_tile must be >= 1 or None, got {self.mlp_tile}")
        if self.loss_chunk < 1:
            raise ValueError(f"loss_chunk must be >= 1, got {self.loss_chunk}")
        if self.moe_schedule not in ("auto", "ring", "all_to_all"):
            raise ValueError(
                f"moe_schedule={self.moe_schedule!r}: use 'auto', 'ring' or 'all_to_all'"
            )

    def accum_for(self, dtype: torch.dtype) -> torch.dtype:
        """Accumulation dtype for activations of ``dtype`` (never less precise than them)."""
        return torch.promote_types(dtype, self.accum_dtype)
