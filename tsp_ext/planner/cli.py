"""``tsp-plan``: the command line of the planner (table, ``--json``, ``--plot``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from .calibration import MFU_RANGE, calibrate, measured_runs
from .inputs import (
    DTYPE_BYTES,
    GIB,
    GPU_PEAK_TFLOPS,
    LAYOUTS,
    OPTIMIZERS,
    RECOMPUTE,
    Cluster,
    Plan,
    Workload,
)
from .longest import Longest, longest_per_layout
from .ranking import plan
from .shapes import PRESETS, load_model


def _tsp_memory_options(a) -> None:
    """TSP's memory options among ``tsp-plan``'s flags (``--max-seq-len`` chooses them unless
    given)."""
    a(
        "--checkpoint-every",
        type=int,
        default=None,
        help="TSP, with --recompute full: keep every k-th layer's input, recompute k layers "
        "(TSPConfig(checkpoint_every); default 1, or with --max-seq-len the planner's choice)",
    )
    a(
        "--checkpoint-device-gb",
        type=float,
        default=None,
        help="TSP, with --offload-checkpoints: GiB of layer inputs kept on each device before "
        "the rest go to host (TSPConfig(checkpoint_device_bytes); default 0, or with "
        "--max-seq-len the planner's choice)",
    )
    a(
        "--head-bucket",
        type=int,
        default=None,
        help="TSP: KV heads per bucket of a head group's attention (TSPConfig(head_bucket); "
        "default the whole group, or with --max-seq-len the planner's choice)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tsp-plan",
        description="Per-device memory, communication and step time of TSP, TP, SP (Ulysses) "
        "and TP×SP layouts for one training step; recommends the fastest layout that fits.",
    )
    a = p.add_argument
    a(
        "--model",
        required=True,
        help=f"preset ({', '.join(PRESETS)}) or an HF config.json / dir of a causal LM with "
        "softmax attention (dense or MoE); refused: a vision-language config (plan its "
        "text_config as a config.json of its own) and hybrids with linear-attention layers",
    )
    a("--seq-len", type=int, help="tokens per sequence (required unless --max-seq-len)")
    a(
        "--max-seq-len",
        action="store_true",
        help="instead of one length: each layout's longest trainable sequence, every layout in "
        "its long-context configuration (docs/planner.md)",
    )
    a("--micro-batch", type=int, default=1, help="sequences per step per model replica")
    a("--devices", type=int, default=8, help="devices in all")
    a("--devices-per-node", type=int, default=8)
    a("--device-memory-gb", type=float, default=80.0, help="memory per device, GiB")
    a(
        "--reserved-gb",
        type=float,
        default=4.0,
        help="GiB per device no tensor can use: CUDA context, NCCL buffers, fragmentation",
    )
    a(
        "--host-memory-gb",
        type=float,
        default=2048.0,
        help="host memory per node, GiB (a DGX H100's 2 TiB): holds offloaded checkpoints "
        "and optimizer state",
    )
    a("--recompute", choices=RECOMPUTE, default="selective", help="activation recompute")
    a("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16", help="weights and activations")
    a(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw-master",
        help="adamw: states in the model dtype; adamw-master: fp32 master weights and states",
    )
    a("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3, help="over data parallel")
    a("--no-shard-vocab", action="store_true", help="TSP: replicated embedding and LM head")
    a("--loss-chunk", type=int, default=1024, help="TSP: tokens per fused LM-head/loss block")
    a("--no-overlap", action="store_true", help="TSP: no communication/compute overlap")
    a(
        "--mlp-tile",
        type=int,
        default=4096,
        help="tokens per MLP tile (TSP's mlp_tile, ALST's TiledMLP); 0: untiled",
    )
    a(
        "--offload-checkpoints",
        action="store_true",
        help="with --recompute full: layer checkpoints in host memory (TSP, ALST)",
    )
    _tsp_memory_options(a)
    a(
        "--offload-optimizer",
        action="store_true",
        help="optimizer state and float32 master weights in host memory (DeepSpeed)",
    )
    a("--intra-node-bw", type=float, default=300.0, help="GB/s per device inside a node")
    a("--inter-node-bw", type=float, default=40.0, help="GB/s per device across nodes")
    a(
        "--peak-tflops",
        type=float,
        default=None,
        help=f"device peak in --dtype (default {GPU_PEAK_TFLOPS:g}, an H100's dense bf16; "
        "with --calibrate on CPU runs give the CPU's, e.g. 0.1 for 2 cores)",
    )
    a("--mfu", type=float, default=0.4, help="fraction of peak the matmuls reach")
    a("--latency-us", type=float, default=10.0, help="fixed cost of one collective call")
    a(
        "--calibrate",
        metavar="JSON",
        help="fit --mfu, the link bandwidth and --latency-us to measured step times "
        "(the rows of `python -m benchmarks.run --json`) and plan with them",
    )
    a("--cores", type=int, help="with --calibrate: cores the measured ranks time-shared (CPU)")
    a("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="kinds to consider")
    a("--json", action="store_true", help="print the plan as JSON")
    a("--plot", metavar="PNG", help="also write total memory vs sequence length to PNG")
    return p


def _inputs(args: argparse.Namespace):
    model = load_model(args.model)
    if args.seq_len is None and not args.max_seq_len:
        raise ValueError("give --seq-len (tokens per sequence) or --max-seq-len")
    work = Workload(
        seq_len=args.seq_len or 1,
        micro_batch=args.micro_batch,
        dtype=args.dtype,
        optimizer=args.optimizer,
        recompute=args.recompute,
        zero_stage=args.zero_stage,
        shard_vocab=not args.no_shard_vocab,
        loss_chunk=args.loss_chunk,
        overlap=not args.no_overlap,
        mlp_tile=args.mlp_tile or None,
        offload_checkpoints=args.offload_checkpoints,
        checkpoint_every=args.checkpoint_every or 1,
        checkpoint_device_bytes=(args.checkpoint_device_gb or 0.0) * GIB,
        head_bucket=args.head_bucket,
        offload_optimizer=args.offload_optimizer,
    )
    if args.calibrate and args.cores and args.peak_tflops is None:
        raise SystemExit(
            "tsp-plan: --calibrate with --cores fits CPU runs, but --peak-tflops is a GPU's "
            f"({GPU_PEAK_TFLOPS:g}): the fitted mfu would be meaningless. Pass the measured "
            "machine's peak, e.g. --peak-tflops 0.1 for the 2-core runs of docs/benchmarks"
        )
    cluster = Cluster(
        devices=args.devices,
        devices_per_node=args.devices_per_node,
        device_memory_gb=args.device_memory_gb,
        reserved_gb=args.reserved_gb,
        host_memory_gb=args.host_memory_gb,
        intra_node_gbs=args.intra_node_bw,
        inter_node_gbs=args.inter_node_bw,
        peak_tflops=args.peak_tflops or GPU_PEAK_TFLOPS,
        mfu=args.mfu,
        latency_us=args.latency_us,
    )
    if args.calibrate:
        with open(args.calibrate) as f:
            fit = calibrate(measured_runs(json.load(f)), cluster, cores=args.cores)
        cluster = fit.cluster
        print(
            f"tsp-plan: calibrated on {len(fit.errors)} runs: mfu {cluster.mfu:.3f}, links "
            f"{cluster.intra_node_gbs:.2f} GB/s, latency {cluster.latency_us:.0f} us; worst "
            f"step-time error {fit.worst_error:.0%}",
            file=sys.stderr,
        )
        if not MFU_RANGE[0] < cluster.mfu < MFU_RANGE[1]:
            print(
                f"tsp-plan: warning: the fitted mfu {cluster.mfu:.3f} is at the edge of the range "
                f"searched ({MFU_RANGE[0]:g}-{MFU_RANGE[1]:g}): --peak-tflops "
                f"{cluster.peak_tflops:g} is probably not the measured machine's peak",
                file=sys.stderr,
            )
    return model, work, cluster


def _unit(nbytes: float) -> tuple[str, int]:
    """The binary unit that shows ``nbytes`` with a few significant digits."""
    for name, size in (("GiB", GIB), ("MiB", 2**20)):
        if nbytes >= size:
            return name, size
    return "KiB", 2**10


def format_table(result: Plan) -> str:
    """The plan as a text table: memory per device, traffic per layer, seconds per step."""
    m, w, c = result.model, result.work, result.cluster
    lines = [
        f"{m.name}: {m.params / 1e6:,.1f}M params; seq {w.seq_len} x micro-batch {w.micro_batch}, "
        f"{w.dtype}, {w.optimizer}, recompute={w.recompute}, ZeRO-{w.zero_stage}; "
        f"{c.devices} devices ({c.devices_per_node}/node, {c.device_memory_gb:g} GiB each)",
        "",
    ]
    mem_unit, mem_size = _unit(max(e.memory.total for e in result.estimates))
    comm_unit, comm_size = _unit(max(e.comm_bytes_per_layer for e in result.estimates))
    head = ("layout", "params", "grads", "optim", "activ", "transient", "total", "fits")
    head += ("comm/layer", "step")
    rows = [head, ("",) + (mem_unit,) * 6 + ("", comm_unit, "s (est)")]
    for e in result.estimates:
        mem = e.memory
        sizes = (mem.params, mem.grads, mem.optimizer, mem.activations, mem.transient, mem.total)
        rows.append(
            (str(e.layout), *(f"{x / mem_size:.2f}" for x in sizes), "yes" if e.fits else "NO")
            + (f"{e.comm_bytes_per_layer / comm_size:.1f}", f"{e.step_seconds:.3g}")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [x.rjust(wd) for x, wd in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    lines += [f"skipped {lay}: {why}" for lay, why in result.skipped]
    lines += ["", f"recommended: {result.reason}"]
    return "\n".join(lines)


def format_longest(m, w: Workload, c: Cluster, rows: list[Longest], skipped) -> str:
    """The ``--max-seq-len`` table: each layout's longest sequence, its device and host memory
    there and what stops it, with its ratio to ALST's on all devices."""
    host = "no host limit" if c.host_memory_gb is None else f"{c.host_memory_gb:g} GiB host/node"
    lines = [
        f"{m.name}: {m.params / 1e6:,.1f}M params; micro-batch {w.micro_batch}, {w.dtype}, "
        f"{w.optimizer}; {c.devices} devices ({c.devices_per_node}/node, "
        f"{c.device_memory_gb:g} GiB each, {c.reserved_gb:g} reserved), {host}",
        "each layout in its long-context configuration (layer checkpointing; TSP and ALST: "
        "checkpoints and optimizer in host memory, MLP tiles of h tokens)",
        "",
    ]
    alst = next((r for r in rows if r.layout.kind == "alst" and r.layout.sp == c.devices), None)
    head = ("layout", "max seq len", "vs alst", "device GiB", "host GiB/node", "limited by")
    table = [head]
    per_node = min(c.devices, c.devices_per_node)
    for r in rows:
        if r.seq_len is None:
            table.append((str(r.layout), "none fits", "", "", "", f"{r.limit} memory"))
            continue
        ratio = f"{r.seq_len / alst.seq_len:.2f}" if alst and alst.seq_len else ""
        table.append(
            (
                str(r.layout),
                f"{r.seq_len:,}",
                ratio,
                f"{r.memory.total / GIB:.1f}",
                f"{r.memory.host * per_node / GIB:.1f}",
                f"{r.limit} memory" if r.limit != "search limit" else r.limit,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        cells = [row[0].ljust(widths[0])] + [x.rjust(wd) for x, wd in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    for r in rows:
        if r.options is not None and r.seq_len is not None:
            lines.append(f"{r.layout} runs {tsp_config_text(r.options)}")
    lines += [f"skipped {lay}: {why}" for lay, why in skipped]
    return "\n".join(lines)


def tsp_config_text(options: dict) -> str:
    """The TSP memory options of a ``--max-seq-len`` row as the ``TSPConfig`` call that sets
    them, on top of the long-context configuration."""
    parts = ["checkpoint_layers=True", "offload_checkpoints=True"]
    if options["checkpoint_every"] > 1:
        parts.append(f"checkpoint_every={options['checkpoint_every']}")
    if options["checkpoint_device_bytes"]:
        parts.append(f"checkpoint_device_bytes={options['checkpoint_device_bytes']:_}")
    if options["head_bucket"] is not None:
        parts.append(f"head_bucket={options['head_bucket']}")
    return f"TSPConfig({', '.join(parts)}, mlp_tile=h, overlap=False)"


def plot_memory(result: Plan, path: str) -> None:
    """Write total memory per device vs sequence length (log-log) for every layout to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from err
    m, w, c = result.model, result.work, result.cluster
    top = max(w.seq_len * 2, 2048)
    lengths = [2**k for k in range(10, top.bit_length())]
    curves: dict = {e.layout: [] for e in result.estimates}
    kinds = tuple({e.layout.kind for e in result.estimates})
    for n in lengths:
        for e in plan(m, replace(w, seq_len=n), c, kinds).estimates:
            if e.layout in curves:
                curves[e.layout].append((n, e.memory.total / GIB))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    style = {"tsp": "-", "tp": "--", "sp": ":", "tpxsp": "-.", "alst": (0, (5, 1))}
    for i, (lay, points) in enumerate(curves.items()):
        ax.plot(
            *zip(*points), linestyle=style[lay.kind], color=f"C{i % 10}", marker=".", label=str(lay)
        )
    ax.axhline(c.device_memory_gb, color="k", linestyle="--", label="device memory")
    ax.axvline(w.seq_len, color="grey", linestyle=":")
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="GiB per device")
    ax.set_title(f"{m.name}, {c.devices} devices, recompute={w.recompute}, {w.dtype}")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tsp-plan``."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        inputs = _inputs(args)
        if args.max_seq_len:
            given = (args.checkpoint_every, args.checkpoint_device_gb, args.head_bucket)
            choose = all(g is None for g in given)
            return _print_longest(*inputs, tuple(args.layouts), args.json, choose)
        result = plan(*inputs, kinds=tuple(args.layouts))
        if args.plot:
            plot_memory(result, args.plot)
    except ValueError as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        for lay, why in result.skipped:
            print(f"tsp-plan: skipped {lay}: {why}", file=sys.stderr)
        print(f"tsp-plan: recommended: {result.reason}", file=sys.stderr)
    else:
        print(format_table(result))
    return 0


def _print_longest(
    m, w: Workload, c: Cluster, kinds: tuple[str, ...], as_json: bool, choose: bool
) -> int:
    rows, skipped = longest_per_layout(m, w, c, kinds, choose=choose)
    if not rows:
        why = "; ".join(f"{lay}: {r}" for lay, r in skipped) or "no layout of these kinds"
        raise SystemExit(f"tsp-plan: no layout can run {m.name} on {c.devices} devices ({why})")
    if as_json:
        print(json.dumps({"max_seq_len": [r.as_dict() for r in rows]}, indent=2))
        for lay, why in skipped:
            print(f"tsp-plan: skipped {lay}: {why}", file=sys.stderr)
    else:
        print(format_longest(m, w, c, rows, skipped=skipped))
    return 0
