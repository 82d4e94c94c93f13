"""``TSPCache``: the Hugging Face ``Cache`` of a TSP model, one ``TSPCacheLayer`` per layer.

Rank p caches the KV heads of its head group p — the K/V its prefill all-gathered anyway in TSP
step p — so each rank holds 1/D of the model's KV cache and decode needs no re-sharding. When
D > n_kv_heads the c = D / n_kv_heads ranks sharing a KV head each keep 1/c of its tokens
(``engine.decode.kept_tokens``). Lengths reported to ``generate`` are *global* (every token of
the sequence, on every rank), so positions and masks come out as for a single-process model.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..engine.decode import kept_tokens
from ..engine.parallel import comm


class _GlobalLength(CacheLayerMixin):
    """A TSP cache layer's bookkeeping of the tokens seen: ``seq_len`` is *global* (every token
    of the sequence, whichever rank keeps what of it), so positions and masks come out as for a
    single-process model."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.seq_len = 0

    def get_seq_length(self) -> int:
        """The global number of tokens seen."""
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1


class TSPCacheLayer(_GlobalLength):
    """One layer's share of the KV cache on one TSP rank.

    ``keys``, ``values``: ``[B, n_kv(p), L_p, d]`` (Hugging Face layout), the L_p cached tokens of
    this rank; ``token_index [L_p]``: their global indices (ascending). ``replicas`` ranks share
    each KV head; this one is replica ``replica`` and keeps the tokens ``kept_tokens`` gives it.
    A layer with a sliding ``window`` keeps only the last ``window - 1`` tokens: no later query
    sees an older one.
    """

    def __init__(self, replicas: int = 1, replica: int = 0, window: int | None = None) -> None:
        super().__init__()
        self.replicas, self.replica, self.window = replicas, replica, window
        self.token_index: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, d = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_empty(B, H, 0, d)
        self.values = value_states.new_empty(B, H, 0, d)
        self.token_index = torch.empty(0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        token_index: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hugging Face's ``update``: ``append``'s keys and values."""
        keys, values, _ = self.append(key_states, value_states, token_index)
        return keys, values

    def append(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        token_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append the new tokens' ``key_states, value_states [B, n_kv(p), T, d]`` (those this rank
        keeps) at global indices ``token_index [T]`` (default: right after the cached ones);
        returns the keys, values and global indices ``[L]`` of this rank's tokens that these
        tokens' queries may see (the cached ones and the new)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[2]
        if token_index is None:
            token_index = torch.arange(self.seq_len, self.seq_len + T, device=self.device)
        if T:
            self.seq_len = max(self.seq_len, int(token_index[-1]) + 1)
        if self.replicas > 1:
            keep = kept_tokens(token_index, self.replicas, self.replica)
            key_states, value_states = key_states[:, :, keep], value_states[:, :, keep]
            token_index = token_index[keep]
        keys = torch.cat([self.keys, key_states], dim=2)
        values = torch.cat([self.values, value_states], dim=2)
        index = torch.cat([self.token_index, token_index.to(self.device)])
        self.keys, self.values, self.token_index = keys, values, index
        if self.window is not None:  # later queries (>= seq_len) see keys > seq_len - window
            kept = index > self.seq_len - self.window
            self.keys, self.values = keys[:, :, kept], values[:, :, kept]
            self.token_index = index[kept]
        return keys, values, index

    def reset(self) -> None:
        self.keys = self.values = self.token_index = None
        self.seq_len = 0
        self.is_initialized = False

    def nbytes(self) -> int:
        """Bytes of this rank's cached keys and values."""
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes


class LinearStateCacheLayer(_GlobalLength):
    """One Gated DeltaNet layer's cache on one TSP rank: its head group's ``conv_state
    [B, K-1, C_p]`` (the last K-1 pre-conv q|k|v rows) and ``recurrent_state [B, Hv_p, dk, dv]``
    (float32, float64 for float64), and the global ``seq_len``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise ValueError("a linear attention layer keeps no keys: use prefill / decode")

    def store(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, seq_len: int) -> None:
        """Replace the states after ``seq_len`` tokens."""
        self.conv_state, self.recurrent_state, self.seq_len = conv_state, recurrent_state, seq_len
        self.is_initialized = True

    def reset(self) -> None:
        self.conv_state = self.recurrent_state = None
        self.seq_len = 0
        self.is_initialized = False

    def nbytes(self) -> int:
        """Bytes of this rank's states."""
        if self.conv_state is None:
            return 0
        return self.conv_state.nbytes + self.recurrent_state.nbytes


class TSPCache(Cache):
    """The KV cache of a TSP model on one rank (``apply_tsp``'d; built by its ``generate``).

    Args:
        model: the TSP model this cache serves; the cache records its layout (TSP size, rank,
            layers, KV heads) and refuses to serve a model with another.
    """

    def __init__(self, model) -> None:
        self.layout = _layout(model)
        D, p = comm.size_and_rank(model.tsp.group)
        caches = []
        for layer in model.tsp.family.layers_of(model):
            spec = _attention_spec(model, layer)
            if spec is None:  # a hybrid model's linear-attention layer: its group's states
                caches.append(LinearStateCacheLayer())
            else:
                c = spec.kv_replicas
                caches.append(TSPCacheLayer(c, p % c, spec.window))
        super().__init__(layers=caches)

    def check_layout(self, model) -> None:
        """Raise ``ValueError`` if this cache was built for another TSP layout or model."""
        here = _layout(model)
        if here != self.layout:
            raise ValueError(
                f"this TSPCache was built for (tsp_size, rank, layers, kv_heads, head_dim) = "
                f"{self.layout}, the model is {here}: build a new TSPCache(model)"
            )

    def kv_bytes(self) -> int:
        """Bytes of the keys and values this rank caches, all layers."""
        return sum(layer.nbytes() for layer in self.layers)


def _attention_spec(model, layer):
    """The ``AttentionSpec`` of a layer's attention, or None for a linear-attention layer."""
    family = model.tsp.family
    mixer = family.mixer(layer)
    return getattr(layer, mixer).spec if mixer == family.attention else None


def _layout(model) -> tuple[int, ...]:
    """(tsp_size, rank, layers, KV heads, head_dim) of a TSP model's attention layers."""
    layers = model.tsp.family.layers_of(model)
    spec = next(s for s in (_attention_spec(model, x) for x in layers) if s is not None)
    return (*comm.size_and_rank(model.tsp.group), len(layers), spec.n_kv_heads, spec.head_dim)
