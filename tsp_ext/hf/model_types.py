"""What a Hugging Face ``config.json`` says about a model's shapes, per ``model_type``; torch-free.

One table for everything that reads configs rather than modules: the planner (``ModelShape.
from_hf_config``, without torch) and ``hf`` (``families.expert_intermediate_size``). Each entry
names its ``hf.families`` family, where the modules live.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelType:
    """The facts of one ``model_type`` that its config's keys do not state."""

    family: str  # ``hf.families.Family.name``
    qkv_bias: bool = False  # q/k/v projections with a bias whatever ``attention_bias`` says
    qk_norm: bool = False  # an RMSNorm over each head's q and k (Qwen3's)


MODEL_TYPES: dict[str, ModelType] = {
    "llama": ModelType("Llama"),
    "mistral": ModelType("Llama"),
    "qwen2": ModelType("Llama", qkv_bias=True),
    "qwen3": ModelType("Llama", qk_norm=True),
    "gemma": ModelType("Gemma"),
    "gemma3_text": ModelType("Gemma-3"),
    "phi3": ModelType("Phi-3"),
    "olmo2": ModelType("OLMo-2"),
    "qwen2_moe": ModelType("Qwen-MoE", qkv_bias=True),
    "qwen3_moe": ModelType("Qwen-MoE", qk_norm=True),
    "mixtral": ModelType("Mixtral"),
    "gpt_oss": ModelType("gpt-oss", qkv_bias=True),
    "qwen3_next": ModelType("Qwen3-Next", qk_norm=True),
    "qwen3_5_text": ModelType("Qwen3.5", qk_norm=True),
    "qwen3_5_moe_text": ModelType("Qwen3.5", qk_norm=True),
}
_DEFAULT = ModelType("Llama")  # a model_type not listed: the Llama structure, as ``family_of``


def model_type_of(config: Any) -> ModelType:
    """The entry of a config (object or ``config.json`` dict) by its ``model_type``."""
    return MODEL_TYPES.get(_get(config, "model_type"), _DEFAULT)


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer (Qwen-MoE's ``num_experts``, Mixtral's
    ``num_local_experts``); 0 for a dense model."""
    return _get(config, "num_experts") or _get(config, "num_local_experts") or 0


def expert_intermediate_size(config: Any) -> int:
    """Each expert's intermediate size ``F`` (Qwen-MoE's ``moe_intermediate_size``, Mixtral's
    ``intermediate_size``)."""
    return _get(config, "moe_intermediate_size") or _get(config, "intermediate_size")


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
