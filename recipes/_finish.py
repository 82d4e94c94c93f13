"""The end of a recipe run: the final evaluation's record, then an orderly shutdown."""

from __future__ import annotations

import gc
import json
import os

import torch.distributed as dist
from accelerate import Accelerator


def finish(
    acc: Accelerator, output_dir: str, eval_loss: float, final: str, owns_group: bool = True
) -> None:
    """Write ``final_eval.json`` (main process) and shut Accelerate down; the process group too
    when this run created it (``owns_group``): a program that set up its own group before calling
    a recipe's ``main()`` (a notebook, a sweep driver, the tests' kept ranks) keeps it."""
    if acc.is_main_process:
        with open(os.path.join(output_dir, "final_eval.json"), "w") as f:
            json.dump({"eval_loss": eval_loss, "checkpoint": final}, f)
    acc.wait_for_everyone()
    acc.free_memory()
    gc.collect()
    if not owns_group:
        return
    acc.end_training()  # ends the trackers and destroys the process group
    if dist.is_initialized():
        dist.destroy_process_group()
