"""Write a TSP model as a plain Hugging Face checkpoint (config + safetensors), atomically."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn

from .state import full_state_dict


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    tokenizer=None,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    max_shard_size: str | int = "5GB",
) -> None:
    """Gather the TSP shards and write a normal HF checkpoint to ``path`` from global rank 0.

    The result loads with plain ``AutoModelForCausalLM.from_pretrained(path)`` in one process.
    It is written to a temporary directory beside ``path`` and renamed into place, so an
    interrupted save leaves any previous checkpoint at ``path`` intact. Collective: call on every
    rank. ``state_dict`` overrides the gathered tensors (e.g. ``tsp_ext.deepspeed.full_state_dict``
    for ZeRO-3).
    """
    tensors = state_dict if state_dict is not None else full_state_dict(model, rank0_only=True)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            _write(model, os.fspath(path), tensors, tokenizer, max_shard_size)
        except BaseException as e:  # every rank must learn that the save failed
            error = e
    failed = [error is not None]
    dist.broadcast_object_list(failed, src=0)
    if error is not None:
        raise error
    if failed[0]:
        raise RuntimeError(f"save_pretrained({path!r}) failed on rank 0; see its error")


def _write(model, path: str, tensors, tokenizer, max_shard_size) -> None:
    config = copy.deepcopy(model.config)
    for key, value in model.tsp.hf_config_values.items():
        setattr(config, key, value)
    if getattr(config, "tie_word_embeddings", False):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            shard = {n: tensors[n] for n in names}
            save_file(shard, os.path.join(tmp, filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: str, path: str) -> None:
    """Move ``new`` to ``path``; an existing ``path`` is kept until the new one is in place."""
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
    os.rename(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
