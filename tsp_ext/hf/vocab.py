"""Vocabulary-sharded embedding and LM head modules (row block p of the table on TSP rank p).

The schedules (row exchange for the embedding, ring LM head + fused cross-entropy) are
``tsp_ext.engine.vocab``; these modules hold the rows under the Hugging Face names.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TSPConfig
from ..engine.decode import vocab_embedding
from ..engine.parallel import comm
from ..engine.sharding.layout import IGNORE_INDEX
from ..engine.sharding.partition import check_split, split_offsets
from ..engine.vocab import (
    VocabShards,
    embedding_exchange,
    ring_cross_entropy,
    ring_logits,
    ring_token_logps,
)
from .replicated import embedding_scale, scaled
from .sharding import ShardedModule


class _VocabRows(ShardedModule):
    """A ``[V_p, h]`` parameter ``weight`` holding vocabulary rows ``offsets[p]:offsets[p+1]`` of
    a ``[V, h]`` table (``⌊V/D⌋`` or ``⌈V/D⌉`` rows, the first ``V mod D`` ranks one more)."""

    shard_dims = {"weight": 0}

    def __init__(self, vocab_size: int, hidden_size: int, group) -> None:
        super().__init__()
        D, _ = comm.size_and_rank(group)
        check_split(vocab_size, D, "vocab_size", "use a smaller TSP size")
        self.vocab_size, self.hidden_size, self.group = vocab_size, hidden_size, group
        self.offsets = split_offsets(vocab_size, D)

    def index_of(self, name: str, rank: int) -> tuple[slice, ...]:
        """Index of rank ``rank``'s rows in the full (Hugging Face) ``[V, h]`` tensor."""
        return (slice(self.offsets[rank], self.offsets[rank + 1]),)


def _shard_parameter(full: torch.Tensor, index) -> nn.Parameter:
    return nn.Parameter(full.detach()[index].clone(), requires_grad=full.requires_grad)


class TSPVocabEmbedding(_VocabRows):
    """Token embedding with vocabulary rows p on rank p: ``ids [B, S/D] -> [B, S/D, h]``, times
    ``scale`` where the model scales its embeddings (Gemma)."""

    def __init__(
        self,
        weight: nn.Parameter,
        vocab_size: int,
        padding_idx: int | None,
        group,
        scale: float | None = None,
    ):
        super().__init__(vocab_size, weight.shape[1], group)
        self.weight, self.padding_idx, self.scale = weight, padding_idx, scale

    @classmethod
    def from_hf(cls, emb: nn.Embedding, group) -> TSPVocabEmbedding:
        V, h = emb.weight.shape
        empty = nn.Parameter(emb.weight.new_empty(0, h))
        mod = cls(empty, V, emb.padding_idx, group, embedding_scale(emb))
        mod.weight = _shard_parameter(emb.weight, mod.local_index("weight"))
        return mod

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shards = VocabShards(self.offsets, self.group)
        x = embedding_exchange(ids, self.weight, shards, self.padding_idx)
        return scaled(x, self.scale)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Inference: embeddings ``[B, Tq, h]`` of ``ids [B, Tq]`` that every rank holds (a
        decode step), the same on every rank (one all-reduce)."""
        first = self.local_index("weight")[0].start
        return scaled(vocab_embedding(ids, self.weight, first, self.group), self.scale)


class TSPVocabLMHead(_VocabRows):
    """LM head with vocabulary rows p on rank p, computing the loss without full logits:
    ``head(h, labels)`` is the fused ring LM head + cross-entropy, ``head(h)`` the logits."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group, config: TSPConfig):
        super().__init__(vocab_size, weight.shape[1], group)
        self.weight, self.options = weight, config.engine_options()

    @classmethod
    def from_hf(
        cls, head: nn.Linear, group, config: TSPConfig, tied_to: TSPVocabEmbedding | None = None
    ) -> TSPVocabLMHead:
        """Build from ``lm_head``; ``tied_to``: the embedding whose sharded weight it shares."""
        if head.bias is not None:
            raise ValueError(
                "a vocab-sharded LM head has no bias: use TSPConfig(shard_vocab=False) for "
                "models with an LM-head bias"
            )
        V, h = head.weight.shape
        mod = cls(nn.Parameter(head.weight.new_empty(0, h)), V, group, config)
        if tied_to is not None:
            mod.weight = tied_to.weight
        else:
            mod.weight = _shard_parameter(head.weight, mod.local_index("weight"))
        return mod

    def forward(
        self,
        h: torch.Tensor,
        labels: torch.Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
        per_token: tuple[str, ...] | None = None,
    ):
        """Without ``labels``: the logits ``[B, T, V]`` of the local tokens, built shard by shard.
        With ``labels [B, T]`` (already shifted): the fused ring loss instead, the sum over the
        labelled local tokens of ``-log softmax(h·Wᵀ)[label]`` (float32 at least). With
        ``per_token`` (a tuple of ``engine.vocab.STATS`` names, maybe empty) as well: per-token
        ``(log p [B, T], {stat: [B, T]})`` instead of the sum (``ring_token_logps``).

        One ``forward`` for both so that DP engines' module hooks (ZeRO-3, FSDP2) see each use.
        """
        flat = h.reshape(-1, h.shape[-1])
        shards = VocabShards(self.offsets, self.group, self.options)
        if labels is None:
            logits = ring_logits(flat, self.weight, shards)
            return logits.view(*h.shape[:-1], self.vocab_size)
        flat_labels = labels.reshape(-1).to(h.device)
        out_of_range = (flat_labels < 0) | (flat_labels >= self.vocab_size)
        if (out_of_range & (flat_labels != ignore_index)).any():
            raise ValueError(f"labels must be in [0, {self.vocab_size}) or {ignore_index}")
        if per_token is None:
            return ring_cross_entropy(
                flat, flat_labels, self.weight, shards, ignore_index=ignore_index
            )
        logp, stats = ring_token_logps(
            flat, flat_labels, self.weight, shards, ignore_index=ignore_index, stats=per_token
        )
        shape = h.shape[:-1]
        return logp.view(shape), {k: v.view(shape) for k, v in stats.items()}
