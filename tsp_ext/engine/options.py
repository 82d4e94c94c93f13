"""How the engine's schedules run: the options they read, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.backends import BACKENDS


@dataclass(frozen=True)
class EngineOptions:
    """Options of the attention, MLP and vocabulary schedules; ``TSPConfig`` adds the model-level
    ones (it is an ``EngineOptions``, and ``TSPConfig.engine_options()`` takes these fields).

    Args:
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
            for fp32 on CUDA; else ``blockwise``) or one of those names (``BACKENDS``).
        attn_block: query and key block size of the ``blockwise`` attention kernel; bounds its
            transient score block to ``B x heads/D x attn_block^2``.
        head_bucket: KV heads per bucket of a head group's attention (the last bucket takes
            the remainder), attended one bucket after the other: each bucket's K/V streamed
            past the ranks a zigzag chunk at a time and its dK/dV reduced to each chunk's owner
            (``engine.attention.key_stream``; sliding windows and non-kernel GQA maps: gathered per
            bucket), and, without LoRA adapters, each bucket's Q/K/V projected and its
            projection differentiated in turn, so that the K/V, the projections, their
            gradients and the kernels' buffers scale with the bucket, not the group or S;
            a query chunk's earlier keys are attended a chunk's length at a time. None: the
            whole group at once, its gather overlapped with the previous group's attention,
            the keys in one call.
        window_exchange: in sliding-window layers, send each rank only the keys its queries
            see (point to point, ``engine.attention.window``) where that saves at least half of the
            K/V all-gather's traffic; off: all-gather every key as in full-attention layers.
        recompute_mlp: recompute the MLP's gate/up projections shard by shard in backward (saves
            only X_p). Off keeps them: ``2 x B x S/D x F`` more saved elements per layer, two
            fewer matmuls per ring step in backward.
        mlp_tile: tokens per tile of an MLP ring step: a step's intermediates (gate/up
            pre-activations, their gradients) are ``mlp_tile x 2F/D`` instead of
            ``B·S/D x 2F/D``; the weight gradients accumulate over the tiles. None: no tiling.
        loss_chunk: tokens per block of the fused LM-head loss; bounds its transient logits
            block to ``loss_chunk x ⌈V/D⌉`` (float32).
        moe_schedule: how a mixture-of-experts layer's tokens meet its experts (each rank owns
            E/D whole experts): ``"ring"`` (the experts travel the ring, tokens stay),
            ``"all_to_all"`` (tokens go to their experts' owners and back) or ``"auto"``: per
            call, the one that moves fewer bytes (``engine.feed_forward.moe_traffic``).
    """

    accum_dtype: torch.dtype = torch.float32
    overlap: bool = True
    attn_backend: str = "auto"
    attn_block: int = 512
    head_bucket: int | None = None
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
        if self.head_bucket is not None and self.head_bucket < 1:
            raise ValueError(f"head_bucket must be >= 1 KV head or None, got {self.head_bucket}")
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
