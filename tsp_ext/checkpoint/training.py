"""Training-state checkpoints of a TSP model through ``torch.distributed.checkpoint`` (DCP):
one format for plain/DDP, FSDP2 and DeepSpeed ZeRO-1/2/3, resumable at any TSP and dp size.

Each rank writes only the pieces it owns, described by their offsets in the full Hugging Face
tensors (``layout.py``; uneven layouts included), so DCP writes pieces held by several ranks once
and reshards on load. The parameters are split into groups of bounded full size (model order, at
most ``max_group_bytes`` of float32 each; a larger parameter alone), and each group is one DCP
checkpoint in a subdirectory ``group-<i>``, written and read on its own: a DeepSpeed save / load
holds one group's fp32 masters and optimizer state at a time, not the whole rank's. The groups
depend only on the parameter names and full shapes, and are recorded, so any layout reads them.
Only trained parameters (``requires_grad``) are training state: frozen ones (a LoRA run's base
model) come from the model resumed with, and are neither written nor read.
``rng/`` holds each rank's torch generator states. ``trainer_state.json`` holds the scheduler,
optimizer hyperparameters, the caller's ``extra_state``, the parameter names and full shapes, the
groups and every file's size. A checkpoint is written as ``.<name>.incomplete`` beside ``path`` and
renamed to ``path`` only after every rank finished; ``load`` refuses an incomplete, truncated or
other-model checkpoint with a ``ValueError`` before it changes anything. Nothing is unpickled but
DCP's own metadata.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ..dp.training_state import PARAM, training_state
from ..writer import on_writer, replace_dir
from .layout import Layout
from .rng import rng_kinds, rng_state, rng_targets, set_rng_state

STATE = "trainer_state.json"
FORMAT = "tsp_ext.dcp.v3"  # v3: records the trained parameters (frozen ones are not saved)
RNG = "rng"
GROUP_BYTES = 2**31  # default bound on the full float32 size of one group's parameters


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
    extra_state: dict[str, Any] | None = None,
    engine=None,
    async_save: bool = False,
    max_group_bytes: int = GROUP_BYTES,
) -> PendingSave | None:
    """Write model, optimizer and scheduler state and this process's torch RNG states to the
    directory ``path`` (collective).

    Args:
        model: the TSP model (for DeepSpeed ``engine.module``; FSDP2-sharded is fine).
        optimizer: its optimizer (ignored with ``engine``: DeepSpeed's is read from it).
        scheduler: anything with ``state_dict()`` of JSON values (torch LR schedulers).
        extra_state: JSON values returned by ``load`` (step, data position, seeds, ...).
        engine: the DeepSpeed engine, if any: its fp32 masters and optimizer state are saved,
            gathered over dp one parameter at a time, one group of parameters at a time.
        async_save: write in the background; returns a ``PendingSave`` whose ``wait()``
            (collective) must be called before the next save / at exit, and which completes the
            checkpoint. The state is copied before this returns (a copy of the rank's state).
        max_group_bytes: bound on the full (unsharded) float32 size of the parameters written
            in one DCP call; a DeepSpeed save holds about ``(1 + moments) x max_group_bytes /
            tsp_size`` of fp32 state per rank at a time (or one larger parameter's).
    """
    path = os.fspath(path)
    json.dumps(extra_state)  # not JSON: TypeError here, before anything is written
    layout = Layout(model)
    shapes = _model_shapes(model, layout)  # an uneven layout is refused here, on every rank
    trained = _trained(model)
    groups = _groups({n: s for n, s in shapes.items() if n in trained}, max_group_bytes)
    incomplete = _incomplete_dir(path)
    on_writer(lambda: _fresh_dir(incomplete), f"preparing {incomplete}")
    kinds = rng_kinds()
    state = training_state(model, optimizer, engine)
    keys: dict[str, list[str]] = {}
    stager = DefaultStager(StagingOptions(False, False, False, False)) if async_save else None
    staged = []
    for i, names in enumerate(groups):
        state_dict = {}
        for name, key, tensor, param in state.local(names):
            if key != PARAM:
                keys.setdefault(name, []).append(key)
            value = layout.wrap(name, tensor, param) if tensor.dim() else tensor
            state_dict[_fqn(name, key)] = value
        where = os.path.join(incomplete, _group_dir(i))
        if stager is not None:
            staged.append((where, stager.stage(state_dict)))
        else:
            dcp.save(state_dict, checkpoint_id=where)
        del state_dict  # DeepSpeed: this group's gathered fp32 state
    rng = (os.path.join(incomplete, RNG), rng_state(kinds))
    meta = {
        "format": FORMAT,
        "model": shapes,
        "trained": sorted(trained),
        "groups": groups,
        "optimizer_keys": keys,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups
        ],
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra_state": extra_state,
        "rng": kinds,
        "saved_with": {"tsp_size": model.tsp.size, "world_size": dist.get_world_size()},
    }
    if stager is not None:
        stager.close()
        group = dist.new_group(backend="gloo")  # the background writer's own collectives
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsp_ext-checkpoint")
        future = writer.submit(_save_all, [*staged, rng], group)
        writer.shutdown(wait=False)  # the thread ends once the save is done
        return PendingSave(future, group, incomplete=incomplete, path=path, meta=meta)
    dcp.save(rng[1], checkpoint_id=rng[0])
    _complete(incomplete, path, meta)
    return None


def _save_all(parts: list[tuple[str, dict]], group) -> None:
    """The background writer: one DCP save after the other (their collectives in one order)."""
    for where, state_dict in parts:
        dcp.save(state_dict, checkpoint_id=where, process_group=group)


class PendingSave:
    """A checkpoint being written in the background; ``wait()`` finishes it (collective)."""

    def __init__(self, future: Future, group, incomplete: str, path: str, meta: dict) -> None:
        self._future, self._group = future, group
        self._incomplete, self._path, self._meta = incomplete, path, meta

    def wait(self) -> None:
        self._future.result()
        dist.destroy_process_group(self._group)
        _complete(self._incomplete, self._path, self._meta)


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
    engine=None,
) -> dict[str, Any] | None:
    """Restore what ``save`` wrote into ``model``, ``optimizer`` and ``scheduler`` in place, at any
    TSP / dp size and with any engine, one group of parameters at a time; returns the saved
    ``extra_state`` (collective). The torch RNG states are restored when the checkpoint was
    written by as many ranks as there are now (a resharded resume draws its own numbers).

    Raises:
        ValueError: ``path`` is not a complete checkpoint (interrupted save, truncated or missing
            file) or holds another model (parameter names or full shapes differ).
    """
    path = os.fspath(path)
    meta = inspect(path)
    layout = Layout(model)
    mine = _model_shapes(model, layout)
    if meta["model"] != mine:
        raise ValueError(f"{path} holds another model: {_model_difference(meta['model'], mine)}")
    trained = sorted(_trained(model))
    if meta["trained"] != trained:
        saved, now = set(meta["trained"]), set(trained)
        raise ValueError(
            f"{path} trained other parameters than this model trains (requires_grad): only in "
            f"the checkpoint {sorted(saved - now)[:3]}, only here {sorted(now - saved)[:3]}"
        )
    state = training_state(model, optimizer, engine)
    state.prepare_restore({k for ks in meta["optimizer_keys"].values() for k in ks})
    for i, names in enumerate(meta["groups"]):
        pieces = list(state.targets(meta["optimizer_keys"], set(names)))
        state_dict = {
            _fqn(name, key): layout.wrap(name, t, p) if t.dim() else t for name, key, t, p in pieces
        }
        # in place, into the tensors of ``pieces``
        dcp.load(state_dict, checkpoint_id=os.path.join(path, _group_dir(i)))
        state.restore(pieces)
        del pieces, state_dict
    state.finish_restore()
    for group, saved in zip(state.optimizer.param_groups, meta["param_groups"]):
        group.update(
            {k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()}
        )
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if meta["saved_with"]["world_size"] == dist.get_world_size():
        rng = rng_targets(meta["rng"])
        dcp.load(rng, checkpoint_id=os.path.join(path, RNG))
        set_rng_state(rng)
    return meta["extra_state"]


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """``trainer_state.json`` of a complete checkpoint (no process group needed); ``ValueError``
    saying what is wrong for an incomplete, truncated or foreign directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a checkpoint directory")
    file = os.path.join(path, STATE)
    if not os.path.isfile(file):
        raise ValueError(
            f"{path} is incomplete: it has no {STATE}, which is written after every rank "
            "finished (the save was interrupted); resume from an earlier checkpoint"
        )
    try:
        with open(file) as f:
            meta = json.load(f)
    except ValueError as e:
        raise ValueError(
            f"{file} is truncated or corrupt ({e}); resume from another checkpoint"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a tsp_ext training checkpoint (format {FORMAT})")
    for name, size in meta["files"].items():
        where = os.path.join(path, name)
        actual = os.path.getsize(where) if os.path.isfile(where) else None
        if actual != size:
            raise ValueError(
                f"{path} is damaged: {name} has {actual} bytes, {size} were written (truncated "
                "or missing file); resume from another checkpoint"
            )
    return meta


def _groups(shapes: dict[str, list[int]], max_bytes: int) -> list[list[str]]:
    """Consecutive parameters (model order) of at most ``max_bytes`` full float32 size each
    (a larger parameter is a group of its own)."""
    if max_bytes <= 0:
        raise ValueError(f"max_group_bytes={max_bytes}: give a positive number of bytes")
    groups, size = [], 0
    for name, shape in shapes.items():
        nbytes = 4 * torch.Size(shape).numel()
        if not groups or size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _group_dir(i: int) -> str:
    return f"group-{i:05d}"


def _fqn(name: str, key: str) -> str:
    return f"model.{name}" if key == PARAM else f"optim.{name}.{key}"


def _trained(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _model_shapes(model: nn.Module, layout: Layout) -> dict[str, list[int]]:
    return {n: list(layout.full_shape(n, p)) for n, p in model.named_parameters()}


def _model_difference(saved: dict, mine: dict) -> str:
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        return f"parameters only in this model: {missing[:3]}, only in the checkpoint: {extra[:3]}"
    name = next(n for n in mine if mine[n] != saved[n])
    return f"{name} has shape {saved[name]} in the checkpoint, {mine[name]} in this model"


def _incomplete_dir(path: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.incomplete")


def _fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by an interrupted save
    os.makedirs(path)


def _complete(incomplete: str, path: str, meta: dict) -> None:
    """After every rank wrote its files: record their sizes, then rename into place."""
    dist.barrier()

    def finish():
        files = {
            os.path.relpath(os.path.join(root, f), incomplete): os.path.getsize(
                os.path.join(root, f)
            )
            for root, _, names in os.walk(incomplete)
            for f in names
        }
        tmp = os.path.join(incomplete, STATE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**meta, "files": files}, f)
        os.rename(tmp, os.path.join(incomplete, STATE))
        replace_dir(incomplete, path)

    on_writer(finish, f"completing {path}")
