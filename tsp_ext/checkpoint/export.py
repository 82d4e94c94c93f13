"""Write a TSP model as a plain Hugging Face checkpoint (config + safetensors), streaming and
atomically.

Tensors are gathered one at a time (over the TSP group, and over dp for FSDP2 DTensors and ZeRO-3
partitions) to global rank 0, which appends them to the current safetensors file and writes that
file once it reaches ``max_shard_size``. Peak extra memory: one shard file (plus one tensor) on
rank 0, one TSP shard elsewhere; never the model.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from .state import iter_full_tensors, require_tsp

WRITER = 0  # the global rank that writes the files
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: str | int) -> int:
    """Bytes of ``"5GB"`` (10^9 units, as Hugging Face), ``"512MiB"`` or an int."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size={size!r}: give an int or e.g. '5GB', '500MB', '1GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class _ShardFiles:
    """Accumulates tensors into one safetensors file of at most ``max_bytes`` (a larger tensor
    gets a file of its own), writes it when full, and names the files and the index at the end."""

    def __init__(self, folder: str, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []  # tensor names of each written file
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        if not self.pending:
            return
        file = os.path.join(self.folder, f"part-{len(self.files):05d}")
        save_file(self.pending, file, metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename the parts to Hugging Face's names; write the index if there are several."""
        self.flush()
        n = len(self.files)
        if n == 1:
            os.rename(os.path.join(self.folder, "part-00000"), self.name(0, 1))
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = self.name(i, n)
            os.rename(os.path.join(self.folder, f"part-{i:05d}"), final)
            weight_map.update(dict.fromkeys(names, os.path.basename(final)))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)

    def name(self, i: int, n: int) -> str:
        base = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        return os.path.join(self.folder, base)


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    tokenizer=None,
    *,
    max_shard_size: str | int = "5GB",
) -> None:
    """Write a normal Hugging Face checkpoint of a TSP model to ``path`` (collective: every rank).

    Works for a plain TSP model (DDP), an FSDP2-sharded one and the ``module`` of a DeepSpeed
    engine (any ZeRO stage): each tensor is gathered on its own and streamed to global rank 0,
    which holds at most one ``max_shard_size`` file in memory. The result loads with plain
    ``AutoModelForCausalLM.from_pretrained(path)`` in one process. It is written to a temporary
    directory beside ``path`` and renamed into place, so an interrupted save leaves any previous
    checkpoint at ``path`` intact; a failure is raised on every rank.
    """
    require_tsp(model)
    path = os.fspath(path)
    max_bytes = parse_size(max_shard_size)
    writer = dist.get_rank() == WRITER
    tied = getattr(model.config, "tie_word_embeddings", False)
    error: BaseException | None = None
    tmp = files = None
    if writer:
        try:
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
            files = _ShardFiles(tmp, max_bytes)
        except BaseException as e:  # every rank must learn that the save failed
            error = e
    for name, t in iter_full_tensors(model, dst=WRITER):  # every rank takes part in each gather
        if writer and error is None and not (tied and name == "lm_head.weight"):
            try:
                files.add(name, t)
            except BaseException as e:
                error = e
        del t
    if writer and error is None:
        try:
            files.finish()
            _write_config(model, tmp, tokenizer)
            _replace_dir(tmp, path)
        except BaseException as e:
            error = e
    if writer and error is not None and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = [error is not None]
    dist.broadcast_object_list(failed, src=WRITER)
    if error is not None:
        raise error
    if failed[0]:
        raise RuntimeError(f"save_pretrained({path!r}) failed on rank {WRITER}; see its error")


def _write_config(model: nn.Module, folder: str, tokenizer) -> None:
    config = copy.deepcopy(model.config)
    for key, value in model.tsp.hf_config_values.items():  # undo what apply_tsp changed
        setattr(config, key, value)
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _replace_dir(new: str, path: str) -> None:
    """Move ``new`` to ``path``; an existing ``path`` is kept until the new one is in place."""
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
    os.rename(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
