"""Training-state checkpoints (model, optimizer, scheduler, step) of a TSP model, for the three
data-parallel engines, with exact resume.

Formats, chosen by what the model is wrapped in:
- ``ddp`` (plain TSP model, DDP or none): full model and optimizer tensors under the Hugging Face
  names in one ``train_state.safetensors``; every rank reads back its slices, so any TSP size
  can resume it.
- ``deepspeed``: the engine's own ``save_checkpoint`` / ``load_checkpoint`` (per TSP rank).
- ``fsdp2``: DCP, one checkpoint per TSP rank (``tsp_ext.fsdp.dcp_save`` / ``dcp_load``).
``trainer_state.json`` holds the step, the scheduler, the format, the TSP size and the caller's
``meta`` (e.g. the sequence length), checked on resume.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from ..dp import fsdp
from ..hf.sharding import local_index
from .state import full_optimizer_state, full_state_dict, load_optimizer_state

UNIVERSAL = "train_state.safetensors"  # TSP-size independent (ddp format)
TRAINER_STATE = "trainer_state.json"


def _format(model: nn.Module, engine) -> str:
    if engine is not None:
        return "deepspeed"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "fsdp2"
    return "ddp"


def save_training_state(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    step: int,
    *,
    engine=None,
    meta: dict[str, Any] | None = None,
) -> None:
    """Write the training state at ``step`` under ``path`` (collective: call on every rank).

    ``engine``: the DeepSpeed engine wrapping ``model``, if any (it saves its own optimizer and
    scheduler). ``meta``: JSON values that a resume must match (checked by ``load_training_state``).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    kind = _format(model, engine)
    if kind == "deepspeed":
        engine.save_checkpoint(path, tag="state")
    elif kind == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        fsdp.dcp_save({"model": msd, "optim": osd}, path, model)
    else:
        model_state = full_state_dict(model)
        optim_state = full_optimizer_state(model, optimizer)
        if dist.get_rank() == 0:
            tensors = {f"model/{k}": v for k, v in model_state.items()}
            for name, st in optim_state.items():
                tensors.update({f"optim/{name}/{k}": v for k, v in st.items()})
            save_file(tensors, os.path.join(path, UNIVERSAL))
    if dist.get_rank() == 0:
        state = {
            **(meta or {}),
            "step": step,
            "scheduler": scheduler.state_dict(),
            "format": kind,
            "tsp_size": model.tsp.size,
        }
        if kind == "ddp":  # lr, betas, ...: the per-parameter state is in UNIVERSAL
            state["optimizer_groups"] = [
                {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
            ]
        with open(os.path.join(path, TRAINER_STATE), "w") as f:
            json.dump(state, f)
    dist.barrier()


def load_training_state(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    *,
    engine=None,
    meta: dict[str, Any] | None = None,
) -> int:
    """Restore what ``save_training_state`` wrote, in place; returns the step to continue from.

    Raises ``ValueError`` naming the setting if the checkpoint was saved with another format,
    another ``meta`` value, or (deepspeed / fsdp2 formats) another TSP size.
    """
    path = os.fspath(path)
    with open(os.path.join(path, TRAINER_STATE)) as f:
        saved = json.load(f)
    kind = _format(model, engine)
    mine = {**(meta or {}), "format": kind}
    if kind != "ddp":  # only the ddp format holds full tensors, which reshard to any TSP size
        mine["tsp_size"] = model.tsp.size
    for key, value in mine.items():
        if saved.get(key) != value:
            raise ValueError(
                f"{path} was saved with {key}={saved.get(key)!r}, this run has {value!r}: resume "
                "with the same setting"
            )
    if kind == "deepspeed":
        engine.load_checkpoint(path, tag="state")
    elif kind == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, optimizer)
        sd = {"model": msd, "optim": osd}
        fsdp.dcp_load(sd, path, model)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        _load_universal(os.path.join(path, UNIVERSAL), model, optimizer)
        for group, groups_saved in zip(optimizer.param_groups, saved["optimizer_groups"]):
            group.update(groups_saved)
    if kind != "deepspeed":  # DeepSpeed restores its scheduler itself
        scheduler.load_state_dict(saved["scheduler"])
    return saved["step"]


def _load_universal(file: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Each rank reads its slices of the full model and optimizer tensors."""
    with safe_open(file, "pt") as f, torch.no_grad():
        keys = set(f.keys())
        for name, param in model.named_parameters():
            param.copy_(f.get_slice(f"model/{name}")[local_index(model, name)])

        def read(name, key, index):
            full = f"optim/{name}/{key}"
            if full not in keys:
                return None
            return f.get_tensor(full) if index == () else f.get_slice(full)[index]

        load_optimizer_state(model, optimizer, read)
