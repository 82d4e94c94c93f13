"""tsp_ext: folded tensor + sequence parallelism (TSP) for PyTorch / Hugging Face models."""

from .attention import AttentionSpec, TSPAttention
from .config import TSPConfig
from .layout import IGNORE_INDEX, ZigzagLayout, pad_sequence, padded_length
from .mlp import TSPGatedMLP

__all__ = [
    "IGNORE_INDEX",
    "AttentionSpec",
    "TSPAttention",
    "TSPConfig",
    "TSPGatedMLP",
    "ZigzagLayout",
    "pad_sequence",
    "padded_length",
]
