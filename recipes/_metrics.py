"""What the recipes record of each step in ``<output-dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import os
import resource
import time

import torch
from transformers import TrainerCallback


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


class StepRows(TrainerCallback):
    """A Trainer callback writing one ``metrics.jsonl`` row per logged step: ``on_log`` (a
    subclass's) starts ``self.row``; later logs of the same step (an evaluation) may add to it;
    it is written when the next step begins or training ends. ``step_s``: the last step's
    seconds."""

    def __init__(self, path: str) -> None:
        self.path, self.row, self.t0, self.step_s = path, None, 0.0, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.flush()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s = time.perf_counter() - self.t0

    def on_train_end(self, args, state, control, **kwargs):
        self.flush()

    def flush(self) -> None:
        if self.row is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(self.row) + "\n")
            self.row = None


class TrainerRows(StepRows):
    """One ``metrics.jsonl`` row per step of a Trainer recipe, as ``finetune_long_llama.py``
    writes them: loss, gradient norm, throughput (``tokens_per_step`` tokens a step; None: the
    step's seconds instead), learning rate, peak memory, and the step's eval loss."""

    def __init__(self, path: str, tokens_per_step: int | None = None) -> None:
        super().__init__(path)
        self.tokens_per_step = tokens_per_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs:
            self.flush()
            speed = (
                {"tokens_per_s": self.tokens_per_step / self.step_s}
                if self.tokens_per_step
                else {"step_s": self.step_s}
            )
            self.row = {
                "step": state.global_step,
                "loss": logs["loss"],
                "grad_norm": logs.get("grad_norm"),
                **speed,
                "lr": logs.get("learning_rate"),
                "peak_mem_bytes": peak_memory_bytes(),
            }
        elif "eval_loss" in logs and self.row is not None:
            self.row["eval_loss"] = logs["eval_loss"]
