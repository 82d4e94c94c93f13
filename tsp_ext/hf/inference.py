"""The forward of a TSP model called with a ``TSPCache``: prefill and decode.

Prefill (empty cache): the full prompt ``[B, S]``, identical on every rank, is right-padded to a
multiple of 2·D and zigzag-sharded like ``shard_batch``; every layer runs the TSP schedule
(attention keeps this rank's K/V as its cache; left-padded keys hidden) and the ring MLP. The last
prompt token's hidden state is broadcast from the rank holding it; its logits ``[B, 1, V]`` are
returned on every rank.

Decode (non-empty cache): the step's tokens ``[B, Tq]`` are replicated on every rank and each
layer runs the TP schedule on the same shards (``engine.decode``); logits ``[B, Tq, V]`` are
identical on every rank. Positions are the caller's ``position_ids`` (``generate`` derives them
from the attention mask, as for a single-process model) or the global token indices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..engine.decode import gather_vocab_logits
from ..engine.parallel import comm
from ..engine.parallel.agreement import agree, checksum
from ..engine.sharding.layout import ZigzagLayout, pad_sequence, padded_length
from .cache import TSPCache
from .causal_lm import logits_input
from .self_check import self_check_inference
from .vision import BATCH_KEYS, VisionShard, merge_vision, shard_vision_batch
from .vocab import TSPVocabEmbedding, TSPVocabLMHead

# keyword arguments generate() passes that the inference forward accepts and ignores
_IGNORED = {"use_cache", "return_dict", "output_attentions", "output_hidden_states"}


def check_same_on_all_ranks(ids: torch.Tensor, mask: torch.Tensor | None, group) -> None:
    """Raise ``ValueError`` on every rank unless every rank got the same ``ids`` (and mask):
    their shapes and checksums, compared in one all-gather (``agree``)."""
    facts = [*ids.shape, checksum(ids), -1 if mask is None else checksum(mask)]
    table = agree(None, facts, group)
    if (table != table[0]).any():
        raise ValueError(
            "the ranks of the TSP group got different input_ids (or attention_mask): give every "
            "rank the full, identical prompt (and sample with the same seed; TSP generate syncs it)"
        )


def _layers(model, x, pos, run_attention, run_mlp, deepstack: dict | None = None):
    """The decoder stack on ``x`` (each layer as its family runs one) and the final norm;
    ``deepstack``: Qwen3-VL's features added to the vision tokens after the first layers."""
    family = model.tsp.family
    ropes = family.position_embeddings(model, x, pos)
    residual = family.scalar(model.config, family.residual_multiplier)
    for i, layer in enumerate(family.layers_of(model)):
        attention = lambda attn, h, i=i: run_attention(i, attn, h, ropes[i])  # noqa: E731
        x = family.layer_forward(layer, x, attention, run_mlp, residual=residual)
        if deepstack and i < len(deepstack["deepstack_visual_embeds"]):
            where = deepstack["visual_pos_masks"]
            x[where] = x[where] + deepstack["deepstack_visual_embeds"][i]
    return getattr(family.base_of(model), family.final_norm)(x)


def _embedding(model) -> nn.Module:
    return getattr(model.tsp.family.base_of(model), model.tsp.family.embedding)


def _embedded(model, x: torch.Tensor) -> torch.Tensor:
    """The embedding's output ``x`` as the base model passes it on (Granite's multiplier)."""
    family = model.tsp.family
    scale = family.scalar(model.config, family.embedding_multiplier)
    return x if scale == 1.0 else x * scale


def _prefill(model, ids, mask, pos, cache: TSPCache, vision: dict) -> torch.Tensor:
    """Hidden state ``[B, 1, h]`` of the last prompt token, on every rank; ``vision``: the
    prompt's images / videos (the processor's keys), merged into their placeholders."""
    group = model.tsp.group
    D, p = comm.size_and_rank(group)
    B, S = ids.shape
    lay = ZigzagLayout(padded_length(S, D), D)
    emb = _embedding(model)
    x = _embedded(model, emb(lay.shard(pad_sequence(ids, D, emb.padding_idx or 0), p)))
    deepstack = None
    if vision:
        full = {"input_ids": ids, "attention_mask": mask, **vision}
        local = shard_vision_batch(model, full, lay, p, positions=False)
        x, deepstack = merge_vision(model, x, VisionShard.pop(local))
    pos = lay.shard(pad_sequence(pos.expand(*pos.shape[:-2], B, -1), D, 0, dim=-1), p, dim=-1)
    key_valid = None
    if mask is not None and not mask.all():
        key_valid = pad_sequence(mask.bool(), D, False)

    def attention(i, attn, h, rope):
        return attn.prefill(h, rope, cache.layers[i], S, key_valid=key_valid)

    x = _layers(model, x, pos, attention, run_mlp=lambda mlp, h: mlp(h), deepstack=deepstack)
    # the last prompt token (global index S-1) lives on one rank: broadcast it
    owner, offset = next(
        (q, s.offset + S - 1 - s.start)
        for q in range(D)
        for s in lay.spans(q)
        if s.start <= S - 1 < s.stop
    )
    last = x[:, offset : offset + 1].contiguous() if p == owner else x.new_empty(B, 1, x.shape[-1])
    comm.broadcast(last, owner, group)
    return last


def _decode(model, ids, mask, pos, cache: TSPCache) -> torch.Tensor:
    """Hidden states ``[B, Tq, h]`` of the step's tokens (replicated on every rank)."""
    L, Tq = cache.get_seq_length(), ids.shape[1]
    q_index = torch.arange(L, L + Tq, device=ids.device)
    valid = None if mask is None else mask.bool()
    if valid is not None and valid.shape[1] != L + Tq:
        raise ValueError(
            f"attention_mask covers {valid.shape[1]} tokens, the cache and the new tokens {L + Tq}"
        )
    emb = _embedding(model)
    x = _embedded(model, emb.decode(ids) if isinstance(emb, TSPVocabEmbedding) else emb(ids))

    def attention(i, attn, h, rope):
        return attn.decode(h, rope, cache.layers[i], q_index, valid=valid)

    return _layers(model, x, pos, attention, run_mlp=lambda mlp, h: mlp.decode(h))


def _logits(model, h: torch.Tensor) -> torch.Tensor:
    h = logits_input(model, h)
    head = getattr(model, model.tsp.family.lm_head)
    if isinstance(head, TSPVocabLMHead):
        return gather_vocab_logits(h, head.weight, head.offsets, head.group)
    return F.linear(h, head.weight, head.bias)


def _refuse_packed(pos: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Raise ``ValueError`` if a prompt row's positions restart between two real tokens (packed
    documents); left padding (positions of padded tokens, then 0, 1, ...) is fine."""
    real = torch.ones_like(pos, dtype=torch.bool) if mask is None else mask.bool()
    both = real[:, 1:] & real[:, :-1]
    if (both & (pos[:, 1:] != pos[:, :-1] + 1)).any():
        raise ValueError(
            "the prompt's position_ids restart inside a row (packed documents): TSP prefill and "
            "generate take one sequence per row; pass the documents as separate rows (left "
            "padding with their attention_mask)"
        )


def inference_forward(
    model,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache,
    **kwargs,
) -> CausalLMOutputWithPast:
    """Prefill (empty ``cache``) or decode step of a TSP model; see the module docstring.

    Args:
        input_ids: ``[B, T]``, the same on every rank (checked).
        attention_mask: ``[B, L + T]`` (1 = token, 0 = left padding) or None.
        position_ids: ``[B or 1, T]`` or None (then the global token indices).
        cache: the ``TSPCache`` built for this model.
    Returns:
        ``CausalLMOutputWithPast`` with ``logits`` ``[B, 1, V]`` after a prefill (last prompt
        token only) or ``[B, T, V]`` after a decode step, and ``cache``.
    """
    vision = {}
    if model.tsp.family.vision is not None:
        vision = {k: kwargs.pop(k) for k in BATCH_KEYS if kwargs.get(k) is not None}
    unknown = {k for k, v in kwargs.items() if v is not None and k not in _IGNORED}
    if input_ids is None or unknown or kwargs.get("output_attentions"):
        raise ValueError(
            "a TSP model with a KV cache takes input_ids, attention_mask, position_ids and the "
            f"cache only (got input_ids={'given' if input_ids is not None else None}, "
            f"extra {sorted(unknown)})"
        )
    if not isinstance(cache, TSPCache):
        raise ValueError(
            f"a TSP model needs a TSPCache (its KV heads are sharded), got {type(cache).__name__}: "
            "let model.generate build it, or pass tsp_ext.TSPCache(model)"
        )
    cache.check_layout(model)
    group = model.tsp.group
    check_same_on_all_ranks(input_ids, attention_mask, group)
    past, (B, T) = cache.get_seq_length(), input_ids.shape
    if past == 0:  # a miniature's logits through this path as Hugging Face's, or a ValueError
        self_check_inference(model)
    limit = model.config.get_text_config().max_position_embeddings
    if past + T > limit:
        raise ValueError(
            f"{past + T} tokens (prompt and generated) exceed max_position_embeddings={limit}"
        )
    if position_ids is None:
        position_ids = torch.arange(past, past + T, device=input_ids.device)[None]
    # Qwen-VL's [4, B, T]: the text positions, then the three rows of its M-RoPE
    text, rope = (
        (position_ids[0], position_ids[1:]) if position_ids.dim() == 3 else (position_ids,) * 2
    )
    with torch.no_grad():
        if past == 0:
            _refuse_packed(text.expand(B, -1), attention_mask)
            h = _prefill(model, input_ids, attention_mask, rope, cache=cache, vision=vision)
        else:
            rope = rope.expand(*rope.shape[:-2], B, -1)
            h = _decode(model, input_ids, attention_mask, rope, cache=cache)
        logits = _logits(model, h)
    return CausalLMOutputWithPast(logits=logits, cache=cache)
