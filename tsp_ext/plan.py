"""Layout planner: per-device memory, communication and step time of TSP, TP, SP and TP×SP.

The estimates follow what the code actually keeps, tensor by tensor (see ``docs/planner.md``):
this repo's TSP engine (``attention.py``, ``mlp.py``, the vocab-sharded head) and the baselines
as the benchmark harness runs them (Hugging Face Llama under DTensor TP with the model's tp plan,
DeepSpeed Ulysses, both composed for TP×SP). Data parallelism with ZeRO fills the devices a layout
leaves over. Plain arithmetic: this module uses no torch.

    from tsp_ext.plan import Cluster, PRESETS, Workload, plan
    result = plan(PRESETS["paper-7b"], Workload(seq_len=131072, recompute="full"), Cluster())
    print(result.recommended.layout, result.reason)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "adamw-master")
LAYOUTS = ("tsp", "tp", "sp", "tpxsp")
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that decide memory and communication."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Mapping, name: str = "custom") -> ModelShape:
        """From a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3 keys)."""
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in (*required, "intermediate_size", "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(
                f"config {name!r} lacks {', '.join(missing)}: not a Llama-family config"
            )
        h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        return cls(
            name=name,
            hidden_size=h,
            num_layers=cfg["num_hidden_layers"],
            num_heads=nh,
            num_kv_heads=cfg.get("num_key_value_heads") or nh,
            head_dim=cfg.get("head_dim") or h // nh,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        )

    @property
    def params(self) -> int:
        """Total parameter count."""
        full = _layer_params(self, self.num_heads, self.num_kv_heads, self.intermediate_size)
        return self.num_layers * full + _vocab_params(self, self.vocab_size, self.vocab_size)


PRESETS = {
    # the benchmark harness's default model (benchmarks/harness.py)
    "tiny": ModelShape("tiny", 256, 2, 8, 4, 32, 704, 2048),
    # the paper's 7B: MHA, SwiGLU with F = 4h (8.85B parameters with this vocabulary)
    "paper-7b": ModelShape("paper-7b", 4096, 32, 32, 32, 128, 16384, 32000),
    "llama3-8b": ModelShape("llama3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
    "llama3-70b": ModelShape("llama3-70b", 8192, 80, 64, 8, 128, 28672, 128256),
}


def load_model(spec: str) -> ModelShape:
    """A preset name, or the path of a Hugging Face ``config.json`` (or of its directory)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file"
        )
    return ModelShape.from_hf_config(json.loads(path.read_text()), name=spec)


@dataclass(frozen=True)
class Workload:
    """One training step: micro-batch, sequence, precision, optimizer, recompute and the TSP
    engine options that change memory (``TSPConfig`` defaults)."""

    seq_len: int
    micro_batch: int = 1
    dtype: str = "bfloat16"
    optimizer: str = "adamw-master"  # bf16 weights + fp32 master and Adam states (16 B/param)
    recompute: str = "selective"
    zero_stage: int = 3  # ZeRO / FSDP sharding of model state over the data-parallel devices
    shard_vocab: bool = True
    loss_chunk: int = 1024
    overlap: bool = True
    attn_block: int = 512

    def __post_init__(self) -> None:
        checks = [
            (self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}"),
            (self.micro_batch >= 1, f"micro_batch must be >= 1, got {self.micro_batch}"),
            (self.dtype in DTYPE_BYTES, f"dtype must be one of {', '.join(DTYPE_BYTES)}"),
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}"),
            (self.recompute in RECOMPUTE, f"recompute must be one of {', '.join(RECOMPUTE)}"),
            (self.zero_stage in (0, 1, 2, 3), f"zero_stage must be 0-3, got {self.zero_stage}"),
            (self.loss_chunk >= 1, f"loss_chunk must be >= 1, got {self.loss_chunk}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def beta(self) -> int:
        """Bytes per element of weights and activations."""
        return DTYPE_BYTES[self.dtype]

    @property
    def acc(self) -> int:
        """Bytes per element of float32-or-wider accumulators and softmax statistics."""
        return max(4, self.beta)


@dataclass(frozen=True)
class Cluster:
    """Devices and their links. Bandwidths are per device, one direction, in GB/s."""

    devices: int = 8
    devices_per_node: int = 8
    device_memory_gb: float = 80.0
    intra_node_gbs: float = 300.0
    inter_node_gbs: float = 40.0
    peak_tflops: float = 989.0
    mfu: float = 0.4
    latency_us: float = 10.0

    def __post_init__(self) -> None:
        if self.devices < 1 or self.devices_per_node < 1:
            raise ValueError("devices and devices_per_node must be >= 1")
        if min(self.intra_node_gbs, self.inter_node_gbs, self.peak_tflops, self.mfu) <= 0:
            raise ValueError("bandwidths, peak_tflops and mfu must be > 0")

    @property
    def memory_bytes(self) -> float:
        return self.device_memory_gb * GIB

    def bandwidth(self, stride: int, size: int) -> float:
        """Bytes/s of a group of ``size`` devices ``stride`` ranks apart (ranks fill nodes)."""
        crosses = stride * size > self.devices_per_node and size > 1
        return (self.inter_node_gbs if crosses else self.intra_node_gbs) * 1e9


@dataclass(frozen=True)
class Layout:
    """A layout of the devices: ``kind`` on its model-parallel group, ZeRO data parallel on
    ``dp``. TSP folds both: ``tp == sp == D``, the one axis that shards weights and tokens."""

    kind: str
    tp: int
    sp: int
    dp: int

    @property
    def group(self) -> int:
        """Devices of the model-parallel group."""
        return self.tp if self.kind == "tsp" else self.tp * self.sp

    def __str__(self) -> str:
        axes = {
            "tsp": f"tsp={self.tp}",
            "tp": f"tp={self.tp}",
            "sp": f"sp={self.sp}",
            "tpxsp": f"tp={self.tp} x sp={self.sp}",
        }[self.kind]
        return axes + (f" dp={self.dp}" if self.dp > 1 else "")


@dataclass(frozen=True)
class Memory:
    """Per-device bytes: model state, saved activations, peak transient buffers."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self) -> dict[str, int]:
        keys = ("params", "grads", "optimizer", "activations", "transient", "total")
        return {k: int(round(getattr(self, k))) for k in keys}


@dataclass(frozen=True)
class Transfer:
    """One kind of collective traffic: bytes received per device, the number of calls, and
    whether it can hide behind compute."""

    name: str
    nbytes: float
    calls: int
    overlapped: bool
    bandwidth: float  # bytes/s of the group it runs on


@dataclass(frozen=True)
class Estimate:
    """One layout's per-device memory, transfers and estimated step time."""

    layout: Layout
    memory: Memory
    per_layer: tuple[Transfer, ...]  # one decoder layer, forward + backward
    per_step: tuple[Transfer, ...]  # embedding, LM head, replicated-weight gradients
    step_seconds: float
    fits: bool

    @property
    def comm_bytes_per_layer(self) -> float:
        return sum(t.nbytes for t in self.per_layer)

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.kind,
            "tp": self.layout.tp,
            "sp": self.layout.sp,
            "memory_bytes": self.memory.as_dict(),
            "comm_bytes_per_layer": int(round(self.comm_bytes_per_layer)),
            "est_step_seconds": self.step_seconds,
        }


@dataclass(frozen=True)
class Plan:
    """Every valid layout's estimate, the skipped ones with the reason, the recommendation."""

    model: ModelShape
    work: Workload
    cluster: Cluster
    estimates: tuple[Estimate, ...]
    skipped: tuple[tuple[Layout, str], ...]
    recommended: Estimate | None
    reason: str = ""

    def as_dict(self) -> dict:
        """The ``--json`` document."""
        rec = self.recommended
        return {
            "layouts": [e.as_dict() for e in self.estimates],
            "recommended": None
            if rec is None
            else {"layout": rec.layout.kind, "tp": rec.layout.tp, "sp": rec.layout.sp},
        }


# ---- parameters ----------------------------------------------------------------------------------


def _layer_params(m: ModelShape, heads: float, kv_heads: float, ffn: float) -> float:
    """Parameters of one decoder layer holding ``heads`` query heads, ``kv_heads`` KV heads and
    ``ffn`` MLP columns (norm weights replicated)."""
    h, d = m.hidden_size, m.head_dim
    bias = (heads + 2 * kv_heads) * d if m.qkv_bias else 0
    return 2 * h * d * (heads + kv_heads) + bias + 3 * h * ffn + 2 * h


def _vocab_params(m: ModelShape, embed_rows: float, head_rows: float) -> float:
    """Embedding and LM-head rows held (one table when tied) plus the final norm."""
    head = 0 if m.tie_embeddings else head_rows
    return (embed_rows + head) * m.hidden_size + m.hidden_size


def _heads(m: ModelShape, n: int) -> tuple[float, float]:
    """Query and KV heads per rank when n ranks split the heads (KV replicated if n > n_kv)."""
    return m.num_heads / n, m.num_kv_heads / min(n, m.num_kv_heads)


def _shard_params(m: ModelShape, n: int) -> float:
    """One decoder layer's parameters on each of n ranks that split heads and MLP width."""
    return _layer_params(m, *_heads(m, n), m.intermediate_size / n)


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


# ---- saved activations ---------------------------------------------------------------------------


def _tsp_seq(w: Workload, D: int) -> int:
    """The sequence as TSP runs it: right-padded to a multiple of 2·D."""
    return -(-w.seq_len // (2 * D)) * 2 * D


def _norm_saved(w: Workload, tokens: float, width: int) -> float:
    """RMSNorm (HF and TSP alike): float32 input (a copy unless float32), the normalised output
    in the model dtype, and the float32 reciprocal RMS per token."""
    return w.micro_batch * tokens * (width * (4 + w.beta) + 4)


def _head_saved(m: ModelShape, w: Workload, tokens: float, vocab: float) -> float:
    """Final norm, LM-head input, float32 log-softmax ``[tokens, vocab]`` (vocab 0 for the
    fused loss), token ids and labels, and the rotary cos/sin that all layers share."""
    B, h = w.micro_batch, m.hidden_size
    return _norm_saved(w, tokens, h) + B * tokens * (
        h * w.beta + 4 * vocab + 16 + 2 * m.head_dim * w.beta
    )


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
    return 2 * _norm_saved(w, T, h) + attn + mlp


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


# ---- per-layout memory ------------------------------------------------------------------------


def tsp_memory(m: ModelShape, w: Workload, lay: Layout) -> Memory:
    """TSP on D = lay.tp ranks: layer weights / D, tokens / D, vocabulary rows / D and a fused
    chunked loss when ``shard_vocab``; ZeRO over dp."""
    D, B, h, F = lay.tp, w.micro_batch, m.hidden_size, m.intermediate_size
    T = _tsp_seq(w, D) / D
    vocab = m.vocab_size / (D if w.shard_vocab else 1)
    params = m.num_layers * _shard_params(m, D) + _vocab_params(m, vocab, vocab)
    if w.shard_vocab:  # fused loss: float32 log-sum-exp per token, the owned ids' list
        head = _head_saved(m, w, T, 0) + B * T * w.acc + 8 * min(vocab, B * w.seq_len)
    else:
        head = _head_saved(m, w, T, m.vocab_size)
    acts = m.num_layers * tsp_layer_saved(m, w, D) + head
    # transient: double-buffered weight shards and their float32 gradient accumulators, one
    # head group's gathered K/V with its float32 gradient, one MLP shard's intermediates
    nh, nkv = _heads(m, D)
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


# ---- communication -------------------------------------------------------------------------------


def tsp_comm(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> tuple[list, list]:
    """Per-layer and per-step transfers of TSP: weights broadcast (attention) and ringed (MLP)
    in forward and again in backward, weight gradients reduced to owners, K/V all-gathered and
    dK/dV reduce-scattered; embedding rows exchanged and LM-head shards ringed (shard_vocab)
    or the replicated vocabulary gradients all-reduced."""
    D, B, h, d, b, acc = lay.tp, w.micro_batch, m.hidden_size, m.head_dim, w.beta, w.acc
    bw, ov = c.bandwidth(1, D), w.overlap
    nh, nkv = _heads(m, D)
    attn = _layer_params(m, nh, nkv, 0) - 2 * h  # one head group's q/k/v/o shard
    mlp = 3 * h * m.intermediate_size / D
    kv = 2 * B * _tsp_seq(w, D) * nkv * d * (D - 1)  # elements received, all D groups
    layer = [
        Transfer("broadcast attention weights (fwd+bwd)", 2 * (D - 1) * attn * b, 2 * D, ov, bw),
        Transfer("reduce attention weight grads", (D - 1) * attn * acc, D, ov, bw),
        Transfer("ring MLP weights (fwd+bwd)", 2 * (D - 1) * mlp * b, 2 * (D - 1), ov, bw),
        Transfer("ring MLP weight grads", (D - 1) * mlp * acc, D - 1, ov, bw),
        Transfer("all-gather K/V (fwd)", kv * b, D, False, bw),
        Transfer("all-gather K/V (bwd)", kv * b, D, ov, bw),
        Transfer("reduce-scatter dK/dV", kv * acc, D, False, bw),
        Transfer("all-reduce norm grads", 2 * 2 * (D - 1) / D * h * b, 2, False, bw),
    ]
    if D > m.num_kv_heads:  # shared KV heads: their copies' gradients are all-reduced
        shared = 2 * (D - 1) / D * 2 * h * d * acc * m.num_kv_heads
        layer.append(Transfer("all-reduce shared K/V grads", shared, m.num_kv_heads, False, bw))
    T, V = _tsp_seq(w, D) / D, m.vocab_size
    if w.shard_vocab:
        ring = (D - 1) * V / D * h
        step = [
            Transfer(
                "ring LM-head shards (fwd+bwd)", 2 * ring * b + ring * acc, 3 * (D - 1), ov, bw
            ),
            Transfer("all-to-all embedding rows", 2 * (D - 1) / D * B * T * h * b, 2, False, bw),
        ]
    else:
        tables = 1 if m.tie_embeddings else 2
        step = [Transfer("all-reduce vocab grads", 2 * (D - 1) / D * V * h * b * tables, 2, ov, bw)]
    return layer + _dp_comm(m, w, c, lay, _shard_params(m, D)), step


def baseline_comm(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> tuple[list, list]:
    """Per-layer and per-step transfers of TP / SP / TP×SP. TP (DTensor, HF plan): all-reduces
    of ``[B, S/sp, h]``, two in forward (o_proj, down_proj) and five in backward (the input
    gradients of q, k, v, gate, up, each its own column-parallel linear); per step the vocab-
    parallel embedding's output and the LM-head input gradient, and the gathered logits.
    Ulysses: eight all-to-alls of q, k, v and the output (heads / tp) and the all-reduce of
    the weight gradients over the SP group (every rank saw other tokens)."""
    tp, sp, B, h, d, b = lay.tp, lay.sp, w.micro_batch, m.hidden_size, m.head_dim, w.beta
    T, V = w.seq_len / sp, m.vocab_size
    layer, step = [], []
    if tp > 1:
        bw, ar = c.bandwidth(1, tp), 2 * (tp - 1) / tp * B * T * h * b
        layer.append(Transfer("all-reduce activations", 7 * ar, 7, False, bw))
        step += [
            Transfer("all-reduce embedding out / LM-head in grad", 2 * ar, 2, False, bw),
            Transfer("all-gather logits", (tp - 1) / tp * B * T * V * b, 1, False, bw),
        ]
    if sp > 1:
        bw, g = c.bandwidth(tp, sp), (sp - 1) / sp
        nh, nkv = _heads(m, tp)
        a2a = 2 * g * B * T * (2 * nh + 2 * max(nkv, sp)) * d * b
        grads = 2 * g * _shard_params(m, tp) * b
        vocab = 2 * g * (_vocab_params(m, V / tp, V / tp) + V * h * (1 - 1 / tp)) * b
        layer += [
            Transfer("all-to-all q/k/v/out (fwd+bwd)", a2a, 8, False, bw),
            Transfer("all-reduce weight grads over sp", grads, 1, True, bw),
        ]
        step.append(Transfer("all-reduce vocab grads over sp", vocab, 1, True, bw))
    return layer + _dp_comm(m, w, c, lay, _shard_params(m, tp)), step


def _dp_comm(m: ModelShape, w: Workload, c: Cluster, lay: Layout, params: float) -> list:
    """ZeRO / DDP over dp, per layer: ZeRO-3 gathers the weights in forward and in backward and
    reduce-scatters the gradients; lower stages reduce gradients and gather updated weights."""
    if lay.dp == 1:
        return []
    times = 3 if w.zero_stage == 3 else 2
    nbytes = times * (lay.dp - 1) / lay.dp * params * w.beta
    return [Transfer("data parallel (ZeRO)", nbytes, times, True, c.bandwidth(lay.group, lay.dp))]


COMM = {"tsp": tsp_comm, "tp": baseline_comm, "sp": baseline_comm, "tpxsp": baseline_comm}


# ---- time ----------------------------------------------------------------------------------------


def step_flops(m: ModelShape, w: Workload, lay: Layout) -> tuple[float, float]:
    """FLOPs per device of (one decoder layer, the LM head) for one training step: 3× the
    forward matmuls, causal attention 3.5× its forward, plus what each layout recomputes."""
    n = lay.group
    B, S, h, d, F = w.micro_batch, w.seq_len, m.hidden_size, m.head_dim, m.intermediate_size
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
    if w.recompute == "full":
        layer += matmul + attn
    head = 2 * B * S * m.vocab_size * h * (4 if lay.kind == "tsp" and w.shard_vocab else 3)
    return layer / n, head / n


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
    return m.num_layers * _phase_seconds(layer_flops, per_layer, c) + _phase_seconds(
        head_flops, per_step, c
    )


# ---- candidates and the plan ---------------------------------------------------------------------


def candidates(devices: int) -> list[Layout]:
    """Every TSP, TP and SP size >= 2 and every TP×SP pair that divides the device count."""
    sizes = [n for n in range(2, devices + 1) if devices % n == 0]
    out = [Layout("tsp", n, n, devices // n) for n in sizes]
    out += [Layout("tp", n, 1, devices // n) for n in sizes]
    out += [Layout("sp", 1, n, devices // n) for n in sizes]
    out += [
        Layout("tpxsp", a, n // a, devices // n)
        for n in sizes
        for a in sizes
        if n % a == 0 and 2 <= a < n
    ]
    return out


def check(m: ModelShape, w: Workload, lay: Layout) -> str | None:
    """Why ``lay`` cannot run this model and workload (what to change), or None when it can."""
    if lay.kind == "tsp":
        D, nkv = lay.tp, m.num_kv_heads
        reasons = [
            (m.num_heads % D, f"num_heads={m.num_heads} is not divisible by tsp={D}"),
            (nkv % D and D % nkv, f"num_kv_heads={nkv} and tsp={D}: one must divide the other"),
            (m.intermediate_size % D, f"intermediate_size={m.intermediate_size} % tsp={D} != 0"),
            (
                w.shard_vocab and m.vocab_size % D,
                f"vocab_size={m.vocab_size} is not divisible by tsp={D}: pad the vocabulary or "
                "turn off vocabulary sharding",
            ),
        ]
        return next((msg for bad, msg in reasons if bad), None)
    if lay.tp > 1:
        t = lay.tp
        reasons = [
            (m.num_heads % t, f"num_heads={m.num_heads} is not divisible by tp={t}"),
            (m.num_kv_heads % t, f"num_kv_heads={m.num_kv_heads} is not divisible by tp={t}"),
            (m.intermediate_size % t, f"intermediate_size={m.intermediate_size} % tp={t} != 0"),
        ]
        reason = next((msg for bad, msg in reasons if bad), None)
        if reason:
            return reason
    if lay.sp > 1:
        s, nh, nkv = lay.sp, m.num_heads // lay.tp, m.num_kv_heads // lay.tp
        reasons = [
            (nh % s, f"{nh} query heads per TP rank are not divisible by sp={s}"),
            (
                nkv % s and s % nkv,
                f"{nkv} KV heads per TP rank and sp={s}: one must divide the other",
            ),
            (w.seq_len % s, f"seq_len={w.seq_len} is not divisible by sp={s}"),
        ]
        return next((msg for bad, msg in reasons if bad), None)
    return None


def estimate(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> Estimate:
    """Memory, communication and step time of one layout (assumed valid: see ``check``)."""
    memory = MEMORY[lay.kind](m, w, lay)
    per_layer, per_step = COMM[lay.kind](m, w, c, lay)
    seconds = step_seconds(m, w, c, lay, per_layer, per_step)
    fits = memory.total <= c.memory_bytes
    return Estimate(lay, memory, tuple(per_layer), tuple(per_step), seconds, fits)


def plan(m: ModelShape, w: Workload, c: Cluster, kinds: tuple[str, ...] = LAYOUTS) -> Plan:
    """Estimate every valid layout of ``c.devices`` and recommend the fastest that fits.

    Raises ``ValueError`` naming what to change when no layout can run at all.
    """
    estimates, skipped = [], []
    for lay in candidates(c.devices):
        if lay.kind not in kinds:
            continue
        reason = check(m, w, lay)
        if reason is None:
            estimates.append(estimate(m, w, c, lay))
        else:
            skipped.append((lay, reason))
    if not estimates:
        why = "; ".join(f"{lay}: {r}" for lay, r in skipped) or "no model-parallel size divides it"
        raise ValueError(
            f"no layout can run {m.name} on {c.devices} devices ({why}): choose --devices with "
            "divisors that divide the model's heads and MLP width (and --seq-len the SP size)"
        )
    recommended, reason = _recommend(estimates, c)
    return Plan(m, w, c, tuple(estimates), tuple(skipped), recommended, reason)


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit (KiB to GiB) that keeps it >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _recommend(estimates: list[Estimate], c: Cluster) -> tuple[Estimate | None, str]:
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_seconds)
    if not fitting:
        best = min(estimates, key=lambda e: e.memory.total)
        return None, (
            f"no layout fits in {c.device_memory_gb:g} GiB per device; the smallest, "
            f"{best.layout}, needs {format_bytes(best.memory.total)}: add devices, use "
            "--recompute full, or shorten --seq-len / --micro-batch"
        )
    best = fitting[0]
    why = (
        f"{best.layout}: the lowest estimated step time ({best.step_seconds:.3g} s) of the "
        f"{len(fitting)} layouts that fit in {c.device_memory_gb:g} GiB (it needs "
        f"{format_bytes(best.memory.total)})"
    )
    if len(fitting) > 1:
        nxt = fitting[1]
        why += f"; next: {nxt.layout} at {nxt.step_seconds:.3g} s"
    return best, why
