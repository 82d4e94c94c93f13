"""The three data-parallel engines behind one small interface: step, save, resume, export.

Accelerate launches the processes; the DP engine is driven through tsp_ext's own integrations
(Accelerate's DeepSpeed/FSDP plugins do nothing on CPU).
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

import tsp_ext.fsdp
from tsp_ext import (
    apply_tsp,
    clip_grad_norm_,
    full_optimizer_state,
    full_state_dict,
    load_optimizer_state,
    save_pretrained,
)
from tsp_ext.state import local_index

UNIVERSAL = "train_state.safetensors"  # TSP-size independent (ddp engine)


def lr_lambda(warmup: int, total: int):
    """Linear warmup to 1, then cosine decay to 0.1 at ``total`` steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class Engine:
    """``forward_model`` runs batches; ``backward``/``step`` train; ``save``/``load`` round-trip
    the full training state; ``export`` writes a Hugging Face checkpoint."""

    def __init__(self, kind: str, model, mesh, args) -> None:
        self.kind, self.model, self.mesh, self.args = kind, model, mesh, args
        self.dp_group = mesh["dp"].get_group()
        factory = lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.0)  # noqa: E731
        schedule = lr_lambda(args.warmup_steps, args.max_steps)
        if kind == "deepspeed":
            import tsp_ext.deepspeed as tds

            with open(args.ds_config) as f:
                cfg = json.load(f)
            cfg.update(
                train_micro_batch_size_per_gpu=args.micro_batch_size,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                gradient_clipping=args.max_grad_norm,
            )
            cfg["tsp"] = {**cfg.get("tsp", {}), "size": args.tsp_size}
            cfg["bf16"] = {"enabled": bool(args.bf16)}
            self.engine, self.optimizer, _, self.scheduler = tds.initialize(
                model=model,
                config=cfg,
                optimizer=factory,
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            )
            self.forward_model = self.engine
            return
        if kind == "fsdp2":
            tsp_ext.fsdp.shard_model(model, mesh)
            self.forward_model = model
        elif kind == "ddp":
            apply_tsp(model, mesh)
            self.forward_model = DistributedDataParallel(model, process_group=self.dp_group)
        else:
            raise ValueError(f"unknown --dp-engine {kind!r}")
        self.optimizer = factory(model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def backward(self, loss: torch.Tensor) -> None:
        if self.kind == "deepspeed":
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
        else:
            (loss / self.args.gradient_accumulation_steps).backward()

    def step(self, last_micro: bool) -> float | None:
        """After each micro batch: at the last one clip, update and advance the schedule, and
        return the gradient norm before clipping (None before)."""
        if self.kind == "deepspeed":
            self.engine.step()  # DeepSpeed counts micro batches and updates at the boundary
            return float(self.engine.get_global_grad_norm() or 0.0) if last_micro else None
        if not last_micro:
            return None
        norm = clip_grad_norm_(self.model, self.args.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item()

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, path: str, step: int) -> None:
        """Full training state at ``step`` under ``path`` (the engine's native format)."""
        os.makedirs(path, exist_ok=True)
        if self.kind == "deepspeed":
            self.engine.save_checkpoint(path, tag="state")
        elif self.kind == "fsdp2":
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer)
            tsp_ext.fsdp.dcp_save({"model": msd, "optim": osd}, path, self.model)
        else:  # ddp: full tensors, so that any TSP size can resume (resharding)
            model_state = full_state_dict(self.model)
            optim_state = full_optimizer_state(self.model, self.optimizer)
            if dist.get_rank() == 0:
                tensors = {f"model/{k}": v for k, v in model_state.items()}
                for name, st in optim_state.items():
                    tensors.update({f"optim/{name}/{k}": v for k, v in st.items()})
                save_file(tensors, os.path.join(path, UNIVERSAL))
        if dist.get_rank() == 0:
            meta = {
                "step": step,
                "scheduler": self.scheduler.state_dict(),
                "dp_engine": self.kind,
                "tsp_size": self.args.tsp_size,
                "seq_len": self.args.seq_len,
            }
            if self.kind == "ddp":  # lr, betas, ...: the per-parameter state is in UNIVERSAL
                meta["optimizer_groups"] = [
                    {k: v for k, v in g.items() if k != "params"}
                    for g in self.optimizer.param_groups
                ]
            with open(os.path.join(path, "trainer_state.json"), "w") as f:
                json.dump(meta, f)
        dist.barrier()

    def load(self, path: str) -> int:
        """Restore what ``save`` wrote; returns the step to continue from."""
        with open(os.path.join(path, "trainer_state.json")) as f:
            meta = json.load(f)
        # ddp checkpoints hold full tensors: they reshard to any TSP size
        keys = (
            ("dp_engine", "seq_len") if self.kind == "ddp" else ("dp_engine", "tsp_size", "seq_len")
        )
        for key in keys:
            mine = self.kind if key == "dp_engine" else getattr(self.args, key)
            if meta[key] != mine:
                raise ValueError(
                    f"--resume-from {path} was saved with {key}={meta[key]!r}, this run has "
                    f"{mine!r}: resume with the same setting"
                )
        if self.kind == "deepspeed":
            self.engine.load_checkpoint(path, tag="state")
        elif self.kind == "fsdp2":
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer)
            sd = {"model": msd, "optim": osd}
            tsp_ext.fsdp.dcp_load(sd, path, self.model)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=sd["model"],
                optim_state_dict=sd["optim"],
            )
        else:
            self._load_universal(os.path.join(path, UNIVERSAL))
            for group, saved in zip(self.optimizer.param_groups, meta["optimizer_groups"]):
                group.update(saved)
        if self.kind != "deepspeed":  # DeepSpeed restores its scheduler itself
            self.scheduler.load_state_dict(meta["scheduler"])
        return meta["step"]

    def _load_universal(self, file: str) -> None:
        """Each rank reads its slices of the full model and optimizer tensors."""
        with safe_open(file, "pt") as f, torch.no_grad():
            keys = set(f.keys())
            for name, param in self.model.named_parameters():
                param.copy_(f.get_slice(f"model/{name}")[local_index(self.model, name)])

            def read(name, key, index):
                full = f"optim/{name}/{key}"
                if full not in keys:
                    return None
                return f.get_tensor(full) if index == () else f.get_slice(full)[index]

            load_optimizer_state(self.model, self.optimizer, read)

    def export(self, path: str, tokenizer) -> None:
        """A plain Hugging Face checkpoint of the current weights."""
        state = None
        if self.kind == "deepspeed":
            import tsp_ext.deepspeed as tds

            state = tds.full_state_dict(self.engine, rank0_only=True)
        elif self.kind == "fsdp2":
            state = full_state_dict(self.model, rank0_only=True)
        save_pretrained(self.model, path, tokenizer, state_dict=state)
