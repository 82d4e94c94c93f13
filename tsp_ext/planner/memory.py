"""Per-device memory of each layout: model state under ZeRO, saved activations, transients."""

from __future__ import annotations

from dataclasses import replace

from .inputs import Layout, Memory, Workload
from .shapes import (
    ModelShape,
    _heads,
    _layer_params,
    _shard_params,
    _tsp_heads,
    _tsp_shard_params,
    _vocab_params,
)


def _model_state(
    params: float, w: Workload, dp: int, grad_extra: float = 0
) -> tuple[float, float, float]:
    """Bytes of (params, grads, optimizer) per device, ZeRO stage ``w.zero_stage`` over dp;
    ``grad_extra``: gradient elements beyond one per parameter."""
    b, z = w.beta, w.zero_stage
    opt = 2 * b if w.optimizer == "adamw" else 8 + (4 if b < 4 else 0)
    return (
        params * b / (dp if z >= 3 else 1),
        (params + grad_extra) * b / (dp if z >= 2 else 1),
        params * opt / (dp if z >= 1 else 1),
    )


def _tsp_seq(w: Workload, D: int) -> int:
    """The sequence as TSP runs it: right-padded to a multiple of 2·D."""
    return -(-w.seq_len // (2 * D)) * 2 * D


def _norm_saved(w: Workload, tokens: float, width: int) -> float:
    """Hugging Face's RMSNorm: float32 input (a copy unless float32), the normalised output in
    the model dtype, and the float32 reciprocal RMS per token."""
    return w.micro_batch * tokens * (width * (4 + w.beta) + 4)


def _tsp_norm_saved(w: Workload, tokens: float, width: int) -> float:
    """TSP's RMSNorm (``rms_norm_keeping_input``): the input in the model dtype and the float32
    reciprocal RMS per token; the normalised output is recomputed in backward."""
    return w.micro_batch * tokens * (width * w.beta + 4)


def _head_saved(m: ModelShape, w: Workload, tokens: float, vocab: float, norm=_norm_saved):
    """Final norm, LM-head input, float32 log-softmax ``[tokens, vocab]`` (vocab 0 for the
    fused loss), token ids and labels, and the rotary cos/sin that all layers share."""
    B, h = w.micro_batch, m.hidden_size
    return norm(w, tokens, h) + B * tokens * (h * w.beta + 4 * vocab + 16 + 2 * m.head_dim * w.beta)


def tsp_layer_saved(m: ModelShape, w: Workload, D: int) -> float:
    """What one TSP decoder layer saves per rank: two norms; attention ``X_p``, every head
    group's output A and float32 log-sum-exp; the MLP's ``X_p`` (+ gate/up for ``none``).
    ``full``: only the layer input."""
    B, T, h = w.micro_batch, _tsp_seq(w, D) / D, m.hidden_size
    if w.recompute == "full":
        return B * T * h * w.beta
    attn = B * T * (h + m.num_heads * m.head_dim) * w.beta + 4 * B * T * m.num_heads
    mlp = B * T * h * w.beta
    if w.recompute == "none":
        mlp += 2 * B * T * m.intermediate_size * w.beta
    return 2 * _tsp_norm_saved(w, T, h) + attn + mlp


def hf_layer_saved(m: ModelShape, w: Workload, tp: int, sp: int) -> float:
    """What one Hugging Face decoder layer saves per rank under DTensor TP (heads and MLP width
    / tp) inside Ulysses SP (tokens / sp): two norms, the q/k/v and gate/up inputs, sdpa's q, k,
    v, output and log-sum-exp, the SwiGLU intermediates. ``full``: only the layer input."""
    B, T, h, d = w.micro_batch, w.seq_len / sp, m.hidden_size, m.head_dim
    if w.recompute == "full":
        return B * T * h * w.beta
    nh, nkv = _heads(m, tp)
    o_in = nh * d if sp > 1 else 0  # Ulysses: o_proj's input is the all-to-all's new buffer
    attn = B * T * (h + 2 * nh * d + 2 * nkv * d + o_in) * w.beta + 4 * B * T * nh
    mlp = B * T * (h + 4 * m.intermediate_size / tp) * w.beta
    return 2 * _norm_saved(w, T, h) + attn + mlp


def tsp_memory(m: ModelShape, w: Workload, lay: Layout) -> Memory:
    """TSP on D = lay.tp ranks: layer weights / D, tokens / D, vocabulary rows / D and a fused
    chunked loss when ``shard_vocab``; ZeRO over dp. Shards that D does not divide evenly are
    counted at the largest rank's size (one more head, MLP row or vocabulary row, and every KV
    head its query heads use)."""
    D, B, h = lay.tp, w.micro_batch, m.hidden_size
    F = -(-m.intermediate_size // D) * D  # the largest MLP slice, times D
    T = _tsp_seq(w, D) / D
    vocab = -(-m.vocab_size // D) if w.shard_vocab else m.vocab_size
    params = m.num_layers * _tsp_shard_params(m, D) + _vocab_params(m, vocab, vocab)
    if w.shard_vocab:  # fused loss: float32 log-sum-exp per token, the owned ids' list, and
        # the last LM-head shard's gradient shares (dH, dW), taken in forward
        head = _head_saved(m, w, T, 0, _tsp_norm_saved) + B * T * w.acc
        head += 8 * min(vocab, B * w.seq_len) + (B * T + vocab) * h * w.acc
    else:
        head = _head_saved(m, w, T, m.vocab_size, _tsp_norm_saved)
    acts = m.num_layers * tsp_layer_saved(m, w, D) + head
    # transient: double-buffered weight shards and their float32 gradient accumulators, one
    # head group's gathered K/V with its float32 gradient, one MLP shard's intermediates
    nh, nkv = _tsp_heads(m, D)
    shard = max(_layer_params(m, nh, nkv, 0), 3 * h * F / D)
    kv = 2 * B * T * D * nkv * m.head_dim * (w.beta + w.acc)
    layer = 2 * shard * (w.beta + w.acc) + kv + 6 * B * T * F / D * w.beta
    if w.recompute == "full":
        layer += tsp_layer_saved(m, replace(w, recompute="selective"), D)
    if w.shard_vocab:  # logits blocks, two shards in flight, dW and the gradient ring, dH
        block = min(w.loss_chunk, B * T) * vocab
        loss = (
            block * (2 * w.acc + w.beta) + vocab * h * (2 * w.beta + 3 * w.acc) + B * T * h * w.acc
        )
    else:
        loss = B * T * m.vocab_size * (w.beta + 8)
    return _memory(m, w, lay, params, acts, max(layer, loss))


def baseline_memory(m: ModelShape, w: Workload, lay: Layout) -> Memory:
    """TP, SP and TP×SP: Hugging Face Llama under DTensor TP (lay.tp) inside DeepSpeed Ulysses
    (lay.sp); TP = (tp, 1), SP = (1, sp). Layer weights / tp, tokens / sp. HF's tp plan splits
    the embedding's rows (its DTensor backward still builds a full ``[V, h]`` gradient) and the
    LM head's, whose logits it gathers: float32 log-probs of ``[S/sp, V]`` are saved. ZeRO over
    dp."""
    tp, sp, B, h = lay.tp, lay.sp, w.micro_batch, m.hidden_size
    T, V = w.seq_len / sp, m.vocab_size
    params = m.num_layers * _shard_params(m, tp) + _vocab_params(m, V / tp, V / tp)
    grad_extra = V * h * (1 - 1 / tp)
    acts = m.num_layers * hf_layer_saved(m, w, tp, sp) + _head_saved(m, w, T, m.vocab_size)
    layer = B * T * (3 * m.intermediate_size / tp + 4 * h) * w.beta
    if w.recompute == "full":
        layer += hf_layer_saved(m, replace(w, recompute="selective"), tp, sp)
    loss = B * T * V * (w.beta + 8)
    return _memory(m, w, lay, params, acts, max(layer, loss), grad_extra)


def _memory(m: ModelShape, w: Workload, lay: Layout, params, acts, transient, grad_extra=0.0):
    """Model state sharded by ZeRO over dp; ZeRO-3 adds the gathered weights of the current
    and the prefetched layer to the transient buffers."""
    if lay.dp > 1 and w.zero_stage == 3:
        transient += 2 * params / m.num_layers * w.beta
    state = _model_state(params, w, lay.dp, grad_extra)
    return Memory(*state, activations=acts, transient=transient)


MEMORY = {"tsp": tsp_memory, "tp": baseline_memory, "sp": baseline_memory, "tpxsp": baseline_memory}
