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
    tsp_mlp_columns,
)


def _model_state(
    params: float, w: Workload, dp: int, grad_extra: float = 0, master: float | None = None
) -> tuple[float, float, float, float]:
    """Bytes of (params, grads, optimizer) per device, ZeRO stage ``w.zero_stage`` over dp, and
    the host bytes of an offloaded optimizer (``w.offload_optimizer``: its states, master
    weights and the float32 gradients it steps with; the device keeps weights and gradients).
    ``grad_extra``: gradient elements beyond one per parameter; ``master``: optimizer bytes
    per parameter when not the workload's (DeepSpeed's ZeRO-3 keeps float32 masters always)."""
    b, z = w.beta, w.zero_stage
    opt = master if master is not None else 2 * b if w.optimizer == "adamw" else 8 + 4 * (b < 4)
    opt_dp = dp if z >= 1 else 1
    state = (
        params * b / (dp if z >= 3 else 1),
        (params + grad_extra) * b / (dp if z >= 2 else 1),
        params * opt / opt_dp,
    )
    if not w.offload_optimizer:
        return (*state, 0.0)
    return state[0], state[1], 0.0, state[2] + params * 4 * (b < 4) / opt_dp


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
    """What one TSP decoder layer saves per rank: two norms (their inputs are what the attention
    and the MLP keep of their own inputs, ``pointwise.to_save``); every head group's output A
    and float32 log-sum-exp (+ the MLP's gate/up for ``none``; a MoE layer's routing instead).
    ``full``: only the layer input."""
    B, T, h = w.micro_batch, _tsp_seq(w, D) / D, m.hidden_size
    if w.recompute == "full":
        return B * T * h * w.beta
    attn = B * T * m.num_heads * m.head_dim * w.beta + 4 * B * T * m.num_heads
    if m.moe:  # experts always recompute; the routing (int64 index, weight), router softmax
        mlp = B * T * (m.experts_per_token * (8 + w.beta) + 4 * m.num_experts)
    else:
        mlp = 2 * B * T * m.intermediate_size * w.beta if w.recompute == "none" else 0
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
    mlp = B * T * (h + 4 * m.active_width / tp) * w.beta
    if m.moe:  # each assignment's gathered input, the router's logits and softmax
        mlp += B * T * (m.experts_per_token * h * w.beta + m.num_experts * (w.beta + 4))
    return 2 * _norm_saved(w, T, h) + attn + mlp


def tsp_memory(m: ModelShape, w: Workload, lay: Layout) -> Memory:
    """TSP on D = lay.tp ranks: layer weights / D, tokens / D, vocabulary rows / D and a fused
    chunked loss when ``shard_vocab``; ZeRO over dp. Shards that D does not divide evenly are
    counted at the largest rank's size (one more head, MLP row or vocabulary row, and every KV
    head its query heads use)."""
    D, B, h = lay.tp, w.micro_batch, m.hidden_size
    T = _tsp_seq(w, D) / D
    vocab = -(-m.vocab_size // D) if w.shard_vocab else m.vocab_size
    params = m.num_layers * _tsp_shard_params(m, D) + _vocab_params(m, vocab, vocab)
    if w.shard_vocab:  # fused loss: float32 log-sum-exp per token, the owned ids' list, and
        # the last LM-head shard's gradient shares (dH, dW), taken in forward
        head = _head_saved(m, w, T, 0, norm=_tsp_norm_saved) + B * T * w.acc
        head += 8 * min(vocab, B * w.seq_len) + (B * T + vocab) * h * w.acc
    else:
        head = _head_saved(m, w, T, m.vocab_size, norm=_tsp_norm_saved)
    every = w.checkpoint_every if w.recompute == "full" else 1
    kept = -(-m.num_layers // every)  # layers whose input is kept (intervals of ``every``)
    layers = kept * tsp_layer_saved(m, w, D)
    # offloaded inputs: the device keeps its share first (device-then-host tiers)
    host = max(0.0, layers - w.checkpoint_device_bytes) if w.offload_checkpoints else 0.0
    acts = layers - host + head
    if w.shard_vocab:  # logits blocks, two shards in flight, dW and the gradient ring, dH
        block = min(w.loss_chunk, B * T) * vocab
        loss = (
            block * (2 * w.acc + w.beta) + vocab * h * (2 * w.beta + 3 * w.acc) + B * T * h * w.acc
        )
    else:
        loss = B * T * m.vocab_size * (w.beta + 8)
    # backward reaches the layers after the head, whose saved tensors are then freed
    transient = max(tsp_layer_working(m, w, D) - head, loss)
    return _memory(m, w, lay, params, acts=acts, transient=transient, host=host)


def tsp_layer_working(m: ModelShape, w: Workload, D: int) -> float:
    """Bytes one TSP decoder layer's backward needs beyond what is saved, at the larger of its
    two phases, plus the weight shards and their float32 gradient accumulators (double-buffered
    with ``overlap``). Attention: the output gradient, the float32 input-gradient accumulator,
    the normed input rebuilt from its norm's input, the head group's local projections (with
    ``head_bucket``, one bucket's at a time: ``engine.attention.head_groups``), and the group's K/V
    of all S tokens in token order with their float32 dK/dV accumulated in the
    rank-major layout they are reduce-scattered from and one kernel call's key gradients (a
    query chunk's earlier keys); with ``head_bucket``, one bucket's K/V and dK/dV of one zigzag
    chunk at a time (``engine.attention.key_stream``) and its float32 dK/dV rows. MLP: the output
    gradient, the float32 accumulator, the normed input (rebuilt tile by tile without
    ``overlap``), one tile's intermediates. ``full``: the recomputed layer's saved tensors (its
    input back from the host when offloaded; the MLP's norm input is freed before the
    attention's backward) and, in an interval of ``checkpoint_every`` layers, the inputs of the
    k - 1 layers before its last (each but the last checkpointed inside the interval)."""
    B, T, h, d, b, acc = w.micro_batch, _tsp_seq(w, D) / D, m.hidden_size, m.head_dim, w.beta, w.acc
    # a ring step's intermediates per token: the largest MLP slice, or (MoE) the k experts'
    # width over the D owners whose experts the ring brings
    F = m.active_width if m.moe else -(-m.intermediate_size // D) * D
    nh, nkv = _tsp_heads(m, D)
    bucket = nkv if w.head_bucket is None else min(w.head_bucket, nkv)
    shard = max(_layer_params(m, nh, nkv, 0) - m.num_experts * h, 3 * h * tsp_mlp_columns(m, D))
    tile = B * T if w.mlp_tile is None else min(w.mlp_tile, B * T)
    nq = nh * bucket / nkv  # the query heads projected at once: a bucket's (all, without)
    local = B * T * (2 * nq + 2 * bucket) * d  # q, k, v and dA of those heads
    if w.head_bucket is None:  # the group's K/V all-gathered, float32 dK/dV of all S tokens
        gathered = 2 * B * T * D * nkv * d
        keys = gathered * (2 * b + acc)  # + a kernel call's key gradients: all earlier keys
    else:  # streamed a chunk (T/2 tokens) at a time: one chunk's K/V (two with overlap) and
        # float32 dK/dV, its kernel calls' key gradients, this rank's float32 dK/dV rows
        chunk = B * T * bucket * d
        keys = chunk * ((1 + w.overlap) * b + acc + b) + 2 * chunk * acc
    # dQ; the RoPE tables and their conjugate phases (complex64)
    queries = B * T * nq * d * b + B * T * d * (2 * b + 4)
    attention = B * T * h * (2 * b + acc) + local * b + keys + queries
    mlp = B * T * h * (b + acc + b * w.overlap) + 6 * tile * F / D * b
    extra = 0.0
    if w.recompute == "full":
        saved = tsp_layer_saved(m, replace(w, recompute="selective", offload_checkpoints=False), D)
        attention += saved - _tsp_norm_saved(w, T, h)
        mlp += saved
        extra = (w.checkpoint_every - 1) * B * T * h * b
        if not w.offload_checkpoints:  # its input is the checkpoint, counted as saved
            extra -= B * T * h * b
    return (1 + w.overlap) * shard * (b + acc) + max(attention, mlp) + extra


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
    layer = B * T * (3 * m.active_width / tp + 4 * h) * w.beta
    if w.recompute == "full":
        layer += hf_layer_saved(
            m, replace(w, recompute="selective", offload_checkpoints=False), tp, sp
        )
    loss = B * T * V * (w.beta + 8)
    return _memory(m, w, lay, params, acts=acts, transient=max(layer, loss), grad_extra=grad_extra)


def alst_memory(m: ModelShape, w: Workload, lay: Layout) -> Memory:
    """ALST as DeepSpeed ships it: Hugging Face Llama under Ulysses SP (tokens / sp, heads / sp
    in attention), a ZeRO-3 engine over all sp·dp devices (float32 master weights and gradient
    partition), layer checkpointing (every layer keeps its input; in host memory with
    ``offload_checkpoints``), ``TiledMLP`` in tiles of ``w.mlp_tile`` tokens (None: untiled)
    and ``TiledFusedLogitsLoss`` in tiles of ``w.loss_chunk`` tokens; the optimizer on the host
    with ``offload_optimizer``, the weight partitions with ``offload_params``."""
    B, h, V = w.micro_batch, m.hidden_size, m.vocab_size
    T, N = w.seq_len / lay.sp, lay.sp * lay.dp
    layer_params = _layer_params(m, m.num_heads, m.num_kv_heads, m.mlp_width)
    params = m.num_layers * layer_params + _vocab_params(m, V, V)
    w3 = replace(w, zero_stage=3, recompute="full")
    moments = 2 * w.beta if w.optimizer == "adamw" else 8
    p, _, opt, host = _model_state(params, w3, N, master=4 + moments)
    grads = 0.0 if w.offload_optimizer else params * 4 / N  # float32 gradient partition
    if w.offload_params:
        p, host = 0.0, host + p
    layers = m.num_layers * B * T * h * w.beta
    host += layers if w.offload_checkpoints else 0.0
    head = _head_saved(m, w, T, 0)
    acts = layers * (not w.offload_checkpoints) + head
    # ZeRO-3: the current and the prefetched layer gathered, the current layer's gradients;
    # backward reaches the layers after the head, whose saved tensors are then freed
    gathered = 3 * layer_params * w.beta
    layer = gathered + alst_layer_working(m, w, lay.sp) - head
    tile = min(w.loss_chunk, B * T)
    loss = 2 * V * h * w.beta + tile * V * (w.beta + 2 * w.acc) + B * T * h * (w.beta + w.acc)
    return Memory(
        p, grads=grads, optimizer=opt, activations=acts, transient=max(layer, loss), host=host
    )


def alst_layer_working(m: ModelShape, w: Workload, sp: int) -> float:
    """Bytes one checkpointed Hugging Face decoder layer under Ulysses needs in backward: the
    larger of its two phases. Both hold its input (back from the host when offloaded), an
    incoming gradient and what its recomputed forward saved up to attention (the first RMSNorm
    with its float32 input copy below float32, its output, the q/k norms, flash attention's q /
    k / v / output / log-sum-exp over heads / sp, o_proj's input).
    MLP phase (first): also the second norm and its output, the untiled MLP's four
    intermediates or one tile's, and the norm backward's float32 gradient (with a float32 copy
    of its incoming gradient below float32).
    Attention phase: the output's gradient back through the all-to-all, flash attention's dQ,
    dK, dV (and float32 dQ accumulator below float32), the all-to-all's send and receive
    buffers of dQ, and the q/k norms' float32 gradients."""
    B, T, h, d, b, acc = w.micro_batch, w.seq_len / sp, m.hidden_size, m.head_dim, w.beta, w.acc
    nh, nkv, F, tok = m.num_heads, max(m.num_kv_heads, sp), m.active_width, B * w.seq_len / sp
    half = b < 4  # casts to float32 make copies
    base = tok * h * b * (1 + w.offload_checkpoints)  # incoming gradient, input
    base += tok * (h * (b + 4 * half) + 4) + tok * h * b  # first norm, its output
    if m.qk_norm:
        base += tok * (m.num_heads + m.num_kv_heads) * (d * (4 + b) + 4)
    base += tok * ((3 * nh + 2 * nkv) * d * b + 4 * nh)
    tile = tok if w.mlp_tile is None else min(w.mlp_tile, tok)
    mlp = _norm_saved(w, T, h) + tok * h * b + 6 * tile * F * b + tok * h * (acc + 4 * half)
    if w.mlp_tile is None:
        mlp += 4 * tok * F * b
    attn = tok * (3 * nh + 2 * nkv) * d * b + 4 * tok * nh * d * half
    if m.qk_norm:
        attn += tok * (m.num_heads + m.num_kv_heads) * d * acc
    return base + max(mlp, attn)


def _memory(
    m: ModelShape, w: Workload, lay: Layout, params, acts, transient, grad_extra=0.0, host=0.0
):
    """Model state sharded by ZeRO over dp; ZeRO-3 adds the gathered weights of the current
    and the prefetched layer to the transient buffers."""
    if lay.dp > 1 and w.zero_stage == 3:
        transient += 2 * params / m.num_layers * w.beta
    *state, opt_host = _model_state(params, w, lay.dp, grad_extra)
    return Memory(*state, activations=acts, transient=transient, host=host + opt_host)


MEMORY = {
    "tsp": tsp_memory,
    "tp": baseline_memory,
    "sp": baseline_memory,
    "tpxsp": baseline_memory,
    "alst": alst_memory,
}
