"""Training-state checkpoints of a TSP model through ``torch.distributed.checkpoint`` (DCP):
one format for plain/DDP, FSDP2 and DeepSpeed ZeRO-1/2/3, resumable at any TSP and dp size.

Each rank writes only the pieces it owns, described by their offsets in the full Hugging Face
tensors (``layout.py``; uneven layouts included), so DCP writes pieces held by several ranks once
and reshards on load. A checkpoint directory holds the DCP files and ``trainer_state.json``
(scheduler, optimizer hyperparameters, the caller's ``extra_state``, the parameter names and full
shapes, every file's size). It is written as ``.<name>.incomplete`` beside ``path`` and renamed
to ``path`` only after every rank finished; ``load`` refuses an incomplete, truncated or
other-model checkpoint with a ``ValueError`` before it changes anything. Nothing is unpickled but
DCP's own metadata.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .export import WRITER, _replace_dir
from .layout import Layout
from .sources import PARAM, local_state, restore, targets

STATE = "trainer_state.json"
FORMAT = "tsp_ext.dcp.v1"


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
    extra_state: dict[str, Any] | None = None,
    engine=None,
    async_save: bool = False,
) -> PendingSave | None:
    """Write model, optimizer and scheduler state to the directory ``path`` (collective).

    Args:
        model: the TSP model (for DeepSpeed ``engine.module``; FSDP2-sharded is fine).
        optimizer: its optimizer (ignored with ``engine``: DeepSpeed's is read from it).
        scheduler: anything with ``state_dict()`` of JSON values (torch LR schedulers).
        extra_state: JSON values returned by ``load`` (step, data position, RNG seeds, ...).
        engine: the DeepSpeed engine, if any: its fp32 masters and optimizer state are saved,
            gathered over dp one parameter at a time.
        async_save: write in the background (``dcp.async_save``); returns a ``PendingSave``
            whose ``wait()`` (collective) must be called before the next save / at exit, and
            which completes the checkpoint. The state is copied before this returns.
    """
    path = os.fspath(path)
    json.dumps(extra_state)  # not JSON: TypeError here, before anything is written
    incomplete = _incomplete_dir(path)
    _on_writer(lambda: _fresh_dir(incomplete), f"preparing {incomplete}")
    layout = Layout(model)
    state_dict, keys = {}, {}
    for name, key, tensor, param in local_state(model, optimizer, engine):
        if key != PARAM:
            keys.setdefault(name, []).append(key)
        value = layout.wrap(name, tensor, param) if tensor.dim() else tensor
        state_dict[_fqn(name, key)] = value
    opt = engine.optimizer if engine is not None else optimizer
    meta = {
        "format": FORMAT,
        "model": _model_shapes(model, layout),
        "optimizer_keys": keys,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra_state": extra_state,
        "saved_with": {"tsp_size": model.tsp.size, "world_size": dist.get_world_size()},
    }
    if async_save:
        group = dist.new_group(backend="gloo")  # the background writer's own collectives
        future = dcp.async_save(state_dict, checkpoint_id=incomplete, process_group=group)
        return PendingSave(future, group, incomplete, path, meta)
    dcp.save(state_dict, checkpoint_id=incomplete)
    _complete(incomplete, path, meta)
    return None


class PendingSave:
    """A checkpoint being written in the background; ``wait()`` finishes it (collective)."""

    def __init__(self, future, group, incomplete: str, path: str, meta: dict) -> None:
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
    TSP / dp size and with any engine; returns the saved ``extra_state`` (collective).

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
    pieces = list(targets(model, optimizer, meta["optimizer_keys"], engine))
    state_dict = {
        _fqn(name, key): layout.wrap(name, t, p) if t.dim() else t for name, key, t, p in pieces
    }
    dcp.load(state_dict, checkpoint_id=path)  # in place, into the tensors of ``pieces``
    if engine is not None:
        restore(engine, pieces)
    opt = engine.optimizer if engine is not None else optimizer
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update(
            {k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()}
        )
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
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


def _fqn(name: str, key: str) -> str:
    return f"model.{name}" if key == PARAM else f"optim.{name}.{key}"


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
        files = {f: os.path.getsize(os.path.join(incomplete, f)) for f in os.listdir(incomplete)}
        tmp = os.path.join(incomplete, STATE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({**meta, "files": files}, f)
        os.rename(tmp, os.path.join(incomplete, STATE))
        _replace_dir(incomplete, path)

    _on_writer(finish, f"completing {path}")


def _on_writer(fn, what: str) -> None:
    """Run ``fn`` on the writer rank; its failure is raised on every rank (collective)."""
    error = None
    if dist.get_rank() == WRITER:
        try:
            fn()
        except BaseException as e:
            error = e
    failed = [error is not None]
    dist.broadcast_object_list(failed, src=WRITER)
    if error is not None:
        raise error
    if failed[0]:
        raise RuntimeError(f"{what} failed on rank {WRITER}; see its error")
