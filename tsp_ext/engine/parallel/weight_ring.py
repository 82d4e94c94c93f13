"""Weight shards circulating on the TSP ring, and their gradients travelling back to the owners;
or broadcast by their owners in turn (``broadcast_stream``, the attention's head groups).

The gated MLP and the vocab-sharded LM head share this pattern::

    for t, shard in circulate(ring, mine):   # the shard of owner p - t; the next one is in flight
        ...compute this rank's tokens with it...
        grads.add(t, d_shard)                 # backward: this rank's share of that shard's grad
    own = grads.result()                      # my shard's gradient, summed over all D ranks

``GradientRing`` runs one step behind the shards: at step t >= 1 rank p adds its share for shard
p - t to the accumulator it received from rank p - 1 (the shares of steps < t) and passes it on,
so after the last hop every accumulator lands at its owner, who adds its own step-0 share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..adapters.nf4 import ShardCodec
from . import comm
from .comm import Ring


def circulate(
    ring: Ring,
    shard: torch.Tensor,
    overlap: bool = True,
    reuse: bool = False,
    steps: int | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(t, shard of owner p - t)`` for t = 0..steps-1 (default D steps, every shard);
    the next shard arrives while the caller works on the current one (``overlap=False``: it
    arrives before).

    The yielded tensor is only valid until the next step. ``shard`` is never written unless
    ``reuse`` (then it serves as a receive buffer, saving one shard-sized allocation).
    """
    steps = ring.size if steps is None else steps
    cur, spare = shard.contiguous(), None
    for t in range(steps):
        if t == steps - 1:
            yield t, cur
            return
        nxt = spare if spare is not None else torch.empty_like(cur)
        handle = ring.shift(cur, nxt)
        if not overlap:
            handle.wait()
        yield t, cur
        handle.wait()
        spare = cur if (reuse or t > 0) else None
        cur = nxt


class GradientRing:
    """Accumulates shard gradients around the ring so that each lands, fully summed, at its owner.

    Call ``add(t, share)`` once per step, in step order, with this rank's gradient share of the
    shard it saw at step t (``share`` is consumed: it may become the accumulator sent on).
    """

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self._own: torch.Tensor | None = None
        self._in_flight = None  # (accumulator being sent, buffer receiving rank p-1's, handle)

    def add(self, t: int, share: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """``scale`` (0-dim): add ``share · scale`` instead, leaving ``share`` unwritten."""
        if t == 0:  # the owner's own share joins its accumulator at the very end
            self._own = share if scale is None else share * scale
            return
        if self._in_flight is None:
            acc = share if scale is None else share * scale
        else:  # the accumulator of shard p - t, from rank p-1's step t-1
            _, acc, handle = self._in_flight
            handle.wait()
            if scale is None:
                acc.add_(share)
            else:
                acc.addcmul_(share, scale)
        received = torch.empty_like(acc)
        self._in_flight = (acc, received, self.ring.shift(acc, received))

    def result(self) -> torch.Tensor:
        """This rank's shard gradient, with every rank's share (waits for the last hop)."""
        if self._in_flight is not None:
            _, received, handle = self._in_flight
            handle.wait()
            self._own += received
            self._in_flight = None
        return self._own


def broadcast_stream(
    own: dict[str, torch.Tensor],
    shapes: Callable[[int, list[str]], list[torch.Size]],
    group,
    overlap: bool = True,
    outgoing: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    codec: ShardCodec | None = None,
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield ``(r, W_r)`` for r = 0..D-1, the shards of rank r broadcast by it; W_{r+1} is
    broadcast while the caller works on W_r (``overlap=False``: it arrived before).

    Every rank passes its own shards ``own`` (the same names everywhere); ``shapes(r, names)``
    gives rank r's sizes of ``names`` (owners' shards may differ, e.g. head groups by one head).
    Shards of different dtypes (adapters kept wider than a half-precision base, NF4-packed bytes)
    travel in one buffer per dtype; ``codec`` says which travel packed (dequantized on arrival).
    ``outgoing(own)``: this rank's shards as it sends them (default ``own``; e.g. merged with
    their adapters), made when its turn comes."""
    D, p = comm.size_and_rank(group)
    codec = codec or ShardCodec({}, torch.float32)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n, t in own.items():
        by_dtype.setdefault(t.dtype, []).append(n)
    parts = list(by_dtype.values())
    sizes = [dict(zip(own, shapes(r, list(own)))) for r in range(D)]
    wire = [[[codec.on_wire(n, sizes[r][n]) for n in names] for names in parts] for r in range(D)]

    def post(r: int):
        posted = []
        sending = (outgoing(own) if outgoing else own) if r == p else None
        for names, shape in zip(parts, wire[r]):
            if sending is not None:
                buf = comm.pack([sending[n] for n in names])
            else:
                buf = own[names[0]].new_empty(sum(s.numel() for s in shape))
            posted.append((buf, comm.broadcast(buf, r, group, async_op=True)))
        return posted

    def wait(posted) -> None:
        for _, handle in posted:
            handle.wait()

    nxt = post(0)
    for r in range(D):
        cur = nxt
        wait(cur)
        if r + 1 < D:
            nxt = post(r + 1)
            if not overlap:
                wait(nxt)
        w = {}
        for names, shape, (buf, _) in zip(parts, wire[r], cur):
            w.update(zip(names, comm.unpack(buf, shape)))
        codec.arrived(w, sizes[r])
        yield r, w
