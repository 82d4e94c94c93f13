"""The training loop's state: the TSP model under a data-parallel engine (``--data-parallel``,
``tsp_ext.dp.engines``), its optimizer and schedule; step, save, resume, export.

Accelerate launches the processes; the engine is driven through tsp_ext's own data-parallel layer
(Accelerate's DeepSpeed/FSDP plugins do nothing on CPU).
"""

from __future__ import annotations

import json
import math

import torch

from tsp_ext import TSPConfig, apply_tsp, checkpoint, save_pretrained
from tsp_ext.dp.engines import data_parallel_engine
from tsp_ext.storage import partition


def lr_lambda(warmup: int, total: int):
    """Linear warmup to 1, then cosine decay to 0.1 at ``total`` steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def ds_config(args) -> dict:
    """The ``--ds-config`` JSON with batch size, accumulation, clipping, bf16 and the TSP size
    filled in from the arguments."""
    with open(args.ds_config) as f:
        cfg = json.load(f)
    cfg.update(
        train_micro_batch_size_per_gpu=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_clipping=args.max_grad_norm,
    )
    cfg["tsp"] = {**cfg.get("tsp", {}), "size": args.tsp_size, **tsp_options(args)}
    cfg["bf16"] = {"enabled": bool(args.bf16)}
    return cfg


def tsp_options(args) -> dict:
    """The ``TSPConfig`` fields of ``--gradient-checkpointing`` / ``--offload-checkpoints`` and
    ``--qlora``."""
    options = {"quantize_base": "nf4"} if args.qlora else {}
    if args.gradient_checkpointing:
        options.update(checkpoint_layers=True, offload_checkpoints=args.offload_checkpoints)
    return options


def engine_config(args) -> dict | None:
    """The data-parallel engine's config: DeepSpeed's ``ds_config``; the others' defaults."""
    return ds_config(args) if args.data_parallel == "deepspeed" else None


def tsp_config(args) -> TSPConfig:
    """The TSP options of the run: DeepSpeed's ``"tsp"`` block, or the defaults; layer
    checkpointing and QLoRA's base from the arguments either way."""
    if args.data_parallel == "deepspeed":
        from tsp_ext.deepspeed import tsp_config_from_ds

        return tsp_config_from_ds(ds_config(args))
    return TSPConfig(tsp_size=args.tsp_size, **tsp_options(args))


class TrainingRun:
    """The training loop's model and data-parallel engine (``tsp_ext.dp.engines``):
    ``forward_model`` runs batches; ``backward``/``step`` train; ``save``/``load`` round-trip the
    full training state; ``export`` writes a Hugging Face checkpoint."""

    def __init__(self, data_parallel: str, model, mesh, args) -> None:
        """``model``: a Hugging Face model (made a TSP model here) or an already-TSP one
        (``tsp_ext.load_pretrained``); ``data_parallel``: a name in ``tsp_ext.dp.engines``."""
        self.model, self.mesh, self.args = model, mesh, args
        if getattr(model, "tsp", None) is None:
            apply_tsp(model, mesh, config=tsp_config(args))
        self.dp = data_parallel_engine(data_parallel, engine_config(args))
        self.dp.prepare(model, mesh)

        def factory(params):  # fused: no temporaries of a parameter's size in the step
            return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=True)

        schedule = lr_lambda(args.warmup_steps, args.max_steps)
        self.forward_model, self.optimizer, self.scheduler = self.dp.wrap(
            model, mesh, factory, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.dp.backward(loss, self.args.gradient_accumulation_steps)

    def step(self, last_micro: bool, skip: bool = False) -> float | None:
        """After each micro batch: at the last one clip, update and advance the schedule, and
        return the gradient norm before clipping (None before); ``updated`` says whether the
        weights changed (``DataParallel.step``: a non-finite norm or ``skip`` drops the step;
        DeepSpeed skips a non-finite norm itself but not ``skip``)."""
        norm, self.updated = self.dp.step(self.args.max_grad_norm, last_micro, skip)
        return norm

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Whether every weight of every rank is finite (collective: one all-reduce)."""
        local = [partition(p) for p in self.model.parameters()]
        flag = torch.zeros(1, device=local[0].device)
        for t in local:
            flag += (~torch.isfinite(t)).sum()
        torch.distributed.all_reduce(flag)
        return flag.item() == 0

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, path: str, step: int) -> None:
        """Training state at ``step`` under ``path`` (``tsp_ext.checkpoint.save``, DCP): the same
        format for every engine, resumable at any TSP size / dp size / engine."""
        extra = {
            "step": step,
            "seq_len": self.args.seq_len,
            "packing": self.args.packing,
            "seed": self.args.seed,
        }
        checkpoint.save(
            path,
            self.model,
            self.optimizer,
            scheduler=self.scheduler,
            extra_state=extra,
            engine=self.dp.engine,
        )

    def load(self, path: str) -> int:
        """Restore what ``save`` wrote; returns the step to continue from."""
        extra = checkpoint.load(
            path, self.model, self.optimizer, scheduler=self.scheduler, engine=self.dp.engine
        )
        return extra["step"]

    def export(self, path: str, tokenizer) -> None:
        """A plain Hugging Face checkpoint of the current weights, streamed tensor by tensor;
        with LoRA, of the merged weights, and the adapter in PEFT's format in ``<path>-adapter``."""
        lora = bool(self.args.lora_r)
        save_pretrained(self.model, path, tokenizer, merge_adapter=lora)
        if lora:
            save_pretrained(self.model, f"{path}-adapter", tokenizer)
