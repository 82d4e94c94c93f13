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


def _model_class(hf_config):
    """``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a vision-language
    config (Qwen2.5-VL, Qwen3-VL, LLaVA: not causal LMs to the auto classes)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(hf_config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def _model_names(model: nn.Module, keys) -> dict[str, str]:
    """Model name -> stored name of each stored tensor, renamed as ``from_pretrained`` renames
    them (a VLM's checkpoints keep the old names: ``model.layers.*``, ``visual.*``,
    ``language_model.model.*``); a tensor Hugging Face converts on load (stacked experts) keeps
    its stored name. ``model``: the Hugging Face model, before ``apply_tsp``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()
    out = {}
    for key in keys:
        name, converted = rename_source_key(
            key, renamings, converters, model.base_model_prefix, meta
        )
        out[key if converted is not None or name not in meta else name] = key
    return out


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
    ``apply_tsp(AutoModelForCausalLM.from_pretrained(path), mesh)``; a vision-language model
    (``AutoModelForImageTextToText``) reads its language model's shards and its whole vision
    side (replicated), its stored names renamed as ``from_pretrained`` renames them.

    Args:
        path_or_id: a local checkpoint directory or a hub id (downloaded first).
        mesh, config: as for ``apply_tsp``.
        device: where the parameters live (default: CUDA device of this rank if available).
        hf_config: the ``PretrainedConfig`` to build (default: the checkpoint's own), e.g. the
            checkpoint's with RoPE scaling for a longer context; the weights must fit it.
        from_config_kwargs: passed to the auto class's ``from_config`` (e.g. ``dtype``).
    """
    from transformers import AutoConfig

    path = _resolve(path_or_id)
    hf_config = hf_config or AutoConfig.from_pretrained(path)
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    with torch.device("meta"):
        model = _model_class(hf_config).from_config(hf_config, **from_config_kwargs)
    stored_files = _weight_files(path)
    stored_names = _model_names(model, stored_files)
    files = {name: stored_files[key] for name, key in stored_names.items()}
    apply_tsp(model, mesh, config=config)
    model.to_empty(device=device)
    family = model.tsp.family
    _init_buffers(model, family.base)
    with torch.no_grad():
        for name, param in model.named_parameters():
            index = local_index(model, name)
            fused = family.fused_rows(name, hf_config.get_text_config())
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
                param.copy_(f.get_slice(stored_names[stored])[index])
    _reset_rotary(model, device)
    model.tie_weights()
    return model


def _reset_rotary(model: nn.Module, device) -> None:
    """Recompute the language model's RoPE frequencies (non-persistent buffers), which
    ``to_empty`` left undefined."""
    family = model.tsp.family
    base = family.base_of(model)
    stale = getattr(base, family.rotary)
    text = model.config.get_text_config()  # a VLM's language model's
    setattr(base, family.rotary, type(stale)(config=text).to(device))


def _init_buffers(model: nn.Module, base: str) -> None:
    """Initialise the non-persistent buffers outside the language model ``base`` (a vision
    tower's RoPE frequencies, CLIP's position ids), left undefined by ``to_empty``, as Hugging
    Face does: each module's nearest enclosing ``PreTrainedModel``'s ``_init_weights`` (which may
    also initialise its parameters: they are read afterwards)."""
    from transformers import PreTrainedModel

    owners = {n: m for n, m in model.named_modules() if isinstance(m, PreTrainedModel)}
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set or f"{name}.".startswith(f"{base}."):
            continue
        owner = max((n for n in owners if f"{name}.".startswith(f"{n}." if n else "")), key=len)
        owners[owner]._init_weights(module)
