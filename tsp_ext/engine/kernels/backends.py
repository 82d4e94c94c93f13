"""Fused attention kernels behind one interface, and the registry that picks one.

A kernel computes attention of ``q [B, Lq, Hq, d]`` against ``k, v [B, Lk, Hk, d]`` (GQA:
Hq = g * Hk, query head i uses KV head i // g, Hugging Face order) and returns the output in q's
dtype and the log-sum-exp ``lse [B, Hq, Lq]`` (float32; float64 for float64 inputs).
``backward`` takes the *merged* out and lse of all the pieces a query attends to, so it returns
that piece's exact share of the gradients.

Backends (``select_backend``):

============== ====== ====================== =================================================
name           device dtypes                 op
============== ====== ====================== =================================================
cpu_flash      cpu    fp32 fp64 bf16 fp16    ``aten._scaled_dot_product_flash_attention_for_cpu``
cuda_flash     cuda   bf16 fp16              ``aten._scaled_dot_product_flash_attention``
cuda_cudnn     cuda   bf16 fp16              ``aten._scaled_dot_product_cudnn_attention``
cuda_efficient cuda   fp32 bf16 fp16         ``aten._scaled_dot_product_efficient_attention``
flash_attn     cuda   bf16 fp16              ``flash_attn`` (>= 2.7) ``_flash_attn_forward``
blockwise      any    any float              ``engine.kernels.blockwise`` (exact)
============== ====== ====================== =================================================

cpu_flash, cuda_flash, cuda_cudnn and flash_attn handle GQA natively and take ``[B, H, L, d]``
strided views of ``[B, L, H, d]`` tensors. cuda_efficient has no GQA: K/V are expanded to Hq heads
for the duration of one call and dK/dV summed back over the group. cuda_flash and
flash_attn need d % 8 == 0 (d <= 256); cuda_cudnn compute capability >= 8.0. cuda_cudnn builds
one cuDNN graph per distinct shape (cached), so ``auto`` takes it only where the shapes repeat from
step to step, and only for the head sizes it was run with (d % 8 == 0, d <= 128).

The alignment of ``is_causal`` with Lq < Lk is not part of the private ops' contract
(flash-attention aligns bottom-right, SDPA's public API top-left), so cuda_flash and flash_attn
probe it once per device and dtype with a two-query call (a few ms); cuda_cudnn (top-left in
PyTorch 2.11, and a probe would build a cuDNN graph, ~1 s), cuda_efficient and cpu_flash always
take the two-call split, which is right under either alignment. blockwise takes one call.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from ..sharding.layout import Span
from .blockwise import attention_backward, attention_forward
from .lse import stats_dtype

aten = torch.ops.aten
_HALF = frozenset({torch.bfloat16, torch.float16})


def _bhld(x: Tensor) -> Tensor:
    """``[B, L, H, d]`` -> ``[B, H, L, d]`` view (no copy)."""
    return x.transpose(1, 2)


class AttentionKernel:
    """One attention backend. Subclasses set ``name``, ``device_type`` (None: any) and ``dtypes``.

    ``forward(q, k, v, scale, is_causal) -> (out [B, Lq, Hq, d], lse [B, Hq, Lq])``;
    ``backward(dout, q, k, v, out, lse, scale, is_causal) -> (dq, dk, dv)`` shaped like q, k, v
    (q's dtype, except blockwise: dk, dv in the statistics dtype).
    """

    name = ""
    device_type: str | None = None
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float64, *_HALF})

    def installed(self) -> bool:
        return True

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        ok_device = self.device_type is None or device.type == self.device_type
        return ok_device and dtype in self.dtypes and self.installed()

    def one_call_causal(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether ``is_causal`` with Lq < Lk aligns bottom-right, so that a chunk's prefix and
        diagonal are one call (False: two calls, causal only on the square diagonal)."""
        return False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, is_causal: bool):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, scale: float, is_causal: bool):
        raise NotImplementedError


class _ProbedAlignment:
    """``one_call_causal`` by experiment (``_aligns_bottom_right``, cached per device and dtype;
    never on meta tensors)."""

    def one_call_causal(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type != "meta" and _aligns_bottom_right(self, device, dtype)


@functools.cache
def _aligns_bottom_right(kernel: AttentionKernel, device: torch.device, dtype) -> bool:
    """Two queries against four keys, causal, equal scores, each value its key's index: the first
    query averages keys 0..2 (1.0) if aligned bottom-right, key 0 alone (0.0) if top-left."""
    q, k = (torch.zeros(1, n, 1, 64, device=device, dtype=dtype) for n in (2, 4))
    v = torch.arange(4, device=device, dtype=dtype)[None, :, None, None].expand(1, 4, 1, 64)
    try:
        out, _ = kernel.forward(q, k, v.contiguous(), 1.0, is_causal=True)
    except RuntimeError:  # the op refuses Lq != Lk causal: the two-call path never asks it to
        return False
    return abs(out[0, 0, 0, 0].item() - 1.0) < 0.1


class CpuFlash(AttentionKernel):
    name, device_type = "cpu_flash", "cpu"

    def forward(self, q, k, v, scale, is_causal):
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            _bhld(q), _bhld(k), _bhld(v), 0.0, is_causal, scale=scale
        )
        return _bhld(o), lse

    def backward(self, dout, q, k, v, out, lse, scale, is_causal):
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *map(_bhld, (dout, q, k, v, out)), lse, 0.0, is_causal, scale=scale
        )
        return tuple(map(_bhld, grads))


class CudaFlash(_ProbedAlignment, AttentionKernel):
    """The op returns 9 values; its backward needs (cum_seq_q, cum_seq_k, max_q, max_k) and the
    RNG pair (rng_state, unused) back as (philox_seed, philox_offset)."""

    name, device_type, dtypes = "cuda_flash", "cuda", _HALF

    def installed(self) -> bool:
        return torch.backends.cuda.is_flash_attention_available()

    def forward(self, q, k, v, scale, is_causal):
        o, lse, *_ = aten._scaled_dot_product_flash_attention(
            _bhld(q), _bhld(k), _bhld(v), 0.0, is_causal, False, scale=scale
        )
        return _bhld(o), lse

    def backward(self, dout, q, k, v, out, lse, scale, is_causal):
        # With dropout 0 the RNG state is never read; empty tensors stand in for it.
        seed = offset = torch.empty(0, dtype=torch.int64, device=q.device)
        rest = (None, None, q.shape[1], k.shape[1], 0.0, is_causal, seed, offset)
        grads = aten._scaled_dot_product_flash_attention_backward(
            *map(_bhld, (dout.contiguous(), q, k, v, out)), lse.contiguous(), *rest, scale=scale
        )
        return tuple(map(_bhld, grads))


class CudaEfficient(AttentionKernel):
    """No GQA in this op: K/V are expanded per call. Its lse is padded to a multiple of 32 along
    L (the backward checks that alignment), so it is sliced on the way out and padded back in.
    Its backward reads ``out`` with a fixed row stride of H * d (the kernel's ``o_strideM``,
    whatever the tensor's strides say) where it computes rowsum(dout * out) itself (bf16/fp16),
    so ``out`` goes in token-major."""

    name, device_type = "cuda_efficient", "cuda"
    dtypes = frozenset({torch.float32, *_HALF})

    def installed(self) -> bool:
        return torch.backends.cuda.is_built()

    @staticmethod
    def _expand(x: Tensor, hq: int) -> Tensor:
        B, L, hk, d = x.shape  # [B, L, Hk, d] -> [B, L, Hq, d], KV head j serves heads j*g..
        return x[:, :, :, None].expand(B, L, hk, hq // hk, d).reshape(B, L, hq, d)

    def forward(self, q, k, v, scale, is_causal):
        hq = q.shape[2]
        k, v = (_bhld(self._expand(x, hq)) for x in (k, v))
        o, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            _bhld(q), k, v, None, True, 0.0, is_causal, scale=scale
        )
        return _bhld(o), lse[:, :, : q.shape[1]]

    def backward(self, dout, q, k, v, out, lse, scale, is_causal):
        B, Lq, hq, _ = q.shape
        lse_pad = lse.new_full((B, hq, -(-Lq // 32) * 32), float("inf"))
        lse_pad[:, :, :Lq] = lse
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        kx, vx = (_bhld(self._expand(x, hq)) for x in (k, v))
        out = _bhld(out.contiguous())  # heads-major out gave dq, dk off by ~50 % in bf16 (H200)
        rest = (None, out, lse_pad, seed, offset, 0.0, [True, True, True, False], is_causal)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _bhld(dout.contiguous()), _bhld(q), kx, vx, *rest, scale=scale
        )
        hk = k.shape[2]
        return _bhld(dq), self._fold(dk, hk), self._fold(dv, hk)

    @staticmethod
    def _fold(g: Tensor, hk: int) -> Tensor:
        """Dual of ``_expand``: ``[B, Hq, Lk, d]`` -> ``[B, Lk, Hk, d]``, summed over each group."""
        return _bhld(g.unflatten(1, (hk, g.shape[1] // hk)).sum(2))


class CudaCudnn(AttentionKernel):
    """cuDNN's fused attention, the kernel SDPA itself picks on Hopper (H200, bf16: 1.75x faster
    than ``cuda_flash`` in the chunked attention). It takes GQA K/V as they are (Hk < Hq; on the
    H200 the same output as with K/V expanded per query head, and up to 1.8x faster). The op's lse
    ``[B, H, L, 1]`` is squeezed on the way out and restored on the way back; its backward takes
    dO and O token-major. A single query against a single key (a one-token document), which
    cuDNN refuses, goes to ``cuda_efficient``."""

    name, device_type, dtypes = "cuda_cudnn", "cuda", _HALF

    def installed(self) -> bool:
        return torch.backends.cuda.is_built() and torch.backends.cudnn.is_available()

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        ok = super().supports(device, dtype) and torch.cuda.is_available()
        return ok and torch.cuda.get_device_capability(device) >= (8, 0)

    @staticmethod
    def _refused(q: Tensor, k: Tensor) -> bool:
        return q.shape[1] == k.shape[1] == 1  # "s_q = s_kv = 1 is not supported" (a 1-token doc)

    def forward(self, q, k, v, scale, is_causal):
        if self._refused(q, k):
            return BACKENDS["cuda_efficient"].forward(q, k, v, scale, is_causal=is_causal)
        o, lse, *_ = aten._scaled_dot_product_cudnn_attention(
            _bhld(q), _bhld(k), _bhld(v), None, True, 0.0, is_causal, False, scale=scale
        )
        return _bhld(o), lse.reshape(lse.shape[:3])

    def backward(self, dout, q, k, v, out, lse, scale, is_causal):
        if self._refused(q, k):
            efficient = BACKENDS["cuda_efficient"]
            return efficient.backward(
                dout, q, k, v, out=out, lse=lse, scale=scale, is_causal=is_causal
            )
        seed = offset = torch.empty(0, dtype=torch.int64, device=q.device)
        dout, out = (_bhld(x.contiguous()) for x in (dout, out))
        rest = (seed, offset, None, None, None, q.shape[1], k.shape[1], 0.0, is_causal)
        grads = aten._scaled_dot_product_cudnn_attention_backward(
            dout, _bhld(q), _bhld(k), _bhld(v), out, lse.contiguous()[..., None], *rest, scale=scale
        )
        return tuple(map(_bhld, grads))


class FlashAttn(_ProbedAlignment, AttentionKernel):
    """The ``flash_attn`` package's op layer (>= 2.7): ``[B, L, H, d]`` in, lse ``[B, Hq, Lq]``."""

    name, device_type, dtypes = "flash_attn", "cuda", _HALF

    def installed(self) -> bool:
        return importlib.util.find_spec("flash_attn") is not None

    # window_size_left, window_size_right, softcap, alibi_slopes: all off
    _NO_EXTRAS = (-1, -1, 0.0, None)

    def forward(self, q, k, v, scale, is_causal):
        from flash_attn.flash_attn_interface import _flash_attn_forward

        o, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, is_causal, *self._NO_EXTRAS, False)
        return o, lse

    def backward(self, dout, q, k, v, out, lse, scale, is_causal):
        from flash_attn.flash_attn_interface import _flash_attn_backward

        grads = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # written to
        rest = (0.0, scale, is_causal, *self._NO_EXTRAS, False, None)  # ..., deterministic, rng
        _flash_attn_backward(dout, q, k, v, out, lse.contiguous(), *grads, *rest)
        return grads


class Blockwise(AttentionKernel):
    """The Python reference. Keys sit at positions ``[0, Lk)``; causal queries end with them
    (positions ``[Lk - Lq, Lk)``: bottom-right), non-causal queries start at Lk so that every
    key is earlier."""

    name = "blockwise"

    def __init__(self, block: int = 512) -> None:
        self.block = block  # query/key block size: bounds the score block to block^2 per head

    def one_call_causal(self, device, dtype) -> bool:
        return True

    def _spans(self, q: Tensor, k: Tensor, is_causal: bool) -> tuple[list[Span], Span]:
        Lq, Lk = q.shape[1], k.shape[1]
        return [Span(0, Lk - Lq if is_causal else Lk, Lq)], Span(0, 0, Lk)

    def forward(self, q, k, v, scale, is_causal):
        q_spans, kspan = self._spans(q, k, is_causal)
        return attention_forward(q, q_spans, [(kspan, k, v)], scale, block=self.block)

    def backward(self, dout, q, k, v, out, lse, scale, is_causal):
        q_spans, kspan = self._spans(q, k, is_causal)
        dk, dv = (torch.zeros(k.shape, dtype=stats_dtype(q), device=k.device) for _ in "kv")
        kv, dkv = [(kspan, k, v)], [(dk, dv)]
        dq = attention_backward(
            dout, q, q_spans, kv, dkv=dkv, fwd=(out, lse), scale=scale, block=self.block
        )
        return dq, dk, dv


BACKENDS: dict[str, AttentionKernel] = {
    b.name: b
    for b in (CpuFlash(), CudaFlash(), CudaCudnn(), CudaEfficient(), FlashAttn(), Blockwise())
}


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Names of the backends that can run on ``device`` with ``dtype``."""
    device = torch.device(device)
    return [n for n, b in BACKENDS.items() if b.supports(device, dtype)]


def select_backend(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    block: int = 512,
    head_dim: int | None = None,
    repeating_shapes: bool = True,
) -> AttentionKernel:
    """The backend ``name`` (or ``"auto"``) for ``device`` / ``dtype``; ``block``: the block size
    of the blockwise kernel.

    ``auto``: cpu -> cpu_flash if it takes the dtype; cuda bf16/fp16 -> cuda_cudnn on compute
    capability >= 9.0 (as SDPA itself chooses) when the call shapes repeat every step
    (``repeating_shapes``: training on fixed-length rows, not packed documents or inference,
    whose shapes would each build a cuDNN graph) and ``head_dim`` (if given) is one it takes,
    then flash_attn if installed, then cuda_flash; cuda fp32 -> cuda_efficient; otherwise (or
    if those are missing) blockwise. Raises ValueError for an unknown name or a backend that
    cannot run there.
    """
    device = torch.device(device)
    ok = available_backends(device, dtype)
    if name == "auto":
        order = {
            "cpu": ["cpu_flash"],
            "cuda": ["flash_attn", "cuda_flash"] if dtype in _HALF else ["cuda_efficient"],
        }.get(device.type, [])
        fits = head_dim is None or (head_dim % 8 == 0 and head_dim <= 128)
        hopper = "cuda_cudnn" in ok and torch.cuda.get_device_capability(device) >= (9, 0)
        if hopper and repeating_shapes and fits:
            order.insert(0, "cuda_cudnn")
        name = next((n for n in order if n in ok), "blockwise")
    elif name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose 'auto' or one of {sorted(BACKENDS)}"
        )
    elif name not in ok:
        why = "is not installed" if not BACKENDS[name].installed() else "does not support it"
        raise ValueError(
            f"attention backend {name!r} cannot run on {device.type} with {dtype} ({name} {why}); "
            f"backends that can: {ok}"
        )
    return Blockwise(block) if name == "blockwise" else BACKENDS[name]
