"""tsp_ext: folded tensor + sequence parallelism (TSP) for PyTorch / Hugging Face models.

One line turns a Llama-family model into a TSP model::

    mesh = init_tsp_mesh(tsp_size=4)
    model = apply_tsp(model, mesh)
    out = model(**shard_batch({"input_ids": ids, "labels": labels}, mesh))
"""

from .attention import AttentionSpec, TSPAttention
from .batch import gather_sequence, shard_batch
from .config import TSPConfig
from .export import save_pretrained
from .layout import IGNORE_INDEX, ZigzagLayout, pad_sequence, padded_length
from .loading import load_pretrained
from .mesh import init_tsp_mesh, tsp_group
from .mlp import TSPGatedMLP
from .model import apply_tsp, check_supported
from .norms import clip_grad_norm_
from .state import (
    full_grads,
    full_optimizer_state,
    full_state_dict,
    load_optimizer_state,
)
from .vocab import TSPVocabEmbedding, TSPVocabLMHead

__all__ = [
    "IGNORE_INDEX",
    "AttentionSpec",
    "TSPAttention",
    "TSPConfig",
    "TSPGatedMLP",
    "TSPVocabEmbedding",
    "TSPVocabLMHead",
    "ZigzagLayout",
    "apply_tsp",
    "check_supported",
    "clip_grad_norm_",
    "full_grads",
    "full_optimizer_state",
    "full_state_dict",
    "gather_sequence",
    "init_tsp_mesh",
    "load_optimizer_state",
    "load_pretrained",
    "pad_sequence",
    "save_pretrained",
    "padded_length",
    "shard_batch",
    "tsp_group",
]
