"""What the recipes record of each step in ``<output-dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import os
import resource

import torch


def peak_memory_bytes() -> int:
    """This process's peak: CUDA memory allocated, or the resident high-water mark on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def open_metrics(path: str, start: int):
    """``metrics.jsonl`` for appending, without the rows past ``start`` (written by an attempt
    that was interrupted after its checkpoint, or by an earlier run), so a resumed or restarted
    run reads like an uninterrupted one."""
    kept = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= start:
                        kept.append(line)
                except ValueError:  # the last row of a killed process, cut short
                    continue
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return open(path, "a")
