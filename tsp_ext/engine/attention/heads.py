"""Head layout of an attention layer on the TSP axis: which query and KV heads each group holds.

Group p holds a contiguous block of ``⌊n_heads/D⌋`` or ``⌈n_heads/D⌉`` query heads (the first
``n_heads mod D`` groups one more) and every KV head those use. Examples (query heads / KV heads):

    9 / 3 at D = 2:  group 0 = q 0-4 -> kv 0, 1;  group 1 = q 5-8 -> kv 1, 2  (kv 1 on both)
    8 / 2 at D = 4:  q 0-1 -> kv 0, q 2-3 -> kv 0, q 4-5 -> kv 1, q 6-7 -> kv 1  (replicas)

A group's shards travel by name; ``SHARDS`` says what each name is (its kind and projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from ..sharding.partition import split_range


class ShardKind(Enum):
    """What a head-group shard holds."""

    WEIGHT = "weight"  # a projection's rows (o_proj: its columns)
    BIAS = "bias"  # a projection's bias rows
    LORA = "lora"  # an adapter's piece: the B rows of q/k/v, o's A columns


class Shard(NamedTuple):
    """A head-group shard: its ``kind`` and its ``projection`` (``q``, ``k``, ``v``, ``o``, or
    ``g``: Qwen3-Next's output gate)."""

    kind: ShardKind
    projection: str


# The schedule's names of one head group's shards (the tensors travel by these names).
SHARDS: dict[str, Shard] = {
    "wq": Shard(ShardKind.WEIGHT, "q"),
    "wk": Shard(ShardKind.WEIGHT, "k"),
    "wv": Shard(ShardKind.WEIGHT, "v"),
    "wo": Shard(ShardKind.WEIGHT, "o"),
    "wg": Shard(ShardKind.WEIGHT, "g"),
    "bq": Shard(ShardKind.BIAS, "q"),
    "bk": Shard(ShardKind.BIAS, "k"),
    "bv": Shard(ShardKind.BIAS, "v"),
    "lq": Shard(ShardKind.LORA, "q"),
    "lk": Shard(ShardKind.LORA, "k"),
    "lv": Shard(ShardKind.LORA, "v"),
    "lo": Shard(ShardKind.LORA, "o"),
}
_NAMES = {shard: name for name, shard in SHARDS.items()}


def shard_name(kind: ShardKind, projection: str) -> str:
    """The name of ``projection``'s shard of ``kind`` (``SHARDS``' inverse)."""
    return _NAMES[Shard(kind, projection)]


QKV = ("q", "k", "v")
QKV_WEIGHTS = tuple(shard_name(ShardKind.WEIGHT, n) for n in QKV)  # stacked in this order
QKV_BIASES = tuple(shard_name(ShardKind.BIAS, n) for n in QKV)
QKV_LORA = tuple(shard_name(ShardKind.LORA, n) for n in QKV)  # the adapted q/k/v's B rows
# shards of the K/V heads (summed among the users of a shared KV head)
KV_SHARDS = frozenset(n for n, s in SHARDS.items() if s.projection in ("k", "v"))
# q/k rows, which RoPE rotates: stacked with each head's dims interleaved (``qkv``)
ROTATED_SHARDS = frozenset(n for n, s in SHARDS.items() if s.projection in ("q", "k"))


def head_rows(heads: slice, d: int) -> slice:
    """Rows of a projection (or columns of o_proj) that hold ``heads`` of ``d`` dims each."""
    return slice(heads.start * d, heads.stop * d)


class HeadBucket(NamedTuple):
    """A few of a group's KV heads and the query heads using them, attended together: ``kv``
    and ``q`` slice the group's local heads; ``kv_map`` is ``AttentionSpec.kv_map`` within the
    bucket (None: the kernels' GQA map)."""

    kv: slice
    q: slice
    kv_map: list[int] | None

    def index(self, name: str, d: int) -> tuple[slice, ...]:
        """Where this bucket's part of group shard ``name`` lies: rows of its KV heads in
        k/v's weights and biases, rows of its query heads in q's and the output gate's,
        columns of its query heads in ``wo``."""
        rows = head_rows(self.kv if name in KV_SHARDS else self.q, d)
        return (slice(None), rows) if name == "wo" else (rows,)

    def shards(self, w: dict, d: int) -> dict:
        """Group shards ``w`` (``wq, wk, wv, wo``, biases, gate) cut to this bucket (views)."""
        return {n: t[self.index(n, d)] for n, t in w.items()}

    def whole(self) -> HeadBucket:
        """This bucket as the single bucket of its own heads."""
        n_kv, n_q = self.kv.stop - self.kv.start, self.q.stop - self.q.start
        return HeadBucket(slice(0, n_kv), slice(0, n_q), self.kv_map)


class HeadPart(NamedTuple):
    """The heads one pass of the attention schedule projects and attends: all of group ``r``
    (``bucket`` None) or one of its head buckets; ``q``, ``kv``: their global query and KV
    heads, ``q_rows``, ``kv_rows``: their rows of q_proj, and of k_proj / v_proj."""

    r: int
    bucket: HeadBucket | None
    q: slice
    kv: slice
    q_rows: slice
    kv_rows: slice


def _gqa_or(local: list[int]) -> list[int] | None:
    """``local`` (each query head's KV head), or None when it is the kernels' GQA map."""
    nq, nk = len(local), local[-1] + 1
    if nq % nk == 0 and local == [j // (nq // nk) for j in range(nq)]:
        return None
    return local


@dataclass(frozen=True)
class AttentionSpec:
    """Head layout of one attention layer on a TSP axis of size ``tsp_size``.

    Group p holds the contiguous query heads ``q_heads(p)`` (``⌊n_heads/D⌋`` or ``⌈n_heads/D⌉``
    of them, the first ``n_heads mod D`` groups one more) and every KV head they use: query head
    i uses KV head ``i // (n_heads/n_kv_heads)``. A KV head used by several groups is replicated
    on them (at most the first KV head of a group is shared with the previous group).
    """

    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    tsp_size: int
    scaling: float
    qk_norm_eps: float | None = None  # per-head RMSNorm on q and k (Qwen3), else None
    qk_norm_offset: float = 0.0  # those norms as x̂·(offset + w) (Gemma-3's 1 + w)
    qk_norm_full: bool = False  # q/k norms over the whole projection, not per head (OLMo-2)
    window: int | None = None  # sliding window: query i sees keys (i - window, i]; None: causal
    rotary_dim: int | None = None  # RoPE on each head's first ``rotary_dim`` dims only; None: all
    output_gate: bool = False  # A · sigmoid(X · Wgᵀ) before o_proj (Qwen3-Next's gated attention)

    def __post_init__(self) -> None:
        D = self.tsp_size
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        rot = self.rotary
        if rot % 2 or not 0 < rot <= self.head_dim:
            raise ValueError(f"rotary_dim={rot} must be even and in (0, head_dim={self.head_dim}]")
        if self.qk_norm_full and rot != self.head_dim:
            raise ValueError("q/k norms over the whole projection with partial rotary")
        if self.window is not None and self.window < 2:
            raise ValueError(f"sliding window {self.window} must be >= 2")
        if not 1 <= D <= self.n_heads:
            raise ValueError(
                f"tsp_size={D} but the model has n_heads={self.n_heads}: every TSP rank needs at "
                f"least one query head; the largest valid TSP size is {self.n_heads}"
            )

    @property
    def rotary(self) -> int:
        """Dimensions of each head that RoPE rotates (the first ones; the rest pass through)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (``n_heads / n_kv_heads``)."""
        return self.n_heads // self.n_kv_heads

    def q_heads(self, p: int) -> slice:
        """Query heads of group ``p``."""
        return split_range(self.n_heads, self.tsp_size, p)

    def kv_heads(self, p: int) -> slice:
        """KV heads used by group ``p``'s query heads."""
        q, g = self.q_heads(p), self.group_size
        return slice(q.start // g, (q.stop - 1) // g + 1)

    def n_q(self, p: int) -> int:
        """Number of query heads of group ``p``."""
        q = self.q_heads(p)
        return q.stop - q.start

    def n_kv(self, p: int) -> int:
        """Number of KV heads of group ``p``."""
        k = self.kv_heads(p)
        return k.stop - k.start

    @property
    def max_q(self) -> int:
        """Query heads of the largest group."""
        return self.n_q(0)

    def q_rows(self, p: int) -> slice:
        """Rows of q_proj (= columns of o_proj) owned by group ``p``."""
        return head_rows(self.q_heads(p), self.head_dim)

    def kv_rows(self, p: int) -> slice:
        """Rows of k_proj / v_proj used by group ``p``."""
        return head_rows(self.kv_heads(p), self.head_dim)

    def kv_map(self, p: int) -> list[int] | None:
        """Local KV head of each of group ``p``'s query heads, ``[n_q(p)]``, or None when it is
        the kernels' own GQA map (local query head j uses KV head ``j // (n_q / n_kv)``)."""
        return _gqa_or(self._local_kv(p))

    def _local_kv(self, p: int) -> list[int]:
        """Local KV head of each of group ``p``'s query heads."""
        q, k = self.q_heads(p), self.kv_heads(p)
        return [i // self.group_size - k.start for i in range(q.start, q.stop)]

    def buckets(self, p: int, size: int | None) -> list[HeadBucket]:
        """Group ``p``'s heads in buckets of ``size`` KV heads (the last one smaller when
        ``size`` does not divide ``n_kv(p)``), each with the query heads using them; None: one
        bucket of the whole group."""
        local, nk = self._local_kv(p), self.n_kv(p)
        size = nk if size is None else size
        out = []
        for j0 in range(0, nk, size):
            j1 = min(j0 + size, nk)
            q = [i for i, j in enumerate(local) if j0 <= j < j1]
            bucket_map = _gqa_or([local[i] - j0 for i in q])
            out.append(HeadBucket(slice(j0, j1), slice(q[0], q[-1] + 1), bucket_map))
        return out

    def part(self, p: int, bucket: HeadBucket | None = None) -> HeadPart:
        """Group ``p``'s heads, or those of ``bucket`` (one of ``buckets(p, ...)``)."""
        q, kv, d = self.q_heads(p), self.kv_heads(p), self.head_dim
        if bucket is not None:
            q = slice(q.start + bucket.q.start, q.start + bucket.q.stop)
            kv = slice(kv.start + bucket.kv.start, kv.start + bucket.kv.stop)
        return HeadPart(p, bucket, q, kv, q_rows=head_rows(q, d), kv_rows=head_rows(kv, d))

    def first_kv_copied(self, p: int) -> bool:
        """Whether group ``p``'s first KV head is also used by group p-1 (a copy)."""
        return p > 0 and self.kv_heads(p - 1).stop > self.kv_heads(p).start

    def counted_kv(self, p: int) -> slice:
        """Local KV heads of group ``p`` whose first user is ``p`` (each distinct head once)."""
        return slice(int(self.first_kv_copied(p)), self.n_kv(p))

    @property
    def kv_mixed(self) -> bool:
        """Whether some group's KV slice holds both a copy of a shared head (counted by the group
        before it) and a head it counts itself: a per-parameter gradient norm (DeepSpeed's)
        cannot count such a slice exactly."""
        return any(self.first_kv_copied(p) and self.n_kv(p) > 1 for p in range(self.tsp_size))

    def kv_users(self, j: int) -> range:
        """Groups whose query heads use KV head ``j`` (consecutive)."""
        g = self.group_size
        return range(self._group_of(j * g), self._group_of((j + 1) * g - 1) + 1)

    def _group_of(self, i: int) -> int:
        """Group holding query head ``i``."""
        return next(p for p in range(self.tsp_size) if self.q_heads(p).stop > i)

    def shared_kv(self, p: int) -> list[tuple[int, range]]:
        """``(local index, users)`` of each of group ``p``'s KV heads that other groups use too,
        in head order: its gradient is the sum over ``users`` (``kv_users``)."""
        k = self.kv_heads(p)
        users = [(j - k.start, self.kv_users(j)) for j in range(k.start, k.stop)]
        return [(i, u) for i, u in users if len(u) > 1]

    @property
    def kv_replicas(self) -> int:
        """Ranks sharing each KV head when every group uses exactly one, whole and equally shared
        (``n_heads % D == 0`` and ``D % n_kv_heads == 0``): ``D / n_kv_heads``; else 1."""
        D = self.tsp_size
        if self.n_heads % D == 0 and D % self.n_kv_heads == 0:
            return D // self.n_kv_heads
        return 1
