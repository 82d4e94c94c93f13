"""Model shapes: the sizes of a Llama-family decoder (dense, or mixture-of-experts with every
layer sparse), the presets, and parameter counts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..engine.attention.heads import AttentionSpec
from ..hf.families import expert_intermediate_size, model_type_of, num_experts


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that decide memory and communication."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3)
    # mixture of experts: every layer routes each token to experts_per_token of num_experts
    # experts, each a gated MLP of width intermediate_size (0: a dense model)
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_width(self) -> int:
        """Columns of a layer's MLP weights: every expert's (E·F), or the dense F."""
        return self.num_experts * self.intermediate_size if self.moe else self.intermediate_size

    @property
    def active_width(self) -> int:
        """MLP columns each token computes: its k experts' (k·F), or the dense F."""
        return self.experts_per_token * self.intermediate_size if self.moe else self.mlp_width

    @classmethod
    def from_hf_config(cls, cfg: Mapping, name: str = "custom") -> ModelShape:
        """From a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3 keys; Qwen3-MoE /
        Qwen2-MoE's ``num_experts`` and ``moe_intermediate_size``, Mixtral's
        ``num_local_experts``)."""
        if "vision_config" in cfg:
            raise ValueError(
                f"config {name!r} is a vision-language model's: the planner models causal LMs "
                "(its vision tower is not in the model; plan the language model with its "
                "text_config as a config of its own)"
            )
        if "linear_attention" in (cfg.get("layer_types") or ()):
            raise ValueError(
                f"config {name!r} has linear-attention layers (hybrid, e.g. Qwen3-Next): the "
                "planner models softmax-attention layers only; measure such a model with "
                "tsp_ext.memory on a short run instead"
            )
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in (*required, "intermediate_size", "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(
                f"config {name!r} lacks {', '.join(missing)}: not a Llama-family config"
            )
        h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        experts, (_, facts) = num_experts(cfg), model_type_of(cfg)
        width = expert_intermediate_size(cfg) if experts else cfg["intermediate_size"]
        return cls(
            name=name,
            hidden_size=h,
            num_layers=cfg["num_hidden_layers"],
            num_heads=nh,
            num_kv_heads=cfg.get("num_key_value_heads") or nh,
            head_dim=cfg.get("head_dim") or h // nh,
            intermediate_size=width,
            vocab_size=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=facts.qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=facts.qk_norm,
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
        )

    def hf_config_kwargs(self) -> dict:
        """The ``LlamaConfig`` keyword arguments that build this shape (the inverse of
        ``from_hf_config``; ``model_type="qwen3"`` with q/k norms, whose ``Qwen3Config`` takes
        the same keys); ``head_dim``, ``tie_word_embeddings`` and ``attention_bias`` only
        where they differ from what ``LlamaConfig`` derives (h / heads) or defaults to (untied,
        no bias). A MoE shape gives ``Qwen3MoeConfig``'s keys (with q/k norms) or
        ``MixtralConfig``'s, with their ``model_type``."""
        kwargs = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
        )
        if self.head_dim != self.hidden_size // self.num_heads:
            kwargs["head_dim"] = self.head_dim
        if self.tie_embeddings:
            kwargs["tie_word_embeddings"] = True
        if self.qkv_bias:
            kwargs["attention_bias"] = True
        if self.qk_norm:  # Qwen3Config's keys: the same, with the model type that implies it
            kwargs["model_type"] = "qwen3"
        if self.moe and self.qk_norm:
            kwargs.update(
                model_type="qwen3_moe",
                num_experts=self.num_experts,
                moe_intermediate_size=self.intermediate_size,
            )
        elif self.moe:
            kwargs.update(model_type="mixtral", num_local_experts=self.num_experts)
        if self.moe:
            kwargs["num_experts_per_tok"] = self.experts_per_token
        return kwargs

    @property
    def params(self) -> int:
        """Total parameter count."""
        full = _layer_params(self, self.num_heads, self.num_kv_heads, self.mlp_width)
        return self.num_layers * full + _vocab_params(self, self.vocab_size, self.vocab_size)


PRESETS = {
    # the benchmark harness's default model (benchmarks/harness.py)
    "tiny": ModelShape(
        "tiny",
        hidden_size=256,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=704,
        vocab_size=2048,
    ),
    # the paper's 7B: MHA, SwiGLU with F = 4h (8.85B parameters with this vocabulary)
    "paper-7b": ModelShape(
        "paper-7b",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=16384,
        vocab_size=32000,
    ),
    "llama3-8b": ModelShape(
        "llama3-8b",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "llama3-70b": ModelShape(
        "llama3-70b",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
    ),
    "qwen3-32b": ModelShape(
        "qwen3-32b",
        hidden_size=5120,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=25600,
        vocab_size=151936,
        qk_norm=True,
    ),
    # mixture of experts (every layer sparse; intermediate_size: each expert's)
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b",
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=768,
        vocab_size=151936,
        qk_norm=True,
        num_experts=128,
        experts_per_token=8,
    ),
    "mixtral-8x7b": ModelShape(
        "mixtral-8x7b",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        num_experts=8,
        experts_per_token=2,
    ),
}


def load_model(spec: str) -> ModelShape:
    """A preset name, or the path of a Hugging Face ``config.json`` (or of its directory)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file"
        )
    return ModelShape.from_hf_config(json.loads(path.read_text()), name=spec)


# ---- parameters ----------------------------------------------------------------------------------


def _layer_params(m: ModelShape, heads: float, kv_heads: float, ffn: float) -> float:
    """Parameters of one decoder layer holding ``heads`` query heads, ``kv_heads`` KV heads and
    ``ffn`` MLP columns (of ``m.mlp_width``; norm weights and a MoE router replicated)."""
    h, d = m.hidden_size, m.head_dim
    bias = (heads + 2 * kv_heads) * d if m.qkv_bias else 0
    qk_norm = 2 * d if m.qk_norm else 0
    router = m.num_experts * h
    return 2 * h * d * (heads + kv_heads) + bias + qk_norm + 3 * h * ffn + 2 * h + router


def _vocab_params(m: ModelShape, embed_rows: float, head_rows: float) -> float:
    """Embedding and LM-head rows held (one table when tied) plus the final norm."""
    head = 0 if m.tie_embeddings else head_rows
    return (embed_rows + head) * m.hidden_size + m.hidden_size


def _heads(m: ModelShape, n: int) -> tuple[float, float]:
    """Query and KV heads per rank when n ranks split the heads (KV replicated if n > n_kv)."""
    return m.num_heads / n, m.num_kv_heads / min(n, m.num_kv_heads)


def _shard_params(m: ModelShape, n: int) -> float:
    """One decoder layer's parameters on each of n ranks that split heads and MLP width."""
    return _layer_params(m, *_heads(m, n), m.mlp_width / n)


def _tsp_heads(m: ModelShape, D: int) -> tuple[int, int]:
    """TSP's largest head group on D ranks: (query heads, KV heads); groups hold ⌊n_h/D⌋ or
    ⌈n_h/D⌉ query heads and every KV head they use."""
    spec = _spec(m, D)
    return spec.max_q, max(spec.n_kv(p) for p in range(D))


def _shared_kv_messages(m: ModelShape, D: int) -> int:
    """Point-to-point messages (one KV head's k and v gradient rows each) of the busiest rank when
    shared KV heads' gradients are summed among their users: the first user receives and sends
    back users - 1, every other user sends and receives one; 0 when no KV head is shared."""
    spec = _spec(m, D)
    return max(
        sum(2 * (len(users) - 1) if users[0] == p else 2 for _, users in spec.shared_kv(p))
        for p in range(D)
    )


def _spec(m: ModelShape, D: int) -> AttentionSpec:
    return AttentionSpec(
        m.hidden_size,
        m.num_heads,
        n_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        tsp_size=D,
        scaling=1.0,
    )


def tsp_mlp_columns(m: ModelShape, D: int) -> int:
    """MLP columns of the TSP rank with the largest share: ⌈F/D⌉ rows of the dense MLP, or
    ⌈E/D⌉ whole experts."""
    if m.moe:
        return -(-m.num_experts // D) * m.intermediate_size
    return -(-m.intermediate_size // D)


def _tsp_shard_params(m: ModelShape, D: int) -> float:
    """One decoder layer's parameters on the TSP rank with the largest shards."""
    nh, nkv = _tsp_heads(m, D)
    return _layer_params(m, nh, nkv, tsp_mlp_columns(m, D))
