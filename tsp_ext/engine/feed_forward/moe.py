"""TSP mixture-of-experts MLP: rank p owns E_p whole experts; either the experts travel to the
tokens (a weight ring, as the dense MLP) or the tokens travel to the experts (all-to-all).

Rank p holds experts ``split_range(E, D, p)`` (``⌊E/D⌋`` or ``⌈E/D⌉`` of them, the first
``E mod D`` ranks one more), ``gate_up [E_p, 2F, h]`` and ``down [E_p, h, F]`` as Hugging Face
stores them, and the tokens of zigzag shard p. The router is replicated, so each rank routes its
own n tokens: ``index, weight [n, k]``. Two schedules give the same result:

    ring (experts travel):                       all_to_all (tokens travel):
    cur = my experts; Y_p = 0                    rows = X_p[token of each assignment]
    for t in 0..D-1:       # cur: owner p - t    send each row to its expert's owner
        post cur -> p+1, next <- p-1             for my experts e:
        for e in cur, its tokens X_e, w_e:           out_e = FFN_e(rows received for e)
            Y_p[X_e] += w_e · FFN_e(X_e)         send each out row back
        wait; cur = next                         Y_p[token] += weight · out row

with ``FFN_e(X) = (act(X·G_eᵀ) ⊙ (X·U_eᵀ))·Dn_eᵀ`` (gpt-oss's biased, clamped form:
``moe_clamped``; its biases travel with their experts' weights). Neither drops a token (no
capacity). A rank moves ``3·E·F·h`` weight elements a step through the ring (forward, and
weights plus their gradients in backward) against ``n·k·h`` activation rows per transfer for
the all-to-all (two forward, three backward); ``traffic`` counts both and ``schedule_for``
takes the cheaper one per call (``TSPConfig(moe_schedule=...)`` fixes it).

Backward mirrors each: the ring runs again with the dense MLP's gradient ring one step behind;
the all-to-all sends the rows of X and dY (and the routing weights) to the owners, which compute
their experts' full gradients (every row of an expert is theirs) and send dX rows (and each
weight's gradient, ``<dY, expert output>``) back. Activations are recomputed; saved per rank:
X_p and the routing ``[n, k]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.pointwise import add_matmul, from_saved, gate_activation, matmul, to_save
from ..options import EngineOptions
from ..parallel import comm
from ..parallel.weight_ring import GradientRing, circulate
from ..sharding.partition import split_range, split_sizes
from .mlp import swiglu_pointwise_backward
from .moe_traffic import schedule_for


class Routing:
    """The assignments of ``n`` tokens to ``E`` experts, grouped by expert: ``slots [n·k]``
    (positions in the flat ``[n·k]`` routing, sorted by expert, stable), ``tokens [n·k]``
    (their tokens), ``counts [E]`` (assignments per expert, laid end to end in that order) and
    the all-to-all ``dispatch`` once made (``_Experts.exchange``). Backward rebuilds it from
    the saved slots (``sorted``): no second sort, count or exchange of counts."""

    def __init__(self, slots: torch.Tensor, k: int, counts: list[int], dispatch=None) -> None:
        self.slots, self.tokens, self.k = slots, slots // k, k
        self.counts, self.dispatch = counts, dispatch

    @classmethod
    def of(cls, index: torch.Tensor, n_experts: int) -> Routing:
        """The routing of ``index [n, k]``, each token's experts."""
        flat = index.reshape(-1)
        counts = torch.bincount(flat, minlength=n_experts).tolist()
        return cls(torch.argsort(flat, stable=True), index.shape[1], counts)

    def rows_of(self, first: int, n: int) -> tuple[slice, list[int]]:
        """The assignments (rows of ``slots``) to experts ``first .. first + n - 1``, and how
        many each of them has."""
        counts = self.counts[first : first + n]
        start = sum(self.counts[:first])
        return slice(start, start + sum(counts)), counts


def _groups(counts: list[int]) -> list[tuple[int, slice]]:
    """``(i, rows)`` of each non-empty run of ``counts`` laid end to end."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [(i, slice(s, s + c)) for i, (s, c) in enumerate(zip(starts, counts)) if c]


def _grouped_mm_runs(t: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs a grouped GEMM of ``t`` here: on CPU in float32
    (half-precision operands cast up; measured equal to the loop and about 2.5x faster).
    Elsewhere (float64; CUDA, not tested here) the groups run as a loop of GEMMs."""
    return t.device.type == "cpu" and acc == torch.float32 and hasattr(torch, "_grouped_mm")


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def rows_mm(a: torch.Tensor, b: torch.Tensor, counts: list[int], acc) -> torch.Tensor:
    """Each group's rows of ``a [m, k]`` (groups of ``counts`` rows, in order) times the
    group's ``b[g] [k, n]``: ``[m, n]`` in ``acc``."""
    if _grouped_mm_runs(a, acc):
        return torch._grouped_mm(a.to(acc), b.to(acc), offs=_offsets(counts, a.device))
    out = a.new_empty(a.shape[0], b.shape[2], dtype=acc)
    for g, rows in _groups(counts):
        out[rows] = matmul(a[rows], b[g], acc)
    return out


def sum_mm(a: torch.Tensor, b: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
    """``out[g] += a[:, rows of g] · b[rows of g]`` for ``a [k, m]``, ``b [m, n]`` and groups of
    ``counts`` rows (``out [G, k, n]``, the accumulation dtype): each group's weight gradient."""
    if _grouped_mm_runs(a, out.dtype):
        out += torch._grouped_mm(a.to(out.dtype), b.to(out.dtype), offs=_offsets(counts, a.device))
        return
    for g, rows in _groups(counts):
        add_matmul(out[g], a[:, rows], b[rows])


def _ffn(x, ws, counts: list[int], *, kind, acc) -> torch.Tensor:
    """``(act(x·G_gᵀ) ⊙ (x·U_gᵀ))·Dn_gᵀ`` ``[m, h]`` in ``acc`` of rows ``x [m, h]`` in groups of
    ``counts`` (one per expert), with the experts' ``ws = (gu, dn)``: ``[G; U]`` ``[G, 2F, h]``
    and ``dn [G, h, F]`` (a ``kind`` that is not an activation's name computes its own form:
    ``moe_clamped.ClampedSwiGLU``)."""
    if not isinstance(kind, str):
        return kind.ffn(x, ws, counts, acc=acc)
    gu, dn = ws
    hg, hu = rows_mm(x, gu.transpose(1, 2), counts, acc).chunk(2, dim=-1)
    return rows_mm(gate_activation(hg, kind).mul_(hu), dn.transpose(1, 2), counts, acc)


def _ffn_backward(x, dy, w, ws, *, counts: list[int], kind, acc, grads=None):
    """Backward of ``w · FFN(x)`` (``_ffn``) for rows ``x, dy [m, h]`` with weights ``w [m]``
    (acc): returns ``dX [m, h]`` and ``dw [m]`` (acc) and adds each weight's gradient into
    ``grads`` (``(d_gu [G, 2F, h], d_dn [G, h, F])``, acc, as ``ws``) if given."""
    if not isinstance(kind, str):
        return kind.ffn_backward(x, dy, w, ws, counts=counts, acc=acc, grads=grads)
    gu, dn = ws
    d_out = rows_mm(dy, dn, counts, acc)  # dY·Dn before the routing weight
    hid = rows_mm(x, gu.transpose(1, 2), counts, acc)
    dh, act = swiglu_pointwise_backward(d_out * w[:, None], hid, kind=kind)
    dw = (d_out * act).sum(dim=-1)
    if grads is not None:
        sum_mm(dh.t(), x, counts, grads[0])
        sum_mm(dy.t(), act.mul_(w[:, None]), counts, grads[1])
    return rows_mm(dh, gu, counts, acc), dw


@dataclass(frozen=True)
class ExpertsSpec:
    """What a routed-experts layer is: its TSP ``group``, engine ``options``, the number of
    routed experts ``n_experts`` (rank p owns ``split_range(n_experts, D, p)``), the gate's
    ``activation`` (``pointwise.GATE_ACTIVATIONS``) or a ``moe_clamped.ClampedSwiGLU``, and the
    ``schedule``: ``"ring"``, ``"all_to_all"`` or ``"auto"`` (``schedule_for``, on the GEMM
    weights' traffic)."""

    group: object
    options: EngineOptions
    n_experts: int
    activation: object = "silu"
    schedule: str = "auto"


class _Experts:
    """The layout of one call: every rank's expert count ``sizes [D]`` and first expert, the
    shapes of one expert's weights ``shapes`` (as ``ws``: ``(gu, dn)`` or gpt-oss's four), the
    gate's activation (or ``ClampedSwiGLU``), the accumulation dtype and the ``schedule`` this
    call runs (``schedule_for`` the routing ``index [n, k]``)."""

    def __init__(self, spec: ExpertsSpec, x, ws, index: torch.Tensor):
        self.group, self.options, self.kind = spec.group, spec.options, spec.activation
        self.D, self.p = comm.size_and_rank(spec.group)
        n_experts = spec.n_experts
        self.n_experts, self.h = n_experts, x.shape[-1]
        self.shapes = [tuple(t.shape[1:]) for t in ws]
        self.per_expert = [math.prod(s) for s in self.shapes]
        self.sizes = split_sizes(n_experts, self.D)
        self.first = [split_range(n_experts, self.D, q).start for q in range(self.D)]
        self.acc = spec.options.accum_for(x.dtype)
        n, k = index.shape
        F = ws[0].shape[1] * ws[0].shape[2] // (2 * self.h)  # [2F, h] or [h, 2F]
        self.schedule = schedule_for(spec.schedule, n=n, k=k, E=n_experts, F=F, h=self.h, D=self.D)

    def owned(self, routing: Routing, q: int) -> tuple[slice, list[int]]:
        """``routing.rows_of`` rank q's experts."""
        return routing.rows_of(self.first[q], self.sizes[q])

    # --- ring: the experts travel ---

    def numel(self, n_experts: int) -> int:
        return n_experts * sum(self.per_expert)

    def views(self, flat: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, ...]:
        """The weights of ``n_experts`` experts (as ``ws``: ``[G; U]`` ``[n_e, 2F, h]`` and
        ``Dn [n_e, h, F]``, ...) laid end to end in a ring buffer."""
        out, start = [], 0
        for shape, n in zip(self.shapes, self.per_expert):
            out.append(flat[start : start + n_experts * n].view(n_experts, *shape))
            start += n_experts * n
        return tuple(out)

    def shards(self, ws):
        """Yield ``(t, q, ws_q)`` of owner q = p - t (views of the ring buffer, valid until the
        next step); the next owner's experts arrive while the caller works."""
        packed = comm.pack(list(ws), numel=self.numel(max(self.sizes)))
        overlap = self.options.overlap
        for t, cur in circulate(comm.Ring(self.group), packed, overlap, reuse=True):
            q = (self.p - t) % self.D
            yield t, q, self.views(cur, self.sizes[q])

    # --- all-to-all: the tokens travel ---

    def exchange(self, routing: Routing) -> _Exchange:
        """The dispatch of this call's assignments (rows sorted by expert, hence by owner),
        made once (one all-to-all of the counts) and kept on ``routing``."""
        if routing.dispatch is None:
            send = [sum(routing.counts[f : f + n]) for f, n in zip(self.first, self.sizes)]
            counts = torch.tensor(routing.counts, dtype=torch.long, device=routing.slots.device)
            got = comm.all_to_all(counts, self.sizes, [self.sizes[self.p]] * self.D, self.group)
            got = got.view(self.D, self.sizes[self.p]).tolist()
            routing.dispatch = _Exchange(send, got, self.p, self.group)
        return routing.dispatch


class _Exchange:
    """One all-to-all dispatch: ``send [D]`` rows to each owner and ``got [D][E_p]`` rows of
    each source for each of this rank's experts. Received rows come by source, and within a
    source by expert; this rank's own rows never wait for the network (``local``: their offset
    in the send buffer)."""

    def __init__(self, send: list[int], got: list[list[int]], p: int, group) -> None:
        self.send, self.got, self.p, self.group = send, got, p, group
        self.recv = [sum(g) for g in got]
        self.local = sum(send[:p]) - sum(self.recv[:p])  # send offset minus receive offset

    def post(self, t: torch.Tensor) -> tuple[torch.Tensor, comm.Pending]:
        """Send rows ``t`` (in send order) to their owners, asynchronously."""
        return comm.all_to_all(t, self.send, self.recv, self.group, async_op=True)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        """Return rows ``t`` (in receive order) to where they came from."""
        return comm.all_to_all(t, self.recv, self.send, self.group)

    def in_order(self):
        """``(rows, counts, own)`` of each source's block (``counts``: its rows for each of
        this rank's experts): this rank's own first (``own``: ``rows`` shifted into the send
        buffer), then the received ones; in between one ``(None, None, None)``, where the
        caller waits for the transfer."""
        starts = [sum(self.recv[:r]) for r in range(len(self.recv))]
        block = [slice(s, s + n) for s, n in zip(starts, self.recv)]
        rows = block[self.p]
        yield rows, self.got[self.p], slice(rows.start + self.local, rows.stop + self.local)
        yield None, None, None
        for r in range(len(self.recv)):
            if r != self.p:
                yield block[r], self.got[r], None


def _add_experts(y, x2, routing: Routing, rows: slice, *, counts, ws, scale, kind) -> None:
    """``y[token] += scale · FFN_e(x2[token])`` (``y`` in the accumulation dtype) for the
    assignments ``rows`` of ``routing``, ``counts`` of them for each expert of ``ws``."""
    if rows.stop > rows.start:
        tokens = routing.tokens[rows]
        out = _ffn(x2.index_select(0, tokens), ws, counts, kind=kind, acc=y.dtype)
        y.index_add_(0, tokens, out.mul_(scale[rows, None]))


def _ring_forward(lay: _Experts, x2, ws, routing, scale):
    y = torch.zeros(x2.shape, dtype=lay.acc, device=x2.device)
    for _, q, wq in lay.shards(ws):
        rows, counts = lay.owned(routing, q)
        _add_experts(y, x2, routing, rows, counts=counts, ws=wq, scale=scale, kind=lay.kind)
    return y


def _ring_backward(lay: _Experts, dy2, x2, ws, routing, scale, weight_grads):
    dx = torch.zeros(x2.shape, dtype=lay.acc, device=x2.device)
    d_scale = torch.zeros_like(scale)
    owner_grads = GradientRing(comm.Ring(lay.group))
    numel = lay.numel(max(lay.sizes))
    for t, q, wq in lay.shards(ws):
        grads = None
        if weight_grads:
            share = torch.zeros(numel, dtype=lay.acc, device=x2.device)
            grads = lay.views(share, lay.sizes[q])
        rows, counts = lay.owned(routing, q)
        if rows.stop > rows.start:
            tokens = routing.tokens[rows]
            xe, dye = x2.index_select(0, tokens), dy2.index_select(0, tokens)
            dxe, d_scale[rows] = _ffn_backward(
                xe, dye, scale[rows], wq, counts=counts, kind=lay.kind, acc=lay.acc, grads=grads
            )
            dx.index_add_(0, tokens, dxe)
        if weight_grads:
            owner_grads.add(t, share)  # on its way while the next owner's experts are used
    own = lay.views(owner_grads.result(), lay.sizes[lay.p]) if weight_grads else None
    return dx, d_scale, own


def _all_to_all_forward(lay: _Experts, x2, ws, routing, scale):
    ex = lay.exchange(routing)
    sent = x2.index_select(0, routing.tokens)
    rows, arriving = ex.post(sent)
    out = torch.empty(rows.shape, dtype=lay.acc, device=x2.device)
    for r, counts, own in ex.in_order():
        if r is None:
            arriving.wait()
            continue
        src = sent[own] if own is not None else rows[r]
        out[r] = _ffn(src, ws, counts, kind=lay.kind, acc=lay.acc)
    y = torch.zeros(x2.shape, dtype=lay.acc, device=x2.device)
    return y.index_add_(0, routing.tokens, ex.back(out).mul_(scale[:, None]))


def _all_to_all_backward(lay: _Experts, dy2, x2, ws, routing, scale, weight_grads):
    ex, h = lay.exchange(routing), lay.h
    sent = [t.index_select(0, routing.tokens) for t in (x2, dy2)] + [scale]
    posted = [ex.post(t) for t in sent]
    grads = None
    if weight_grads:
        grads = tuple(torch.zeros_like(t, dtype=lay.acc) for t in ws)
    out = torch.empty(posted[0][0].shape[0], h + 1, dtype=lay.acc, device=x2.device)  # [dX|dw]
    for r, counts, own in ex.in_order():
        if r is None:
            for _, arriving in posted:
                arriving.wait()
            continue
        x, dy, w = (t[own] for t in sent) if own is not None else (t[r] for t, _ in posted)
        out[r, :h], out[r, h] = _ffn_backward(
            x, dy, w, ws, counts=counts, kind=lay.kind, acc=lay.acc, grads=grads
        )
    back = ex.back(out)
    dx = torch.zeros(x2.shape, dtype=lay.acc, device=x2.device)
    dx.index_add_(0, routing.tokens, back[:, :h])
    return dx, back[:, h].contiguous(), grads


_FORWARD = {"ring": _ring_forward, "all_to_all": _all_to_all_forward}
_BACKWARD = {"ring": _ring_backward, "all_to_all": _all_to_all_backward}


class _ExpertsFunction(torch.autograd.Function):
    """Autograd boundary of both schedules: saves X_p (as its RMSNorm's input when it is a
    norm's output: ``pointwise.to_save``), the routing (its sorted ``slots [n·k]``, and the
    weights ``[n, k]``) and the rank's own experts ``ws``."""

    @staticmethod
    def forward(ctx, lay: _Experts, x, index, weight, *ws):
        routing = Routing.of(index, lay.n_experts)
        scale = weight.reshape(-1)[routing.slots].to(lay.acc)
        y = _FORWARD[lay.schedule](lay, x.reshape(-1, lay.h), ws, routing, scale)
        ctx.lay = lay
        ctx.routing = (routing.k, routing.counts, routing.dispatch)  # python ints, no tensor
        saved, norm_weight, ctx.norm = to_save(x)
        ctx.save_for_backward(saved, norm_weight, routing.slots, weight, *ws)
        return y.to(x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, slots, weight, *ws = ctx.saved_tensors
        lay = ctx.lay
        x = from_saved(x, norm_weight, ctx.norm)
        routing = Routing(slots, *ctx.routing)
        scale = weight.reshape(-1)[routing.slots].to(lay.acc)
        weight_grads = any(ctx.needs_input_grad[4:])
        dx, d_scale, grads = _BACKWARD[lay.schedule](
            lay, dy.reshape(-1, lay.h), x.reshape(-1, lay.h), ws, routing, scale, weight_grads
        )
        d_weight = torch.zeros_like(scale).index_put_((routing.slots,), d_scale)
        d_weight = d_weight.view(weight.shape).to(weight.dtype)
        d_ws = [None] * len(ws) if grads is None else [g.to(t.dtype) for g, t in zip(grads, ws)]
        return (None, dx.to(x.dtype).view(x.shape), None, d_weight, *d_ws)


class _RouterLogits(torch.autograd.Function):
    """``x·Wᵀ (+ b)`` ``[n, E]`` of ``x [B, T, h]``, saving x as its RMSNorm's input when it is a
    norm's output (``pointwise.to_save``): the router (and Qwen2-MoE's shared-expert gate)
    adds no ``[B, T, h]`` tensor to what a layer saves."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        saved, norm_weight, ctx.norm = to_save(x)
        ctx.save_for_backward(saved, norm_weight, weight)
        logits = x.reshape(-1, x.shape[-1]) @ weight.t()
        return logits if bias is None else logits + bias

    @staticmethod
    def backward(ctx, d_logits):
        x, norm_weight, weight = ctx.saved_tensors
        x = from_saved(x, norm_weight, ctx.norm)
        dx = (d_logits @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = d_logits.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = d_logits.sum(dim=0) if ctx.needs_input_grad[2] else None
        return dx, dw, db


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The router's logits ``[B·T, E]`` of tokens ``x [B, T, h]`` (``weight [E, h]``, gpt-oss's
    ``bias [E]``)."""
    return _RouterLogits.apply(x, weight, bias)


def tsp_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    *,
    ws: tuple[torch.Tensor, ...],
    spec: ExpertsSpec,
) -> torch.Tensor:
    """Routed experts of this rank's tokens: ``x [B, S/D, h]`` -> ``[B, S/D, h]``, each token the
    sum of its experts ``index [n, k]`` (``n = B·S/D``, rows in x's order) times their routing
    weights ``weight [n, k]`` (differentiable). ``ws``: this rank's experts of the layer
    ``spec`` (``split_range``), ``(gate_up [E_p, 2F, h], down [E_p, h, F])``, or gpt-oss's four
    (``moe_clamped``)."""
    lay = _Experts(spec, x, ws, index)
    return _ExpertsFunction.apply(lay, x, index, weight, *ws)


def decode_experts(x, index, weight, *, ws, spec: ExpertsSpec):
    """Routed experts of the replicated decode tokens ``x [B, Tq, h]`` (routing ``index, weight
    [B·Tq, k]``, the same on every rank): each rank adds its experts' rows (``ws``, as
    ``tsp_experts``), then one all-reduce; ``[B, Tq, h]`` in x's dtype, identical on every
    rank."""
    D, p = comm.size_and_rank(spec.group)
    x2 = x.reshape(-1, x.shape[-1])
    routing = Routing.of(index, spec.n_experts)
    acc = spec.options.accum_for(x.dtype)
    scale = weight.reshape(-1)[routing.slots].to(acc)
    y = torch.zeros(x2.shape, dtype=acc, device=x.device)
    first = split_range(spec.n_experts, D, p).start
    rows, counts = routing.rows_of(first, ws[0].shape[0])
    _add_experts(y, x2, routing, rows, counts=counts, ws=ws, scale=scale, kind=spec.activation)
    comm.all_reduce(y, spec.group)
    return y.to(x.dtype).view(x.shape)
