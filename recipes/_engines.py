"""The three data-parallel engines behind one small interface: step, save, resume, export.

Accelerate launches the processes; the DP engine is driven through tsp_ext's own integrations
(Accelerate's DeepSpeed/FSDP plugins do nothing on CPU).
"""

from __future__ import annotations

import json
import math

import torch
from torch.nn.parallel import DistributedDataParallel

import tsp_ext.fsdp
from tsp_ext import TSPConfig, apply_tsp, checkpoint, clip_grad_norm_, save_pretrained
from tsp_ext.dp.storage import partition


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


def tsp_config(args) -> TSPConfig:
    """The TSP options of the run: DeepSpeed's ``"tsp"`` block, or the defaults; layer
    checkpointing and QLoRA's base from the arguments either way."""
    if args.dp_engine == "deepspeed":
        from tsp_ext.deepspeed import tsp_config_from_ds

        return tsp_config_from_ds(ds_config(args))
    return TSPConfig(tsp_size=args.tsp_size, **tsp_options(args))


class Engine:
    """``forward_model`` runs batches; ``backward``/``step`` train; ``save``/``load`` round-trip
    the full training state; ``export`` writes a Hugging Face checkpoint."""

    def __init__(self, kind: str, model, mesh, args) -> None:
        """``model``: a Hugging Face model (made a TSP model here) or an already-TSP one
        (``tsp_ext.load_pretrained``); DeepSpeed and FSDP2 accept both."""
        self.kind, self.model, self.mesh, self.args = kind, model, mesh, args
        self.dp_group = mesh["dp"].get_group()

        def factory(params):  # fused: no temporaries of a parameter's size in the step
            return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=True)

        schedule = lr_lambda(args.warmup_steps, args.max_steps)
        if kind == "deepspeed":
            import tsp_ext.deepspeed as tds

            self.engine, self.optimizer, _, self.scheduler = tds.initialize(
                model=model,
                config=ds_config(args),
                optimizer=factory,
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            )
            self.forward_model = self.engine
            return
        if getattr(model, "tsp", None) is None:
            apply_tsp(model, mesh, config=tsp_config(args))
        if kind == "fsdp2":
            tsp_ext.fsdp.shard_model(model, mesh)
            self.forward_model = model
        elif kind == "ddp":
            # the gradients live in DDP's buckets (no second copy of every gradient)
            self.forward_model = DistributedDataParallel(
                model, process_group=self.dp_group, gradient_as_bucket_view=True
            )
        else:
            raise ValueError(f"unknown --dp-engine {kind!r}")
        # the parameters TSP made (LoRA: the adapter's only)
        self.optimizer = factory([p for p in model.parameters() if p.requires_grad])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def backward(self, loss: torch.Tensor) -> None:
        if self.kind == "deepspeed":
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
        else:
            (loss / self.args.gradient_accumulation_steps).backward()

    def step(self, last_micro: bool, skip: bool = False) -> float | None:
        """After each micro batch: at the last one clip, update and advance the schedule, and
        return the gradient norm before clipping (None before). The norm is global (the same on
        every rank); when it is not finite, or with ``skip`` (a non-finite loss), the gradients
        are dropped and neither the optimizer nor the schedule advances. DeepSpeed skips a
        non-finite norm itself (its overflow check, reported as inf) but not ``skip``: finite
        gradients of a non-finite loss update the weights. ``updated`` says which happened."""
        if self.kind == "deepspeed":
            self.engine.step()  # DeepSpeed counts micro batches and updates at the boundary
            self.updated = self.engine.was_step_applied()
            return float(self.engine.get_global_grad_norm() or 0.0) if last_micro else None
        if not last_micro:
            return None
        norm = clip_grad_norm_(self.model, self.args.max_grad_norm).item()
        self.updated = not skip and math.isfinite(norm)
        if self.updated:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
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
            engine=self._ds_engine(),
        )

    def load(self, path: str) -> int:
        """Restore what ``save`` wrote; returns the step to continue from."""
        extra = checkpoint.load(
            path, self.model, self.optimizer, scheduler=self.scheduler, engine=self._ds_engine()
        )
        return extra["step"]

    def _ds_engine(self):
        return self.engine if self.kind == "deepspeed" else None

    def export(self, path: str, tokenizer) -> None:
        """A plain Hugging Face checkpoint of the current weights, streamed tensor by tensor;
        with LoRA, of the merged weights, and the adapter in PEFT's format in ``<path>-adapter``."""
        lora = bool(self.args.lora_r)
        save_pretrained(self.model, path, tokenizer, merge_adapter=lora)
        if lora:
            save_pretrained(self.model, f"{path}-adapter", tokenizer)
