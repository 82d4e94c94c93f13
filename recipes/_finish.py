"""The start of a Trainer recipe run (Accelerate, logging, ``--model`` and ``--tsp-size``) and
the end of every recipe run: the final evaluation's record, then an orderly shutdown."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from _model import model_config, resolve_model
from accelerate import Accelerator


def start(args, seq_len: int | None = None, text_model: bool = True) -> tuple[Accelerator, bool]:
    """Accelerate and the log (INFO on the main process) for a Trainer recipe, ``--model``
    resolved, its ``--rope-*`` extension and context (``seq_len`` tokens, if given) checked
    (``text_model``: a causal LM's flags; a vision recipe reads its model itself), and
    ``--tsp-size`` defaulted to every process and checked; returns the accelerator and whether
    this run created the process group (``finish``'s ``owns_group``)."""
    owns_group = not dist.is_initialized()
    acc = Accelerator(cpu=not torch.cuda.is_available())
    logging.basicConfig(
        level=logging.INFO if acc.is_main_process else logging.WARNING,
        format="%(message)s",
        stream=sys.stdout,
    )
    if text_model:
        resolve_model(args, acc)
        model_config(args, seq_len=seq_len)
    args.tsp_size = args.tsp_size or acc.num_processes
    if acc.num_processes % args.tsp_size:
        raise SystemExit(f"--tsp-size {args.tsp_size} does not divide {acc.num_processes}")
    return acc, owns_group


def finish(
    acc: Accelerator,
    output_dir: str,
    eval_loss: float,
    final: str,
    owns_group: bool = True,
    extra: dict | None = None,
) -> None:
    """Write ``final_eval.json`` (main process; ``extra``: more fields for it) and shut
    Accelerate down; the process group too when this run created it (``owns_group``): a program
    that set up its own group before calling a recipe's ``main()`` (a notebook, a sweep driver,
    the tests' kept ranks) keeps it."""
    if acc.is_main_process:
        with open(os.path.join(output_dir, "final_eval.json"), "w") as f:
            json.dump({"eval_loss": eval_loss, "checkpoint": final, **(extra or {})}, f)
    acc.wait_for_everyone()
    acc.free_memory()
    gc.collect()
    if not owns_group:
        return
    acc.end_training()  # ends the trackers and destroys the process group
    if dist.is_initialized():
        dist.destroy_process_group()
