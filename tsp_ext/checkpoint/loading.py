"""Shard-on-read loading: each rank reads only the slices it keeps from the safetensors files."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import TSPConfig
from ..hf.apply import apply_tsp
from ..hf.sharding import local_index


def _resolve(path_or_id: str) -> str:
    if os.path.isdir(path_or_id):
        return path_or_id
    from huggingface_hub import snapshot_download

    return snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors", "*.model"])


def _weight_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index (sharded) or the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"{path} has no safetensors weights (only safetensors are loaded)")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_pretrained(
    path_or_id: str,
    mesh: DeviceMesh,
    config: TSPConfig | None = None,
    *,
    device: torch.device | str | None = None,
    hf_config=None,
    **from_config_kwargs,
) -> nn.Module:
    """A TSP model of a Hugging Face checkpoint, built without ever holding the full weights.

    The model is built on the meta device, made a TSP model there, then each parameter is filled
    with only this rank's slice, read with ``safe_open(...).get_slice`` one tensor at a time.
    Peak host memory per rank is about the rank's shard plus one tensor. Same result as
    ``apply_tsp(AutoModelForCausalLM.from_pretrained(path), mesh)``.

    Args:
        path_or_id: a local checkpoint directory or a hub id (downloaded first).
        mesh, config: as for ``apply_tsp``.
        device: where the parameters live (default: CUDA device of this rank if available).
        hf_config: the ``PretrainedConfig`` to build (default: the checkpoint's own), e.g. the
            checkpoint's with RoPE scaling for a longer context; the weights must fit it.
        from_config_kwargs: passed to ``AutoModelForCausalLM.from_config`` (e.g. ``dtype``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _resolve(path_or_id)
    hf_config = hf_config or AutoConfig.from_pretrained(path)
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, **from_config_kwargs)
    apply_tsp(model, mesh, config=config)
    model.to_empty(device=device)
    files = _weight_files(path)
    family = model.tsp.family
    with torch.no_grad():
        for name, param in model.named_parameters():
            index = local_index(model, name)
            fused = family.fused_rows(name, hf_config)
            stored = name
            if fused is not None:  # a part of a fused projection: its rows of the fused tensor
                stored, first = fused
                rows = index[0]
                index = (slice(first + (rows.start or 0), first + rows.stop), *index[1:])
            if stored not in files:
                head = f"{family.lm_head}.weight"
                if name == head and getattr(hf_config, "tie_word_embeddings", False):
                    continue  # tied: filled through embed_tokens
                raise ValueError(f"{path} has no tensor {stored!r}")
            with safe_open(files[stored], "pt") as f:  # per tensor: its pages are released after
                param.copy_(f.get_slice(stored)[index])
    _reset_rotary(model, device)
    model.tie_weights()
    return model


def _reset_rotary(model: nn.Module, device) -> None:
    """Recompute non-persistent buffers (RoPE frequencies), which ``to_empty`` left undefined."""
    family = model.tsp.family
    base = family.base_of(model)
    stale = getattr(base, family.rotary)
    setattr(base, family.rotary, type(stale)(config=model.config).to(device))
