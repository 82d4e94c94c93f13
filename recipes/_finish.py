"""The end of a recipe run: the final evaluation's record, then an orderly shutdown."""

from __future__ import annotations

import gc
import json
import os

import torch.distributed as dist
from accelerate import Accelerator


def finish(acc: Accelerator, output_dir: str, eval_loss: float, final: str) -> None:
    """Write ``final_eval.json`` (main process) and shut Accelerate and the process group down."""
    if acc.is_main_process:
        with open(os.path.join(output_dir, "final_eval.json"), "w") as f:
            json.dump({"eval_loss": eval_loss, "checkpoint": final}, f)
    acc.wait_for_everyone()
    acc.free_memory()
    gc.collect()
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()
