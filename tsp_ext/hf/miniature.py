"""A miniature of a Hugging Face model's own config: the same class and every flag, small widths,
and the fewest leading layers that hold one layer of every kind the model has.

``apply_tsp``'s self-check (``hf.self_check``) folds the miniature to prove the fold exact before
any real weight moves; the model zoo test builds its models with it. What is shrunk: widths
(hidden size, head size, MLP and expert widths, latent ranks, state sizes), the vocabulary (special
token ids kept inside it), the depth (per-layer lists cut with it) and windows / attention chunks
(to a few tokens, so that a short sequence crosses them) and, for a given TSP size, the routed
experts (to a multiple of it). What is kept: head counts (they decide how TSP splits a layer
over the ranks), every other flag (multipliers, norms, biases, rotary settings, routers,
activations, NoPE layers).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

HEAD_DIM = 16  # each head's width in a miniature of up to 16 heads (fewer dims for more heads)
HIDDEN = 64
INTERMEDIATE = 32
EXPERT_INTERMEDIATE = 16
VOCAB = 128
MAX_PARAMETERS = 8_000_000  # a miniature above this has widths it did not shrink: refused
WINDOW = 8  # sliding windows and attention chunks: crossed by the check's 32-token rows
# int config fields set to a small width wherever a config has them (latent ranks, state sizes)
_SMALL = {
    "moe_intermediate_size": EXPERT_INTERMEDIATE,
    "shared_expert_intermediate_size": EXPERT_INTERMEDIATE,
    "expert_intermediate_size": EXPERT_INTERMEDIATE,
    "ffn_hidden_size": INTERMEDIATE,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": HEAD_DIM,
    "qk_rope_head_dim": HEAD_DIM,
    "v_head_dim": HEAD_DIM,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "state_size": 16,
}
_WINDOWS = ("sliding_window", "attention_chunk_size")
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")
_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def miniature_config(config):
    """A deep copy of ``config`` (a ``PretrainedConfig``) with small widths and a short
    vocabulary; its sub-configs (a VLM's text and vision configs) shrunk the same way. The depth
    is cut separately, by ``cut_layers`` (it needs the model's modules)."""
    mini = copy.deepcopy(config)
    for c in _configs(mini):
        _shrink(c)
        c._experts_implementation = "eager"  # grouped-GEMM experts have no float64 on CPU
    return mini


def build_miniature(
    model_class, config, device: torch.device | str = "cpu", tsp_size: int | None = None
) -> nn.Module:
    """A float64 ``model_class`` of ``fitted_miniature_config(model_class, config, tsp_size)``,
    its weights drawn from a fixed seed (the same on every rank) and moved off their init values
    (a zero bias or a unit norm weight would hide a fold that drops it)."""
    return build_from_miniature_config(
        model_class, fitted_miniature_config(model_class, config, tsp_size), device
    )


def fitted_miniature_config(model_class, config, tsp_size: int | None = None):
    """The whole config of ``config``'s miniature: ``miniature_config`` cut to the model's layer
    kinds, float64, SDPA where the class has it and, with ``tsp_size``, fewer experts
    (``fewer_experts``). Models that differ only in what the miniature shrinks (widths, depth past
    their layer kinds, vocabulary, dtype) have the same one. Raises ``ValueError`` for a miniature
    over ``MAX_PARAMETERS`` or one whose cut left it without a layer of every kind."""
    mini = miniature_config(config)
    for c in _configs(mini):
        c.dtype = torch.float64
        if tsp_size is not None:
            fewer_experts(c, tsp_size)
    # the reference's attention runs anywhere in float64: SDPA (eager's softmax is float32)
    mini._attn_implementation = "sdpa" if model_class._supports_sdpa else "eager"
    with torch.device("meta"), _outside_zero3():
        signatures = _layer_signatures(model_class._from_config(mini))
        keep = min(cut_layers(mini, signatures), len(signatures))
        cut = model_class._from_config(mini)
        size = sum(p.numel() for p in cut.parameters())
    if len(_layer_signatures(cut)) < keep:  # a cut below a layer of every kind proves too little
        raise ValueError(
            f"a miniature of this {config.model_type!r} config cannot be cut to its "
            f"{len(set(signatures))} kind(s) of decoder layer: it builds "
            f"{len(_layer_signatures(cut))} layers, not {keep}"
        )
    if size > MAX_PARAMETERS:
        raise ValueError(
            f"a miniature of this {config.model_type!r} config keeps {size / 1e6:.1f}M parameters "
            f"(at most {MAX_PARAMETERS / 1e6:.0f}M): some width of it is not one the miniature "
            "knows how to shrink"
        )
    return mini


def build_from_miniature_config(model_class, mini, device: torch.device | str = "cpu") -> nn.Module:
    """``build_miniature``'s model of a ``fitted_miniature_config``."""
    with torch.random.fork_rng(devices=[]), torch.device(device), _outside_zero3():
        torch.manual_seed(0)
        model = model_class._from_config(mini, dtype=torch.float64)
        with torch.no_grad():
            for p in model.parameters():
                scale = p.abs().mean().clamp_min(0.02)
                p.add_(0.25 * scale * torch.randn_like(p))
    return model


@contextlib.contextmanager
def _outside_zero3() -> Iterator[None]:
    """Hugging Face's ZeRO-3 switch off while a miniature is built: with a ZeRO-3
    ``TrainingArguments`` alive, ``_from_config`` would partition it with ``zero.Init`` (from a
    config whose "auto" values the Trainer has not filled in yet); a miniature is whole, local."""
    from transformers.integrations import deepspeed as hf_deepspeed

    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept


def fewer_experts(c, tsp_size: int) -> None:
    """Routed experts cut to the fewest that keep how D ranks split them: a multiple of D (when
    the count was one) of at least twice the experts a token picks; kept where the count does
    not split evenly, or a router groups the experts (``n_group``)."""
    for key in _EXPERT_COUNTS:
        n = getattr(c, key, None)
        if (
            not isinstance(n, int)
            or isinstance(n, bool)
            or n % tsp_size
            or (getattr(c, "n_group", None) or 1) > 1
        ):
            continue
        top_k = max((getattr(c, k, 0) or 0) for k in _TOP_K)
        fewer = -(-max(2 * top_k, 2 * tsp_size, 4) // tsp_size) * tsp_size
        if fewer < n:
            _set(c, key, fewer)


def cut_layers(config, signatures: list[str]) -> int:
    """Keep the fewest leading layers that hold every distinct layer ``signatures`` lists: set
    the layer count (``num_hidden_layers``, or ``num_layers`` where that is the count of
    ``signatures``) and cut the per-layer lists (``layer_types``, ``no_rope_layers``, ...) of
    every (sub-)config to that length. Returns the layers kept."""
    first = {}
    for i, s in enumerate(signatures):
        first.setdefault(s, i)
    keep = max(first.values(), default=0) + 1
    for c in _configs(config):
        counts = [k for k in _LAYER_COUNTS if isinstance(getattr(c, k, None), int)]
        counts = [k for k in counts if getattr(c, k) == len(signatures)] or counts[:1]
        for count in counts:
            n = getattr(c, count)
            if n <= keep:
                continue
            for key, value in list(vars(c).items()):
                per_layer = isinstance(value, (list, tuple)) or (
                    isinstance(value, str) and "pattern" in key
                )
                if per_layer and len(value) == n and not key.startswith("_"):
                    setattr(c, key, value[:keep])
            _set(c, count, keep)
    return keep


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The longest ``nn.ModuleList`` of a model that no other list holds: its decoder layers
    (not the experts inside one), None if it has none."""
    nested = {
        id(inner)
        for outer in model.modules()
        if isinstance(outer, nn.ModuleList)
        for inner in outer.modules()
        if inner is not outer
    }
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and id(m) not in nested]
    return max(lists, key=len, default=None)


def _layer_signatures(model: nn.Module) -> list[str]:
    """One string per decoder layer saying what kind of layer it is: its submodules' names,
    classes, parameter shapes and scalar attributes (a layer's index excepted)."""
    layers = decoder_layers(model)
    if layers is None:
        return []
    return [_signature(layer) for layer in layers]


def _signature(layer: nn.Module) -> str:
    parts = []
    for name, module in layer.named_modules():
        attrs = sorted(
            (k, v)
            for k, v in vars(module).items()
            if not k.startswith("_") and "idx" not in k and "index" not in k
            if isinstance(v, (bool, int, float, str, type(None))) and k != "training"
        )
        shapes = [(n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)]
        parts.append(f"{name}:{type(module).__name__}:{shapes}:{attrs}")
    return "|".join(parts)


def _configs(config) -> Iterator:
    """``config`` and every sub-config in it, depth first."""
    yield config
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            yield from _configs(sub)


def _set(config, key: str, value) -> None:
    """Set ``key`` where the config has it (or maps it: ``attribute_map``) and accepts it."""
    try:
        current = getattr(config, key)
    except AttributeError:
        return
    if current is None or isinstance(current, bool):
        return
    try:
        setattr(config, key, value)
    except (AttributeError, TypeError, ValueError):
        pass  # a read-only property derived from other fields


def _shrink(c) -> None:
    head_dim = _shrink_heads(c)
    rotary = getattr(c, "rotary_dim", None)
    if isinstance(rotary, int) and head_dim:  # rotary dims of each head: the same share of it
        size = _head_size(getattr(c, "num_attention_heads", None))
        _set(c, "rotary_dim", max(2, rotary * size // head_dim // 2 * 2))
    inter = getattr(c, "intermediate_size", None)
    if isinstance(inter, (list, tuple)):
        c.intermediate_size = type(inter)(INTERMEDIATE for _ in inter)
    elif isinstance(inter, int):
        _set(c, "intermediate_size", INTERMEDIATE)
    for key, value in _SMALL.items():
        if isinstance(getattr(c, key, None), int):
            _set(c, key, value)
    for key in _WINDOWS:
        value = getattr(c, key, None)
        if isinstance(value, int) and value > WINDOW:
            _set(c, key, WINDOW)
    vocab = getattr(c, "vocab_size", None)
    if isinstance(vocab, int) and vocab > VOCAB:
        _set(c, "vocab_size", VOCAB)
        _keep_ids_in_vocabulary(c, VOCAB)


def _head_size(heads) -> int:
    """A miniature's head size: ``HEAD_DIM``, less for many heads (at least 4) so that the
    projections stay small."""
    if not isinstance(heads, int) or heads <= 16:
        return HEAD_DIM
    return max(4, HEAD_DIM * 16 // heads // 2 * 2)


def _shrink_heads(c) -> int | None:
    """Small heads and the hidden size that goes with them; returns the head size they replaced
    (None: unchanged). M-RoPE configs keep both: their sections split each head."""
    heads = getattr(c, "num_attention_heads", None)
    hidden = getattr(c, "hidden_size", None)
    if _mrope(c):
        return None
    size = _head_size(heads)
    head_dim = vars(c).get("head_dim")
    if not isinstance(head_dim, int):  # derived: hidden / heads
        if isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
            _set(c, "hidden_size", heads * size)
            return hidden // heads
        _set(c, "hidden_size", HIDDEN)
        return None
    _set(c, "head_dim", size)
    # keep hidden = heads x head_dim where it was so (some models take one for the other)
    tied = isinstance(heads, int) and hidden == heads * head_dim
    _set(c, "hidden_size", heads * size if tied else HIDDEN)
    return head_dim


def _mrope(c) -> bool:
    """Whether a config's rotary parameters split each head into M-RoPE sections."""
    rope = getattr(c, "rope_parameters", None) or {}
    tables = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    return any("mrope_section" in t for t in tables)


def _keep_ids_in_vocabulary(c, vocab: int) -> None:
    """Special token ids at or past the shrunk vocabulary moved to its last ids (distinct ids
    stay distinct; a padding id stays a padding id)."""
    moved: dict[int, int] = {}

    def inside(i):
        if not isinstance(i, int) or isinstance(i, bool) or i < vocab:
            return i
        return moved.setdefault(i, vocab - 1 - len(moved))

    for key in _IDS:
        value = getattr(c, key, None)
        if isinstance(value, (list, tuple)):
            _set(c, key, type(value)(inside(i) for i in value))
        elif isinstance(value, int):
            _set(c, key, inside(value))
