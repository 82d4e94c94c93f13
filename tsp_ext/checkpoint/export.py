"""Write a TSP model as a plain Hugging Face checkpoint (config + safetensors), streaming and
atomically.

Tensors are gathered one at a time (``weight_sync.iter_weights``: over the TSP group, and over dp
for FSDP2 DTensors and ZeRO-3 partitions) to global rank 0, which writes each straight into its
place in the current safetensors file: the files (at most ``max_shard_size`` each) and their
headers are planned beforehand from the full shapes (``weight_sync.weight_metadata``), so a file
is never held in memory. Peak extra memory: one full tensor on rank 0, one TSP shard elsewhere;
never the model.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from ..hf.adapter_save import save_adapter
from ..hf.full_state import require_tsp
from ..hf.lora import peft_base
from ..writer import WRITER, raise_everywhere, replace_dir
from .weight_sync import iter_weights, weight_metadata

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_DTYPES = {  # safetensors' names
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def parse_size(size: str | int) -> int:
    """Bytes of ``"5GB"`` (10^9 units, as Hugging Face), ``"512MiB"`` or an int."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size={size!r}: give an int or e.g. '5GB', '500MB', '1GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class _ShardFiles:
    """Safetensors files of at most ``max_bytes`` each (a larger tensor gets a file of its own),
    planned from ``entries`` (name, dtype, full shape; in the order the tensors will come):
    ``add`` writes each tensor at its offset as it arrives, ``finish`` names the files and
    writes the index if there are several."""

    def __init__(
        self, folder: str, entries: list[tuple[str, torch.dtype, torch.Size]], max_bytes: int
    ) -> None:
        self.folder = folder
        self.files: list[list[tuple[str, torch.dtype, torch.Size]]] = []
        size = 0
        for entry in entries:
            if entry[1] not in _DTYPES:
                raise ValueError(f"{entry[0]}: safetensors has no dtype {entry[1]}")
            nbytes = _nbytes(entry)
            if not self.files or (self.files[-1] and size + nbytes > max_bytes):
                self.files.append([])
                size = 0
            self.files[-1].append(entry)
            size += nbytes
        self.total = sum(_nbytes(e) for e in entries)
        self.order = [(i, e) for i, file in enumerate(self.files) for e in file]
        self.next, self.handle = 0, None

    def part(self, i: int) -> str:
        return os.path.join(self.folder, f"part-{i:05d}")

    def add(self, name: str, t: torch.Tensor) -> None:
        i, (expected, dtype, shape) = self.order[self.next]
        if (name, t.dtype, t.shape) != (expected, dtype, shape):
            raise RuntimeError(
                f"save_pretrained: got {name} {t.dtype} {list(t.shape)}, planned {expected} "
                f"{dtype} {list(shape)}"
            )
        if self.files[i][0][0] == name:  # the first tensor of file i: header first
            self.close()
            self.handle = open(self.part(i), "wb")
            self.handle.write(_header(self.files[i]))
        self.handle.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        self.next += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def finish(self) -> None:
        """Rename the parts to Hugging Face's names; write the index if there are several."""
        self.close()
        if self.next != len(self.order):
            raise RuntimeError(f"save_pretrained: {len(self.order) - self.next} tensors missing")
        n = len(self.files)
        if n == 1:
            os.rename(self.part(0), self.name(0, 1))
            return
        weight_map = {}
        for i, entries in enumerate(self.files):
            final = self.name(i, n)
            os.rename(self.part(i), final)
            weight_map.update(dict.fromkeys((e[0] for e in entries), os.path.basename(final)))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)

    def name(self, i: int, n: int) -> str:
        base = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        return os.path.join(self.folder, base)


def _nbytes(entry: tuple[str, torch.dtype, torch.Size]) -> int:
    return entry[2].numel() * entry[1].itemsize


def _header(entries: list[tuple[str, torch.dtype, torch.Size]]) -> bytes:
    """Length (8 bytes, little endian) + JSON header of a safetensors file holding ``entries``
    back to back, padded with spaces to 8 bytes as safetensors writes it."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        end = offset + _nbytes((name, dtype, shape))
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape)}
        header[name]["data_offsets"] = [offset, end]
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    tokenizer=None,
    *,
    max_shard_size: str | int = "5GB",
    merge_adapter: bool = False,
) -> None:
    """Write a normal Hugging Face checkpoint of a TSP model to ``path`` (collective: every rank).

    Works for a plain TSP model (DDP), an FSDP2-sharded one and the ``module`` of a DeepSpeed
    engine (any ZeRO stage): each tensor is gathered on its own and streamed to global rank 0,
    which writes it into its place in a file of at most ``max_shard_size`` (planned from the full
    shapes) and frees it: one full tensor in memory at a time. The result loads with plain
    ``AutoModelForCausalLM.from_pretrained(path)`` (a vision-language model:
    its own class's) in one process. It is written to a temporary
    directory beside ``path`` and renamed into place, so an interrupted save leaves any previous
    checkpoint at ``path`` intact; a failure is raised on every rank.

    A TSP ``peft.PeftModel`` writes its LoRA adapter in PEFT's format (``hf/adapter_save.py``); with
    ``merge_adapter`` it writes the plain checkpoint of the merged model instead (each adapted
    weight merged on rank 0 as it streams: ``W + s·B·A``; the model is not changed).
    """
    peft = peft_base(model) is not None
    if peft and not merge_adapter:
        save_adapter(model, path, tokenizer)
        return
    require_tsp(model)
    path = os.fspath(path)
    max_bytes = parse_size(max_shard_size)
    writer = dist.get_rank() == WRITER
    error: BaseException | None = None
    tmp = files = None
    if writer:
        try:
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
            files = _ShardFiles(tmp, weight_metadata(model), max_bytes)
        except BaseException as e:  # every rank must learn that the save failed
            error = e
    for name, t in iter_weights(model, dst=WRITER):  # every rank takes part in each gather
        if error is None:  # only the writer gets tensors
            try:
                files.add(name, t)
            except BaseException as e:
                error = e
        del t
    if writer and error is None:
        try:
            files.finish()
            _write_config(model, tmp, tokenizer)
            replace_dir(tmp, path)
        except BaseException as e:
            error = e
    if writer and error is not None and tmp is not None:
        if files is not None:
            files.close()
        shutil.rmtree(tmp, ignore_errors=True)
    raise_everywhere(error, f"save_pretrained({path!r})")


def _write_config(model: nn.Module, folder: str, tokenizer) -> None:
    """``config.json`` as ``PreTrainedModel.save_pretrained`` writes it (``architectures``,
    ``dtype``), what ``apply_tsp`` changed undone; the generation config and the tokenizer."""
    base = peft_base(model) or model  # a merged PEFT model: its base model's class
    config = copy.deepcopy(base.config)
    text = config.get_text_config()  # where apply_tsp changed them (a VLM's language model)
    for key, value in base.tsp.hf_config_values.items():  # undo what apply_tsp changed
        setattr(text, key, value)
    config.architectures = [type(base).__name__]  # TRL, vLLM pick the model class from it
    config.dtype = str(base.dtype).removeprefix("torch.")
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
