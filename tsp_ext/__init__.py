"""tsp_ext: folded tensor + sequence parallelism (TSP) for PyTorch / Hugging Face models.

One line turns a Hugging Face causal LM of a supported family (``check_supported``) into a TSP
model::

    mesh = init_tsp_mesh(tsp_size=4)
    model = apply_tsp(model, mesh)
    out = model(**shard_batch({"input_ids": ids, "labels": labels}, mesh))

Public names are imported on first use, so that torch-free parts (``tsp_ext.planner``) import
without torch or transformers installed.
"""

from __future__ import annotations

import importlib

from .dp import guard

guard.install()  # a "tsp" block or a TSP model given to plain deepspeed.initialize is refused

# public name -> module that defines it (relative to this package)
_EXPORTS = {
    "AttentionSpec": ".engine.attention.schedule",
    "TSPAttention": ".hf.attention",
    "TSPCache": ".hf.cache",
    "gather_sequence": ".hf.batch",
    "shard_batch": ".hf.batch",
    "sequence_logps": ".hf.log_probs",
    "TSPConfig": ".config",
    "save_pretrained": ".checkpoint.export",
    "iter_weights": ".checkpoint.weight_sync",
    "stream_weights": ".checkpoint.weight_sync",
    "weight_metadata": ".checkpoint.weight_sync",
    "IGNORE_INDEX": ".engine.sharding.layout",
    "ZigzagLayout": ".engine.sharding.layout",
    "pad_sequence": ".engine.sharding.layout",
    "padded_length": ".engine.sharding.layout",
    "load_pretrained": ".checkpoint.loading",
    "init_tsp_mesh": ".mesh",
    "tsp_group": ".mesh",
    "TSPGatedMLP": ".hf.mlp",
    "apply_tsp": ".hf.apply",
    "check_supported": ".hf.apply",
    "clip_grad_norm_": ".dp.grad_norm",
    "full_grads": ".hf.full_state",
    "full_state_dict": ".hf.full_state",
    "TSPVocabEmbedding": ".hf.vocab",
    "TSPVocabLMHead": ".hf.vocab",
    "TSPTrainer": ".integrations.trainer",
    "TSPTrainerMixin": ".integrations.trainer",
    "TSPDPOTrainer": ".integrations.dpo",
    "TSPGRPOTrainer": ".integrations.grpo",
    "TSPRLOOTrainer": ".integrations.rloo",
}

# subpackages and modules reachable as attributes (``tsp_ext.checkpoint.save``) after
# ``import tsp_ext``, imported on first use like the names above
_MODULES = {"checkpoint", "config", "deepspeed", "fsdp", "memory", "mesh", "plan", "planner"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)  # sets the attribute itself
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tsp_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _MODULES)
