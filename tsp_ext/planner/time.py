"""Step time: FLOPs per device and a roofline of compute plus blocking and hidden transfers."""

from __future__ import annotations

from .inputs import Cluster, Layout, Transfer, Workload
from .memory import _tsp_seq
from .shapes import ModelShape


def step_flops(m: ModelShape, w: Workload, lay: Layout) -> tuple[float, float]:
    """FLOPs per device of (one decoder layer, the LM head) for one training step: 3× the
    forward matmuls (a MoE layer's: each token's k experts), causal attention 3.5× its
    forward, plus what each layout recomputes."""
    n = lay.group
    B, S, h, d, F = w.micro_batch, w.seq_len, m.hidden_size, m.head_dim, m.active_width
    nh, nkv = m.num_heads, m.num_kv_heads
    if lay.kind == "tsp":
        S = _tsp_seq(w, n)
    matmul = 2 * B * S * (2 * h * d * (nh + nkv) + 3 * h * F)
    attn = 2 * B * S * S * nh * d
    layer = 3 * matmul + 3.5 * attn
    if lay.kind == "tsp":  # Q/K/V always, gate/up unless kept, are recomputed in backward
        layer += 2 * B * S * h * d * (nh + 2 * nkv) + (
            4 * B * S * h * F if w.recompute != "none" else 0
        )
    if w.recompute == "full" or lay.kind == "alst":  # ALST always checkpoints its layers
        layer += matmul + attn
    if lay.kind == "alst" and w.mlp_tile is not None:  # TiledMLP recomputes each tile's forward
        layer += 2 * B * S * 3 * h * F
    # TSP's fused loss recomputes the logits of all but the forward ring's last shard
    fused = lay.kind == "tsp" and w.shard_vocab
    head = 2 * B * S * m.vocab_size * h * (3 + (n - 1) / n if fused else 3)
    return layer / n, head / n


def attention_flops(m: ModelShape, w: Workload, lay: Layout) -> float:
    """The attention kernels' share of one decoder layer's ``step_flops`` per device."""
    S = _tsp_seq(w, lay.group) if lay.kind == "tsp" else w.seq_len
    attn = 2 * w.micro_batch * S * S * m.num_heads * m.head_dim
    full = w.recompute == "full" or lay.kind == "alst"
    return (3.5 + full) * attn / lay.group


def _phase_seconds(flops: float, transfers, c: Cluster) -> float:
    """Compute, then blocking transfers in series; overlapped ones cost what compute can't hide."""
    compute = flops / (c.peak_tflops * 1e12 * c.mfu)

    def cost(t: Transfer) -> float:
        return t.nbytes / t.bandwidth + t.calls * c.latency_us * 1e-6

    blocking = sum(cost(t) for t in transfers if not t.overlapped)
    hidden = sum(cost(t) for t in transfers if t.overlapped)
    return compute + blocking + max(0.0, hidden - compute)


def step_seconds(m: ModelShape, w: Workload, c: Cluster, lay: Layout, per_layer, per_step) -> float:
    """Estimated seconds of one training step (one micro-batch per device)."""
    layer_flops, head_flops = step_flops(m, w, lay)
    attn = attention_flops(m, w, lay)  # runs at attention_efficiency x the matmuls' rate
    layer_flops += attn / c.attention_efficiency - attn
    return m.num_layers * _phase_seconds(layer_flops, per_layer, c) + _phase_seconds(
        head_flops, per_step, c
    )
