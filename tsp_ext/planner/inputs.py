"""The planner's inputs (workload, cluster, layout) and its results (memory, transfers,
estimates, the plan)."""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "adamw-master")
LAYOUTS = ("tsp", "tp", "sp", "tpxsp", "alst")
GIB = 2**30
GPU_PEAK_TFLOPS = 989.0  # an H100 SXM's dense bf16 peak: the default device


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
    mlp_tile: int | None = (
        4096  # tokens per MLP tile (TSP's mlp_tile; ALST's TiledMLP); None: untiled
    )
    offload_checkpoints: bool = False  # layer inputs wait for backward in host memory
    # TSP with recompute="full": only every k-th layer's input kept, the k layers recomputed
    checkpoint_every: int = 1
    # TSP with offload_checkpoints: bytes of the inputs each device keeps before the host
    checkpoint_device_bytes: float = 0.0
    head_bucket: int | None = None  # TSP: KV heads per bucket of a head group's attention
    offload_optimizer: bool = False  # optimizer state (and float32 master copies) in host memory
    offload_params: bool = False  # ZeRO-3 weight partitions in host memory (ALST on one device)
    moe_schedule: str = (
        "auto"  # TSP's MoE layers: "ring", "all_to_all" or "auto" (engine.feed_forward.moe)
    )

    def __post_init__(self) -> None:
        checks = [
            (self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}"),
            (self.micro_batch >= 1, f"micro_batch must be >= 1, got {self.micro_batch}"),
            (self.dtype in DTYPE_BYTES, f"dtype must be one of {', '.join(DTYPE_BYTES)}"),
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}"),
            (self.recompute in RECOMPUTE, f"recompute must be one of {', '.join(RECOMPUTE)}"),
            (self.zero_stage in (0, 1, 2, 3), f"zero_stage must be 0-3, got {self.zero_stage}"),
            (self.loss_chunk >= 1, f"loss_chunk must be >= 1, got {self.loss_chunk}"),
            (
                self.moe_schedule in ("auto", "ring", "all_to_all"),
                f"moe_schedule must be auto, ring or all_to_all, got {self.moe_schedule!r}",
            ),
            (
                self.mlp_tile is None or self.mlp_tile >= 1,
                f"mlp_tile must be >= 1 or None, got {self.mlp_tile}",
            ),
            (self.checkpoint_every >= 1, f"checkpoint_every must be >= 1: {self.checkpoint_every}"),
            (
                self.head_bucket is None or self.head_bucket >= 1,
                f"head_bucket must be >= 1 or None: {self.head_bucket}",
            ),
            (
                self.checkpoint_device_bytes >= 0,
                f"checkpoint_device_bytes must be >= 0: {self.checkpoint_device_bytes}",
            ),
            (
                not self.offload_checkpoints or self.recompute == "full",
                "offload_checkpoints moves each layer's checkpointed input to host memory: it "
                "needs recompute='full'",
            ),
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
    peak_tflops: float = GPU_PEAK_TFLOPS
    mfu: float = 0.4
    latency_us: float = 10.0
    attention_efficiency: float = 1.0  # attention kernels' FLOP rate relative to the matmuls'
    reserved_gb: float = 0.0  # per device, outside tensors: CUDA context, NCCL, fragmentation
    host_memory_gb: float | None = None  # per node; None: not a limit

    def __post_init__(self) -> None:
        if self.devices < 1 or self.devices_per_node < 1:
            raise ValueError("devices and devices_per_node must be >= 1")
        rates = (self.intra_node_gbs, self.inter_node_gbs, self.peak_tflops, self.mfu)
        if min(*rates, self.attention_efficiency) <= 0:
            raise ValueError("bandwidths, peak_tflops, mfu and attention_efficiency must be > 0")
        if not 0 <= self.reserved_gb < self.device_memory_gb:
            raise ValueError(
                f"reserved_gb={self.reserved_gb} must be >= 0 and below device_memory_gb="
                f"{self.device_memory_gb}"
            )
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            raise ValueError(f"host_memory_gb must be > 0, got {self.host_memory_gb}")

    @property
    def memory_bytes(self) -> float:
        """Bytes per device that tensors may use (device memory less the reserve)."""
        return (self.device_memory_gb - self.reserved_gb) * GIB

    def host_fits(self, host_per_device: float) -> bool:
        """Whether a node's host memory holds ``host_per_device`` bytes for each of its devices."""
        if self.host_memory_gb is None:
            return True
        return (
            host_per_device * min(self.devices, self.devices_per_node) <= self.host_memory_gb * GIB
        )

    def bandwidth(self, stride: int, size: int) -> float:
        """Bytes/s of a group of ``size`` devices ``stride`` ranks apart (ranks fill nodes)."""
        crosses = stride * size > self.devices_per_node and size > 1
        return (self.inter_node_gbs if crosses else self.intra_node_gbs) * 1e9


@dataclass(frozen=True)
class Layout:
    """A layout of the devices: ``kind`` on its model-parallel group, ZeRO data parallel on
    ``dp``. TSP folds both: ``tp == sp == D``, the one axis that shards weights and tokens.
    ALST (Ulysses SP over ``sp``) runs ZeRO-3 over all ``sp x dp`` devices."""

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
            "alst": f"alst sp={self.sp}",
        }[self.kind]
        return axes + (f" dp={self.dp}" if self.dp > 1 else "")


@dataclass(frozen=True)
class Memory:
    """Per-device bytes: model state, saved activations, peak transient buffers on the device;
    ``host``: what the device keeps in host memory (offloaded checkpoints, optimizer state)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self) -> dict[str, int]:
        keys = ("params", "grads", "optimizer", "activations", "transient", "total", "host")
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
