"""Warmup that starts above zero in the Trainer recipes: Hugging Face's schedules give the first
optimizer step a learning rate of 0 (``step / warmup_steps`` at step 0), a wasted step."""

from __future__ import annotations

from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback


class WarmupFromFirstStep(TrainerCallback):
    """The scheduler's warmup as ``(step + 1) / warmup_steps`` (step 0: ``1 / warmup_steps``),
    its schedule unchanged from step ``warmup_steps`` on (the recipes' own loop does the same:
    ``_training.lr_lambda``)."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup = warmup_steps

    def on_train_begin(self, args, state, control, lr_scheduler=None, optimizer=None, **kwargs):
        if self.warmup < 1 or not isinstance(lr_scheduler, LambdaLR):
            return
        w = self.warmup
        lr_scheduler.lr_lambdas = [
            lambda step, f=f: (step + 1) / w if step < w else f(step)
            for f in lr_scheduler.lr_lambdas
        ]
        if lr_scheduler.last_epoch == 0:  # not a resumed run: the first step's rate
            groups = lr_scheduler.optimizer.param_groups
            for group, base, f in zip(groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas):
                group["lr"] = base * f(0)
            lr_scheduler._last_lr = [g["lr"] for g in groups]
