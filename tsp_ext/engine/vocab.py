"""Vocabulary-sharded embedding and LM head on the TSP axis.

Rank p keeps the contiguous rows ``offsets[p] .. offsets[p+1]`` (``V_p`` = ``⌊V/D⌋`` or ``⌈V/D⌉``
of them, the first ``V mod D`` ranks one more) of the embedding and of the LM head (one tensor
when they are tied). No rank ever holds a full table or the full-vocabulary logits of its tokens.

Embedding — an exchange of rows, not of tables. Each rank sends every owner the distinct ids of
its tokens that fall in the owner's rows (all-to-all of ids); the owners answer with those rows
(all-to-all of ``U x h``); backward sends the row gradients back the same way and the owners
``index_add`` them. Per rank and direction that moves (distinct local ids) x h elements, where
circulating the tables would move (D-1)/D · V x h: at S/D = 16K tokens and V = 128K, 8x more.

LM head + cross-entropy — a ring, as in the MLP. The LM-head shards travel the ring while each
rank keeps, per local token, an online log-sum-exp (running max and sum of exponentials) and the
target's logit, in float32 at least::

    for t in 0..D-1:                          # shard W_q of owner q = p - t; the next in flight
        for each block c of loss_chunk tokens:
            z = H_c · W_qᵀ                    # [chunk, V_q]: the only logits that ever exist
            fold z into (max, sumexp); take z[target] where the target is one of q's rows
    loss_p = Σ_valid (max + log sumexp - z_target)

Backward makes a second pass of the ring, recomputing z block by block: dZ = softmax(z) - onehot,
dH_c += dZ · W_q, and W_q's gradient share travels a gradient ring to its owner. The last shard
of the forward ring (t = D-1) is the exception: when its block is folded in, those tokens'
log-sum-exp is final, so a loss that will be differentiated takes that shard's dZ there and then
(unscaled; backward multiplies by the incoming gradient) and backward's ring visits only D-1
shards: 1/D of the logits are never recomputed and the weights make one hop fewer. Saved per
rank: H_p, the labels, one log-sum-exp per token and the last shard's shares ``dH [N, h]`` and
``dW [V/D, h]`` (float32 at least; backward would allocate the same accumulators first thing).
Per-token log-probabilities (``ring_token_logps``: DPO's sequence log-probs) fold the same
statistics and return ``z_target - lse`` per token, with optional no-grad statistics of each
token's distribution (entropy, ...) folded alongside; their gradients differ per token, so that
backward visits all D shards. Shards of unequal size travel in buffers of the largest one; only
the owner's real rows ever make logits, so padding never reaches the loss and gets no gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels.pointwise import add_matmul
from .options import EngineOptions
from .parallel import comm
from .parallel.weight_ring import GradientRing, circulate


@dataclass(frozen=True)
class VocabShards:
    """A vocabulary sharded on a TSP ``group``: ``offsets [D + 1]``, the first row of every
    rank's shard, then V (``partition.split_offsets``); the engine ``options`` (the LM head's:
    ``loss_chunk``, ``overlap``, accumulation dtype)."""

    offsets: list[int]
    group: object
    options: EngineOptions | None = None


# --- embedding: all-to-all exchange of the rows each rank needs ------------------------------


class _EmbeddingExchange(torch.autograd.Function):
    """``ids [B, T]``, rows ``offsets[p]:offsets[p+1]`` of the table, ``[V_p, h]`` -> embeddings
    ``[B, T, h]``."""

    @staticmethod
    def forward(ctx, ids, weight, shards: VocabShards, padding_idx):
        offsets, group = shards.offsets, shards.group
        D, p = comm.size_and_rank(group)
        uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)  # sorted by owner
        if uniq[0] < 0 or uniq[-1] >= offsets[-1]:
            raise ValueError(
                f"input_ids must be in [0, {offsets[-1]}), got ids from {uniq[0].item()} to "
                f"{uniq[-1].item()}"
            )
        bounds = torch.tensor(offsets[1:-1], dtype=uniq.dtype, device=uniq.device)
        send = torch.bincount(torch.bucketize(uniq, bounds, right=True), minlength=D)
        recv = comm.all_to_all(send, [1] * D, [1] * D, group)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        wanted = comm.all_to_all(uniq, send_counts, recv_counts, group) - offsets[p]
        found = comm.all_to_all(weight.detach()[wanted], recv_counts, send_counts, group)
        ctx.save_for_backward(inverse, wanted)
        ctx.meta = (group, send_counts, recv_counts, padding_idx, offsets[p])
        ctx.weight_meta = (weight.shape, weight.dtype)
        return found[inverse].view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[1]:  # a frozen table (LoRA): nothing to send back
            return None, None, None, None
        inverse, wanted = ctx.saved_tensors
        group, send_counts, recv_counts, padding_idx, first = ctx.meta
        shape, dtype = ctx.weight_meta
        acc = torch.promote_types(grad.dtype, torch.float32)
        grad = grad.reshape(-1, shape[1]).to(acc)
        d_uniq = grad.new_zeros(sum(send_counts), shape[1]).index_add_(0, inverse, grad)
        d_wanted = comm.all_to_all(d_uniq, send_counts, recv_counts, group)
        d_weight = d_uniq.new_zeros(shape).index_add_(0, wanted, d_wanted)
        if padding_idx is not None and 0 <= padding_idx - first < shape[0]:
            d_weight[padding_idx - first] = 0  # as nn.Embedding: the padding row gets no gradient
        return None, d_weight.to(dtype), None, None


# --- LM head: the shards circulate, logits exist one [chunk, V/D] block at a time -------------


class _HeadRing:
    """One call's schedule: LM-head shards on the ring (in buffers of the largest shard, ``V_max``
    rows), local tokens in blocks."""

    def __init__(self, shards: VocabShards, h: torch.Tensor, weight_grad=True) -> None:
        self.channel = comm.Ring(shards.group)
        options, offsets = shards.options, shards.offsets
        self.options, self.offsets = options, offsets
        self.max_rows = max(b - a for a, b in zip(offsets, offsets[1:]))
        self.acc = options.accum_for(h.dtype)
        self.weight_grad = weight_grad  # False: a frozen head (LoRA), no dW GEMM or ring

    def shards(
        self, weight: torch.Tensor, steps: int | None = None
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(t, first vocabulary row, shard [V_q, h])`` of owner q = p - t, for the first
        ``steps`` steps (default: all D)."""
        D, p = self.channel.size, self.channel.rank
        w = weight.detach()
        if w.shape[0] < self.max_rows:  # a padded copy: every ring buffer has V_max rows
            w = torch.cat([w, w.new_zeros(self.max_rows - w.shape[0], w.shape[1])])
        for t, buf in circulate(self.channel, w, self.options.overlap, steps=steps):
            q = (p - t) % D
            yield t, self.offsets[q], buf[: self.offsets[q + 1] - self.offsets[q]]

    def blocks(self, n: int) -> Iterator[slice]:
        chunk = self.options.loss_chunk
        return (slice(i, min(i + chunk, n)) for i in range(0, n, chunk))

    @staticmethod
    def targets(labels: torch.Tensor, first: int, rows: int, valid: torch.Tensor):
        """Column of each label in the ``rows``-row shard starting at ``first`` (clamped) and
        whether it is there."""
        col = labels - first
        hit = valid & (col >= 0) & (col < rows)
        return col.clamp(0, rows - 1).unsqueeze(1), hit

    def zeros(self, rows: int, h: torch.Tensor) -> torch.Tensor:
        """A zeroed ``[rows, h]`` gradient accumulator in the accumulation dtype."""
        return torch.zeros(rows, h.shape[1], dtype=self.acc, device=h.device)

    @staticmethod
    def accumulate(dh, dw, h: torch.Tensor, c: slice, *, dz: torch.Tensor, w: torch.Tensor):
        """Add the logits-block gradient ``dz [c, V_q]`` (``h``'s dtype) of tokens ``c`` against
        shard ``w [V_q, h]`` into ``dh [N, h]`` and the first V_q rows of ``dw`` (None: no
        weight gradient)."""
        add_matmul(dh[c], dz, w)
        if dw is not None:
            add_matmul(dw[: w.shape[0]], dz.t(), h[c])

    def backward(self, h: torch.Tensor, weight: torch.Tensor, block_grad: Callable, last=None):
        """Second ring pass: ``(dH [N, h], dW [V_p, h])`` given ``block_grad(first, c, W_q)``,
        the gradient of the logits block ``[c, first : first + V_q]``, in ``h``'s dtype.
        ``last = (dH, dW, scale)``: the last shard's shares, taken in forward, times ``scale``;
        the pass then visits the first D-1 shards only."""
        D = self.channel.size
        if last is None:
            dh, steps = self.zeros(h.shape[0], h), D
        else:
            dh_last, dw_last, scale = last
            dh, steps = dh_last * scale, D - 1
        owner_grads = GradientRing(self.channel)
        for t, first, w in self.shards(weight, steps):
            dw = self.zeros(self.max_rows, h) if self.weight_grad else None
            for c in self.blocks(h.shape[0]):
                self.accumulate(dh, dw, h, c, dz=block_grad(first, c, w), w=w)
            if dw is not None:
                owner_grads.add(t, dw)
        if not self.weight_grad:
            return dh.to(h.dtype), None
        if last is not None:
            owner_grads.add(D - 1, dw_last, scale=scale)
        dw = owner_grads.result()[: weight.shape[0]]  # padded rows: never any gradient
        return dh.to(h.dtype), dw.to(weight.dtype)


class _OnlineSoftmax:
    """Per-token statistics of the logits ``z [N, V]`` folded in shard by shard and block by block
    (``fold``), in the accumulation dtype: running max and sum of exponentials (the log-sum-exp),
    the target's logit, and on request the sums behind ``stats`` (``STATS``)."""

    def __init__(self, n: int, acc: torch.dtype, device, stats: tuple[str, ...] = ()) -> None:
        def zeros():
            return torch.zeros(n, dtype=acc, device=device)

        self.stats = stats
        self.max = torch.full((n,), float("-inf"), dtype=acc, device=device)
        self.sum, self.target = zeros(), zeros()
        self.weighted = zeros() if "entropy" in stats else None  # Σ e^(z - max) · z
        self.squares = zeros() if "log_sum_sq_probs" in stats else None  # Σ e^(2 (z - max))
        self.total = zeros() if "mean_logits" in stats else None  # Σ z

    def fold(self, c: slice, z: torch.Tensor, col: torch.Tensor, hit: torch.Tensor):
        """Fold the block ``z [c, V_q]`` in (``col, hit``: ``_HeadRing.targets`` of its rows);
        returns ``exp(z - max)`` with the updated max (in ``z``'s memory unless stats need z)."""
        self.target[c] += torch.where(hit, z.gather(1, col).squeeze(1), 0)
        if self.total is not None:
            self.total[c] += z.sum(-1)
        new_max = torch.maximum(self.max[c], z.amax(-1))
        rescale = torch.exp(self.max[c] - new_max)
        if self.weighted is None:
            e = z.sub_(new_max[:, None]).exp_()
        else:
            e = (z - new_max[:, None]).exp_()
            self.weighted[c] = self.weighted[c] * rescale + (e * z).sum(-1)
        if self.squares is not None:
            self.squares[c] = self.squares[c] * rescale.square() + e.square().sum(-1)
        self.sum[c] = self.sum[c] * rescale + e.sum(-1)
        self.max[c] = new_max
        return e

    def lse(self) -> torch.Tensor:
        return self.max + torch.log(self.sum)

    def results(self, lse: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
        """The requested per-token statistics of the full vocabulary."""
        formulas = {
            "entropy": lambda: lse - self.weighted / self.sum,
            "log_sum_sq_probs": lambda: torch.log(self.squares) - 2 * torch.log(self.sum),
            "mean_logits": lambda: self.total / vocab_size,
            "is_top1": lambda: self.target >= self.max,
        }
        return {k: formulas[k]() for k in self.stats}


def _nll_block_grad(ring: _HeadRing, h, labels, *, valid, lse, coef) -> Callable:
    """``block_grad`` for ``_HeadRing.backward`` of ``Σ coef_i · (lse_i - z_i[label_i])``:
    ``(softmax - onehot) · coef`` of each logits block, recomputed."""

    def block_grad(first, c, w):
        col, hit = ring.targets(labels[c], first, w.shape[0], valid[c])
        dz = F.linear(h[c], w).to(ring.acc)
        dz.sub_(lse[c, None]).exp_().mul_(coef[c, None])  # softmax · coef, in place
        dz.scatter_add_(1, col, -(coef[c] * hit)[:, None])  # - onehot(target) · coef
        return dz.to(h.dtype)

    return block_grad


@dataclass(frozen=True)
class _Targets:
    """What a loss call of the ring head has besides its tensors: the vocabulary ``shards``, the
    label to ignore, whether the loss will be differentiated (``_RingCrossEntropy`` then takes
    the last shard's gradient shares in forward) and the requested ``STATS``
    (``_RingTokenLogProbs``)."""

    shards: VocabShards
    ignore_index: int
    differentiated: bool = False
    stats: tuple[str, ...] = ()


class _RingCrossEntropy(torch.autograd.Function):
    """``H [N, h]``, ``labels [N]`` -> sum of the cross-entropy of the valid local tokens."""

    @staticmethod
    def forward(ctx, targets: _Targets, h, labels, weight):
        ring = _HeadRing(targets.shards, h, ctx.needs_input_grad[3])
        ignore_index, differentiated = targets.ignore_index, targets.differentiated
        valid = labels != ignore_index
        n = h.shape[0]
        soft = _OnlineSoftmax(n, ring.acc, h.device)
        last = ()
        for t, first, w in ring.shards(weight):
            col, hit = ring.targets(labels, first, w.shape[0], valid)
            final = differentiated and t == ring.channel.size - 1
            if final:  # the last shard's gradient shares, unscaled
                dw_last = ring.zeros(ring.max_rows, h) if ring.weight_grad else None
                last = (ring.zeros(n, h), dw_last)
            for c in ring.blocks(n):
                e = soft.fold(c, F.linear(h[c], w).to(ring.acc), col[c], hit[c])
                if final:  # these tokens' log-sum-exp is final: dZ = softmax - onehot, in place
                    dz = e.div_(soft.sum[c, None]).mul_(valid[c, None])
                    dz.scatter_add_(1, col[c], -hit[c, None].to(dz.dtype))
                    ring.accumulate(*last, h, c, dz=dz.to(h.dtype), w=w)
        lse = soft.lse()
        ctx.save_for_backward(h, labels, lse, weight, *last)
        ctx.ring, ctx.ignore_index = ring, ignore_index
        return torch.where(valid, lse - soft.target, 0).sum()

    @staticmethod
    def backward(ctx, grad):
        h, labels, lse, weight, *last = ctx.saved_tensors
        ring = ctx.ring
        valid = labels != ctx.ignore_index
        coef = torch.where(valid, grad.to(ring.acc), 0)  # d loss / d (lse - z_target), per token
        block_grad = _nll_block_grad(ring, h, labels, valid=valid, lse=lse, coef=coef)
        dh, dw = ring.backward(h, weight, block_grad, (*last, grad) if last else None)
        return None, dh, None, dw


class _RingTokenLogProbs(torch.autograd.Function):
    """``H [N, h]``, ``labels [N]`` -> ``log softmax(H·Wᵀ)[label]`` ``[N]`` (0 for ignored
    labels), then the requested ``STATS`` ``[N]`` (no gradient). Unlike the summed loss, the
    per-token gradients differ, so backward's ring recomputes every shard's logits."""

    @staticmethod
    def forward(ctx, targets: _Targets, h, labels, weight):
        ring = _HeadRing(targets.shards, h, ctx.needs_input_grad[3])
        ignore_index = targets.ignore_index
        valid = labels != ignore_index
        soft = _OnlineSoftmax(h.shape[0], ring.acc, h.device, targets.stats)
        for _, first, w in ring.shards(weight):
            col, hit = ring.targets(labels, first, w.shape[0], valid)
            for c in ring.blocks(h.shape[0]):
                soft.fold(c, F.linear(h[c], w).to(ring.acc), col[c], hit[c])
        lse = soft.lse()
        ctx.save_for_backward(h, labels, lse, weight)
        ctx.ring, ctx.ignore_index = ring, ignore_index
        extra = [
            s & valid if s.dtype == torch.bool else torch.where(valid, s, 0)
            for s in soft.results(lse, ring.offsets[-1]).values()
        ]
        ctx.mark_non_differentiable(*extra)
        return (torch.where(valid, soft.target - lse, 0), *extra)

    @staticmethod
    def backward(ctx, grad, *_):
        h, labels, lse, weight = ctx.saved_tensors
        ring = ctx.ring
        valid = labels != ctx.ignore_index
        coef = torch.where(valid, -grad.to(ring.acc), 0)  # log p = -(lse - z_target)
        block_grad = _nll_block_grad(ring, h, labels, valid=valid, lse=lse, coef=coef)
        dh, dw = ring.backward(h, weight, block_grad)
        return None, dh, None, dw


class _RingLogits(torch.autograd.Function):
    """``H [N, h]`` -> the full-vocabulary logits ``[N, V]`` of the local tokens (explicit)."""

    @staticmethod
    def forward(ctx, shards: VocabShards, h, weight):
        ring = _HeadRing(shards, h, ctx.needs_input_grad[2])
        out = h.new_empty(h.shape[0], shards.offsets[-1])
        for _, first, w in ring.shards(weight):
            out[:, first : first + w.shape[0]] = F.linear(h, w)
        ctx.save_for_backward(h, weight)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors

        def block_grad(first, c, w):
            return grad[c, first : first + w.shape[0]]

        dh, dw = ctx.ring.backward(h, weight, block_grad)
        return None, dh, dw


def embedding_exchange(
    ids: torch.Tensor, weight: torch.Tensor, shards: VocabShards, padding_idx: int | None = None
) -> torch.Tensor:
    """Embeddings ``[B, T, h]`` of ``ids [B, T]`` from vocabulary-row shards ``weight [V_p, h]``
    (``shards.options`` unused); ``padding_idx``: the row that gets no gradient."""
    return _EmbeddingExchange.apply(ids, weight, shards, padding_idx)


def ring_cross_entropy(
    h: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    shards: VocabShards,
    *,
    ignore_index: int,
) -> torch.Tensor:
    """Sum over the labelled local tokens of ``-log softmax(h·Wᵀ)[label]``: ``h [N, h]``,
    ``labels [N]`` (already shifted), LM-head rows ``weight [V_p, h]`` of ``shards``; no full
    logits."""
    differentiated = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    targets = _Targets(shards, ignore_index, differentiated=differentiated)
    return _RingCrossEntropy.apply(targets, h, labels, weight)


STATS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def ring_token_logps(
    h: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    shards: VocabShards,
    *,
    ignore_index: int,
    stats: tuple[str, ...] = (),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token ``log softmax(h·Wᵀ)[label]`` ``[N]`` of the local tokens (0 where the label is
    ``ignore_index``; differentiable), and the requested ``stats`` ``[N]`` of each token's
    next-token distribution, without gradient: ``entropy``, ``log_sum_sq_probs`` (log Σ p²),
    ``mean_logits`` (over the vocabulary), ``is_top1`` (the label is the most likely token).
    Arguments as for ``ring_cross_entropy``; no full logits."""
    unknown = set(stats) - set(STATS)
    if unknown:
        raise ValueError(f"unknown token statistics {sorted(unknown)}: choose from {STATS}")
    targets = _Targets(shards, ignore_index, stats=tuple(stats))
    logp, *extra = _RingTokenLogProbs.apply(targets, h, labels, weight)
    return logp, dict(zip(stats, extra))


def ring_logits(h: torch.Tensor, weight: torch.Tensor, shards: VocabShards) -> torch.Tensor:
    """Full-vocabulary logits ``[N, V]`` of the local tokens ``h [N, h]``, shard by shard."""
    return _RingLogits.apply(shards, h, weight)
