"""The training-state checkpoints of ``finetune_long_llama.py``: finding the newest complete one
(``--resume-from auto``), checking that one fits this run, writing one and keeping the
``--keep-last`` newest."""

from __future__ import annotations

import logging
import os
import re
import shutil

import torch.distributed as dist
from _training import TrainingRun

from tsp_ext.checkpoint import inspect

log = logging.getLogger(__name__)


def newest_checkpoint(output_dir: str) -> str | None:
    """The newest complete ``checkpoint-<step>`` in ``output_dir`` (None: none; collective). It
    says (rank 0) what it skips: interrupted saves (``.checkpoint-<step>.incomplete``) and any
    checkpoint ``inspect`` refuses (truncated, damaged, foreign)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    skipped = [
        f"{os.path.join(output_dir, n)}: an interrupted save"
        for n in sorted(names)
        if re.fullmatch(r"\.checkpoint-\d+\.incomplete", n)
    ]
    done = [n for n in names if re.fullmatch(r"checkpoint-\d+", n)]
    found = None
    for name in sorted(done, key=lambda n: int(n.split("-")[1]), reverse=True):
        try:
            inspect(os.path.join(output_dir, name))
        except ValueError as e:
            skipped.append(str(e))
            continue
        found = os.path.join(output_dir, name)
        break
    one = not dist.is_initialized()  # one process: the mesh starts the process group later
    if one or dist.get_rank() == 0:
        for why in skipped:
            log.warning(f"--resume-from auto: skipping {why}")
        log.info(f"--resume-from auto: {found or 'no complete checkpoint, a fresh start'}")
    if one:
        return found
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, found)
    if len(set(seen)) > 1:
        raise SystemExit(
            f"--resume-from auto: the ranks found different checkpoints in {output_dir} "
            f"({seen}): every rank must see the same --output-dir (a shared filesystem)"
        )
    return found


def check_resume(args) -> None:
    """``--resume-from``: ``auto`` becomes the newest complete checkpoint in ``--output-dir``
    (None: a fresh start); a checkpoint must be complete, undamaged and saved with this run's
    ``--seq-len`` and ``--packing``."""
    if args.resume_from == "auto":
        args.resume_from = newest_checkpoint(args.output_dir)
    if not args.resume_from:
        return
    try:  # complete, undamaged (the model itself is checked when it is loaded)
        saved = inspect(args.resume_from)["extra_state"]
    except ValueError as e:
        raise SystemExit(f"--resume-from: {e}") from None
    if saved.get("seq_len") != args.seq_len:
        raise SystemExit(
            f"--resume-from {args.resume_from} was saved with seq_len={saved.get('seq_len')}, "
            f"this run has {args.seq_len}: resume with the same --seq-len"
        )
    if saved.get("packing", "stream") != args.packing:
        raise SystemExit(
            f"--resume-from {args.resume_from} was saved with --packing "
            f"{saved.get('packing', 'stream')}, this run has {args.packing}: resume with the "
            "same --packing"
        )


def save_checkpoint(run: TrainingRun, args, step: int) -> None:
    """``<output-dir>/checkpoint-<step>``, then (rank 0) drop all but the ``--keep-last`` newest.
    A checkpoint only gets its name once complete, so the rotation never removes the last good
    one for a partial one; weights that are not all finite are never saved."""
    if not run.weights_finite():
        raise SystemExit(
            f"step {step}: the weights hold non-finite values, checkpoint-{step} is not written; "
            "resume from an earlier checkpoint (with a lower --lr, or --on-nonfinite skip)"
        )
    run.save(os.path.join(args.output_dir, f"checkpoint-{step}"), step)
    if args.keep_last and dist.get_rank() == 0:
        done = [d for d in os.listdir(args.output_dir) if re.fullmatch(r"checkpoint-\d+", d)]
        done.sort(key=lambda d: int(d.split("-")[1]))
        for old in done[: -args.keep_last]:
            shutil.rmtree(os.path.join(args.output_dir, old))
