"""Local maths shared by the schedules and the modules: RMSNorm, rotary embeddings, and the
matmuls into an accumulation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Devices whose mm takes half-precision operands with a float32 result (``out_dtype``): the
# product runs on bf16/fp16 tensor cores, accumulates in float32 and is never rounded to half.
# Elsewhere the operands are cast up first (same value, but on CUDA a float32 GEMM runs ~10x
# slower than a bf16 one: the weight gradients of a bf16 model would dominate the step).
_MIXED_MM_DEVICES = ("cuda", "meta") if "dtype_out" in torch.ops.aten.mm.overloads() else ()


def _out_dtype_mm(a: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``a``'s (half-precision) operands can multiply straight into a ``dtype`` result."""
    return a.dtype != dtype and dtype == torch.float32 and a.device.type in _MIXED_MM_DEVICES


GEMM_ROWS = 16384
"""Rows per tile of a product into a wider accumulator: its half-precision temporaries (the
product before it is added, or operands cast up where the device cannot multiply straight into
float32) exist for this many rows at a time, never for all ``S/D`` tokens."""


def _tiles(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def matmul(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b`` for 2-D views with the result in ``dtype`` (the accumulation dtype: a's or
    wider), written into ``out`` if given. Operands cast up are cast in tiles of the inner
    dimension (a weight gradient's inner dimension is the tokens)."""
    if _out_dtype_mm(a, dtype):
        return torch.mm(a, b, out_dtype=dtype, out=out)
    if a.dtype == b.dtype == dtype:
        return torch.mm(a, b, out=out)
    tiles = _tiles(a.shape[1], GEMM_ROWS) or [slice(0, 0)]
    out = torch.mm(a[:, tiles[0]].to(dtype), b[tiles[0]].to(dtype), out=out)
    for k in tiles[1:]:
        out.addmm_(a[:, k].to(dtype), b[k].to(dtype))
    return out


def add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` for 2-D views, the product formed at ``out``'s precision (e.g. bf16
    operands into a float32 accumulator), in tiles of ``GEMM_ROWS`` rows."""
    if a.dtype == b.dtype == out.dtype:
        out.addmm_(a, b)
    elif _out_dtype_mm(a, out.dtype):
        for m in _tiles(a.shape[0], GEMM_ROWS):
            out[m].add_(torch.mm(a[m], b, out_dtype=out.dtype))
    else:
        b = b.to(out.dtype)
        for m in _tiles(a.shape[0], GEMM_ROWS):
            out[m].addmm_(a[m].to(out.dtype), b)


def round_in_place(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` for a contiguous accumulator ``t`` (float32 or wider) that the caller no
    longer reads: rounded into ``t``'s own storage, front to back, and returned as a tensor on
    that storage (its first bytes), so that no second ``t``-sized buffer exists. ``t`` itself
    is left with stale contents."""
    if t.dtype == dtype or dtype.itemsize >= t.dtype.itemsize or not t.is_contiguous():
        return t.to(dtype)
    src = t.view(-1)
    n = src.numel()
    dst = src.view(dtype)[:n]  # t's first bytes (detached below: not a view to autograd)
    # element i of dst overlaps elements i/r.. of src (r = the itemsize ratio): a range [i, j)
    # is safe to convert once j <= r·i, as everything it overwrites has been read
    r = t.dtype.itemsize // dtype.itemsize
    i = min(n, GEMM_ROWS)
    dst[:i].copy_(src[:i].to(dtype))  # the first range through a small temporary
    while i < n:
        j = min(n, r * i)
        dst[i:j].copy_(src[i:j])
        i = j
    return dst.view(t.shape).detach()


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """``out = a @ b`` (``add``: ``out += a @ b``) at ``out``'s precision: a sum over tiles whose
    first tile writes instead of adding to zeros."""
    if add:
        add_matmul(out, a, b)
    else:
        matmul(a, b, out.dtype, out=out)


def inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """The float32 reciprocal RMS ``[..., 1]`` of ``xf`` (``x.float()``) over its last dim."""
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


NORM_ROWS = 4096
"""Most rows (tokens) per tile of the RMSNorms' float32 work: at long context its float32
copies of ``x``, ``x̂`` and the gradients exist for this many rows at a time, not for all
``S/D``."""
NORM_SPLIT = 16
"""Fewest tiles of a norm over more than ``NORM_SPLIT * NORM_MIN_ROWS`` rows, so that the
tiles' float32 temporaries stay a fraction of one ``[S/D, h]`` tensor at every length."""
NORM_MIN_ROWS = 256


def _row_tiles(n: int) -> list[slice]:
    return _tiles(n, max(NORM_MIN_ROWS, min(NORM_ROWS, -(-n // NORM_SPLIT))))


def normalize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x, weight, eps, offset)`` and the float32 reciprocal RMS ``[..., 1]``, computed
    in tiles of ``NORM_ROWS`` rows (each row's values as untiled: its statistics are its own)."""
    h = x.shape[-1]
    rows = x.reshape(-1, h)
    dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = x.new_empty(rows.shape, dtype=dtype)
    r = x.new_empty(rows.shape[0], 1, dtype=torch.float32)
    wf = offset + weight.float() if offset else None
    for c in _row_tiles(rows.shape[0]):
        xf = rows[c].float()
        r[c] = inv_rms(xf, eps)
        out[c] = (xf * r[c]).mul_(wf) if offset else weight * (xf * r[c]).to(x.dtype)
    return out.view(*x.shape[:-1], h), r.view(*x.shape[:-1], 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0):
    """RMSNorm over the last dim, statistics in float32 (in row tiles: ``normalize``), as Hugging
    Face computes it: ``weight · x̂`` cast first (Llama family), or with an ``offset`` the
    float32 product ``x̂ · (offset + weight)`` cast last (Gemma's ``(1 + w)``)."""
    return normalize(x, weight, eps, offset)[0]


def rms_norm_backward(x, weight, r, dy, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dweight)`` of ``rms_norm(x, weight, offset=offset)`` given ``dy`` and ``r
    = inv_rms(x.float())``: ``dx = r · (g - x̂ · mean(g ⊙ x̂))`` with ``g = dy ⊙ (offset +
    weight)``, ``x̂ = x·r`` (float32), in five fused passes per tile of ``NORM_ROWS`` rows,
    ``dweight`` summed over the tiles in float32. A float64 ``x`` (the parity tests' dtype)
    replays the taped norm's operations in order, untiled, so its gradients equal Hugging
    Face's to the bit."""
    if x.dtype == torch.float64:
        xf = x.float()
        xn = xf * r
        if offset:  # Gemma: the product in float32, cast last
            dyf = dy.float()
            dw = (dyf * xn).sum(tuple(range(dy.dim() - 1)))
            g = dyf * (offset + weight.float())
        else:
            dw = (dy * xn.to(x.dtype)).sum(tuple(range(dy.dim() - 1)))
            g = (dy * weight).float()
        dr = (g * xf).sum(-1, keepdim=True)
        dmean = (-0.5 * dr) * r.pow(3) / x.shape[-1]  # rsqrt, then mean, backward
        dx = g * r + dmean * (2 * xf)  # the x·r product's and the square's paths
        return dx.to(x.dtype), dw.to(weight.dtype)
    h = x.shape[-1]
    rows, d_rows, r_rows = x.reshape(-1, h), dy.reshape(-1, h), r.reshape(-1, 1)
    dx = torch.empty_like(rows)
    dw = torch.zeros(h, dtype=torch.float32, device=x.device)
    wf = offset + weight.float() if offset else None
    for c in _row_tiles(rows.shape[0]):
        xn = rows[c].float() * r_rows[c]
        if offset:
            dyf = d_rows[c].float()
            dw += (dyf * xn).sum(0)
            g = dyf * wf
        else:
            dw += (d_rows[c] * xn.to(x.dtype)).sum(0, dtype=torch.float32)
            g = (d_rows[c] * weight).float()
        dot = torch.linalg.vecdot(g, xn).unsqueeze(-1).div_(h)
        dx[c] = g.addcmul_(xn, dot, value=-1).mul_(r_rows[c])
    return dx.view(x.shape), dw.to(weight.dtype)


class _RMSNormKeepingInput(torch.autograd.Function):
    """``rms_norm`` whose backward recomputes the normalised input: autograd keeps ``x`` and the
    float32 reciprocal RMS ``[..., 1]`` only, where the taped version also keeps ``x̂`` (and, for
    a half-precision ``x``, a float32 copy of it)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        y, r = normalize(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, r)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, dy):
        return *rms_norm_backward(*ctx.saved_tensors, dy, ctx.offset), None, None


def rms_norm_keeping_input(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """``rms_norm`` (same values) for training: saves ``x`` and one float32 per row, and
    recomputes the normalised ``x`` in backward (one multiply). The output remembers where it
    came from, so that a consumer saving it for backward saves ``x`` instead (``to_save``)."""
    y = _RMSNormKeepingInput.apply(x, weight, eps, offset)
    y._tsp_normed = (x, weight, (eps, offset), y._version)
    return y


def to_save(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """What to save for backward in place of ``t``: for an unmodified output of
    ``rms_norm_keeping_input``, the norm's input and weight (which the norm saves anyway: a
    ``[B, S/D, h]`` tensor less per consumer) and its ``(eps, offset)``; else ``(t, None,
    None)``. ``from_saved`` rebuilds ``t``."""
    src = getattr(t, "_tsp_normed", None)
    if src is None or src[3] != t._version:
        return t, None, None
    return src[:3]


def from_saved(t: torch.Tensor, weight: torch.Tensor | None, norm: tuple | None) -> torch.Tensor:
    """Inverse of ``to_save``: the norm's output recomputed from its input by the norm's own
    operations (the same values), or ``t`` itself."""
    if weight is None:
        return t
    return normalize(t, weight, *norm)[0]


class TokenRows:
    """The tokens ``X [B, T, h]`` a projection reads: a tensor, or (``to_save``) its RMSNorm's
    input and weight, whose normed rows are then rebuilt one tile at a time where a GEMM reads
    them (the norm's own operations per row: the same values), so that no ``[B, T, h]`` copy
    of them exists at once. ``full()`` rebuilds all of it."""

    def __init__(self, t: torch.Tensor, weight: torch.Tensor | None = None, norm=None) -> None:
        self.t, self.weight, self.norm = t, weight, norm
        self.shape = t.shape

    @staticmethod
    def of(x: torch.Tensor | TokenRows) -> TokenRows:
        return x if isinstance(x, TokenRows) else TokenRows(x)

    def full(self) -> torch.Tensor:
        return from_saved(self.t, self.weight, self.norm)

    def _blocks(self):
        """Yield ``(rows, X[rows] [n, h])`` over the ``B·T`` rows, each made when reached."""
        flat = self.t.reshape(-1, self.shape[-1])
        if self.weight is None:
            yield slice(0, flat.shape[0]), flat
            return
        for r in _row_tiles(flat.shape[0]):
            yield r, from_saved(flat[r], self.weight, self.norm)

    def linear(self, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``X · wᵀ (+ b)``: ``[B, T, rows]``."""
        if self.weight is None:
            return F.linear(self.t, w, b)
        out = self.t.new_empty(*self.shape[:-1], w.shape[0])
        flat = out.view(-1, w.shape[0])
        for r, x in self._blocks():
            flat[r] = F.linear(x, w, b)
        return out

    def grad_weight(self, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``dᵀ · X`` ``[m, h]`` in ``dtype`` for ``d [B·T, m]``: a weight gradient, summed over
        the tokens a tile at a time."""
        out = None
        for r, x in self._blocks():
            if out is None:
                out = matmul(d[r].t(), x, dtype)
            else:
                add_matmul(out, d[r].t(), x)
        return out


def rope_phases(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, head_dim: int | None = None
) -> torch.Tensor:
    """Hugging Face's RoPE tables ``cos, sin [B, T, rot]`` as the phases ``cos_i + j·sin_i``
    ``[B, T, 1, d/2]`` that ``rope`` multiplies by (complex128 for float64, else complex64).
    Hugging Face builds both tables as ``cat(freqs, freqs)``; tables whose halves differ are
    refused rather than rotated wrongly. Partial rotary (``rot < head_dim``): the pairs of the
    dims past ``rot`` (``qkv.interleave_heads`` puts them last) get the phase 1."""
    half = cos.shape[-1] // 2
    for t in (cos, sin):
        if not torch.equal(t[..., :half], t[..., half:]):
            raise ValueError(
                "RoPE tables whose two halves differ are not supported: TSP rotates dimension i "
                "with i + d/2 by one angle (Hugging Face's rotate_half, tables cat(freqs, freqs))"
            )
    real = torch.float64 if dtype == torch.float64 else torch.float32
    phases = torch.complex(cos[..., :half].to(real), sin[..., :half].to(real))
    if head_dim is not None and 2 * half < head_dim:
        phases = F.pad(phases, (0, head_dim // 2 - half), value=1.0)
    return phases.unsqueeze(2)


def rope(x: torch.Tensor, phases: torch.Tensor, out=None) -> torch.Tensor:
    """Rotary embedding of ``x [B, T, H, d]`` whose head dims are *interleaved*
    (``qkv.interleave_heads``: Hugging Face's pair (i, i + d/2) at 2i, 2i + 1): each pair times
    its phase (``rope_phases``), one complex multiply, into ``out`` (any strides) if given. Not
    differentiable: ``rope(g, phases.conj())`` is its adjoint."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    target = out if _pairable(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
    if x.dtype in (torch.float32, torch.float64):
        torch.mul(_complex(x), phases, out=_complex(target))
    else:  # no bf16 complex: rotate in float32, round once
        target.copy_(torch.view_as_real(_complex(x.float()) * phases).flatten(-2))
    if target is not out:
        out.copy_(target)
    return out


def _pairable(t: torch.Tensor) -> bool:
    """Whether ``t``'s last dim can be viewed as complex pairs without a copy."""
    return (
        t.stride(-1) == 1
        and t.storage_offset() % 2 == 0
        and all(s % 2 == 0 for s in t.stride()[:-1])
    )


def _complex(t: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` -> complex ``[..., d/2]`` of adjacent pairs (a view when ``_pairable``)."""
    t = t if _pairable(t) else t.contiguous()
    return torch.view_as_complex(t.unflatten(-1, (-1, 2)))


# gated MLP activations by engine name: (aten op, its ``approximate`` argument or None)
GATE_ACTIVATIONS = {"silu": None, "gelu": "none", "gelu_tanh": "tanh"}


def gate_activation(x: torch.Tensor, kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x)`` of a gated MLP's gate (``kind`` in ``GATE_ACTIVATIONS``), into ``out`` if
    given."""
    approximate = GATE_ACTIVATIONS[kind]
    if out is None:
        out = torch.empty_like(x)
    if approximate is None:
        return torch.ops.aten.silu.out(x, out=out)
    return torch.ops.aten.gelu.out(x, approximate=approximate, out=out)


def gate_activation_backward(
    grad: torch.Tensor, x: torch.Tensor, kind: str, out: torch.Tensor
) -> torch.Tensor:
    """``grad ⊙ act'(x)`` into ``out`` (which may be ``x`` itself)."""
    approximate = GATE_ACTIVATIONS[kind]
    if approximate is None:
        return torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=out)
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=approximate, grad_input=out)
