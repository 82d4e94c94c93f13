"""Single-rank emulation: one rank of a D-rank layout, alone, on PyTorch's fake process group.

The fake group's collectives return at once without moving data, so one process builds exactly
the shards, buffers and saved tensors rank ``r`` of a real D-rank run would hold: its peak memory,
saved-activation bytes and per-collective byte counts are real at scales no test machine can run
(the paper's 7B at 128K tokens on 8 devices needs one GPU, not eight). Losses and step times are
not meaningful (no data arrives, no transfer time is paid).

Data-dependent collectives need plausible contents, or the code that reads them fails:
``mirror.Mirror`` fills every all-to-all and all-gather output as if all ranks held this rank's
data, which is what TSP's vocabulary-sharded embedding exchanges (row counts, then row ids) need
to stay in range.

    python -m benchmarks.emulate                                   # paper 7B, 1 layer, CPU
    python -m benchmarks.emulate --devices 8 --seq-len 131072 --layers 32 --device cuda
    python -m benchmarks.emulate --fake --model llama3-8b --seq-len 4194304 --layout tsp_long \\
        --dtype bfloat16                                           # fake tensors: emulate_fake
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tsp_ext.planner import PRESETS
from tsp_ext.testing.launch import run_processes

from .harness import row_header, train_rank
from .mirror import Mirror

log = logging.getLogger("benchmarks.emulate")

# the paper's 7B (MHA, SwiGLU with F = 4h, Llama-2 vocabulary): the planner's preset
PAPER_7B = PRESETS["paper-7b"].hf_config_kwargs()


def _emulated_rank(rank: int, world: int, spec: dict) -> dict:
    with Mirror():
        return train_rank(rank, world, spec)


def emulate(
    layout: str = "tsp",
    devices: int = 8,
    seq_len: int = 8192,
    model_cfg: dict | None = None,
    rank: int = 0,
    micro_batch: int = 1,
    dtype: str = "float32",
    *,
    device: str = "cpu",
    timeout: float = 3600.0,
) -> dict:
    """Measure rank ``rank`` of a ``devices``-rank ``layout`` alone; returns a harness row with
    ``emulated=True`` and ``rank`` (memory and communication bytes are this rank's;
    ``step_seconds`` means nothing, and ``loss`` / ``final_loss`` are None: the fake group's
    collectives move no data, so the loss is not a number). ``model_cfg``: overrides of a 1-layer
    slice of the paper's 7B.
    """
    model = {**PAPER_7B, "num_hidden_layers": 1, **(model_cfg or {})}
    spec = dict(
        layout=layout,
        seq_len=seq_len,
        model=model,
        micro_batch=micro_batch,
        steps=1,
        warmup=1,
        dtype=dtype,
        device=device,
        release_from_start=False,
    )
    (result,) = run_processes(
        _emulated_rank,
        devices,
        spec,
        backend="fake",
        timeout=timeout,
        ranks=[rank],
    )
    result.pop("times", None)
    result.update(loss=None, final_loss=None)  # JSON has no NaN
    header = row_header(layout, devices, seq_len, micro_batch, dtype, model)
    return {**header, "emulated": True, "rank": rank, **result}


def _model_arg(text: str) -> dict:
    """``--model``: a planner preset's name or config overrides as JSON."""
    return PRESETS[text].hf_config_kwargs() if text in PRESETS else json.loads(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.emulate", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--layout", default="tsp")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: 1, or the preset's)"
    )
    ap.add_argument(
        "--model",
        type=_model_arg,
        default=None,
        help="a planner preset (e.g. llama3-8b) or JSON overrides of the paper-7B slice",
    )
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--fake",
        action="store_true",
        help="fake tensors in this process (benchmarks.emulate_fake; TSP layouts, any scale)",
    )
    ap.add_argument(
        "--tsp-options",
        type=json.loads,
        default=None,
        help="with --fake and tsp_long: TSPConfig fields as JSON on top of tsp_long's, "
        "e.g. '{\"checkpoint_every\": 2}' (the planner's choice)",
    )
    ap.add_argument("--json", help="write the row here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = {"num_hidden_layers": 1, **(args.model or {})}
    if args.layers is not None:
        model["num_hidden_layers"] = args.layers
    if args.fake:
        from .emulate_fake import measure_rank

        row = measure_rank(
            args.layout,
            args.devices,
            args.seq_len,
            {**PAPER_7B, **model},
            args.rank,
            args.micro_batch,
            args.dtype,
            tsp_options=args.tsp_options,
        )
    else:
        row = emulate(
            args.layout,
            args.devices,
            args.seq_len,
            model,
            args.rank,
            args.micro_batch,
            args.dtype,
            device=args.device,
        )
    text = json.dumps(row, indent=1, allow_nan=False)
    sys.stdout.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
