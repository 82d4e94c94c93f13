"""tsp_ext: folded tensor + sequence parallelism (TSP) for PyTorch / Hugging Face models.

One line turns a Llama-family model into a TSP model::

    mesh = init_tsp_mesh(tsp_size=4)
    model = apply_tsp(model, mesh)
    out = model(**shard_batch({"input_ids": ids, "labels": labels}, mesh))

Public names are imported on first use, so that torch-free parts (``tsp_ext.planner``) import
without torch or transformers installed.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it (relative to this package)
_EXPORTS = {
    "AttentionSpec": ".attention",
    "TSPAttention": ".attention",
    "gather_sequence": ".batch",
    "shard_batch": ".batch",
    "TSPConfig": ".config",
    "save_pretrained": ".export",
    "IGNORE_INDEX": ".layout",
    "ZigzagLayout": ".layout",
    "pad_sequence": ".layout",
    "padded_length": ".layout",
    "load_pretrained": ".loading",
    "init_tsp_mesh": ".mesh",
    "tsp_group": ".mesh",
    "TSPGatedMLP": ".mlp",
    "apply_tsp": ".model",
    "check_supported": ".model",
    "clip_grad_norm_": ".norms",
    "full_grads": ".state",
    "full_optimizer_state": ".state",
    "full_state_dict": ".state",
    "load_optimizer_state": ".state",
    "TSPVocabEmbedding": ".vocab",
    "TSPVocabLMHead": ".vocab",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tsp_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
