"""``apply_tsp``: turn a Hugging Face causal LM of a supported family (``hf.families``) into a
TSP model, in place.

Steps, in order (numbered as in ``apply_tsp``):
  1. check the model (structure and config), the mesh and the split of heads, MLP rows and
     experts over it, then fold a miniature of its config and prove it exact (``self_check``),
     before anything is touched;
  2. replace each decoder layer's attention (head group p), MLP (slice p; a mixture-of-experts
     block: E/D whole experts) and norms, then the embedding and LM head (vocabulary row block p;
     ``TSPConfig(shard_vocab=False)`` keeps them replicated), by TSP modules built from them;
     groups, slices and blocks differ by at most one head / row; the full weights are dropped,
     the norms keep their (tiny) replicated weights, and parameters frozen before stay frozen;
  3. QLoRA (``TSPConfig(quantize_base="nf4")``): the frozen base's shards in 4-bit NormalFloat;
  4. switch the model to TSP-aware behaviour: no attention masks (causal by global position), no
     KV cache in training calls, a loss that is the global token mean over the TSP group (with a
     sharded vocabulary: the fused ring LM head + cross-entropy, no full logits), an input check
     that rejects batches not made by ``shard_batch``, and ``generate`` with a sharded KV cache
     (calls that carry a ``TSPCache`` take the inference path, ``hf.inference``); then, with
     ``TSPConfig(checkpoint_layers=True)``, checkpoint every decoder layer (its input offloaded
     to host memory with ``offload_checkpoints``: ``hf.checkpointing``).

A ``peft.PeftModel`` with a LoRA adapter is folded too (``hf.lora``): the adapters follow their
base weights' shards and the PEFT model is returned, still a PEFT model.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import TSPConfig
from ..engine.attention.schedule import AttentionSpec
from ..engine.sharding.partition import check_split
from ..mesh import init_tsp_mesh, tsp_group
from .adapter_save import save_adapter
from .causal_lm import TSPCausalLMLoss, check_inputs
from .checkpointing import HostStore, enable_layer_checkpointing
from .families import family_of, gate_activation, supported_names
from .generate import tsp_forward, tsp_generate, tsp_vision_forward
from .layers import CHANNEL_MIXERS, TOKEN_MIXERS, check_layer, layer_types, unfuse
from .lora import (
    attach_adapters,
    check_adapters_agree,
    check_peft_model,
    detach_adapters,
    fold_on_shards,
    peft_base,
)
from .moe import n_experts_of
from .nf4 import quantize_projections
from .replicated import TSPEmbedding, TSPLMHead, TSPRMSNorm, replicated_vectors
from .self_check import self_check
from .spec import Family
from .vocab import TSPVocabEmbedding, TSPVocabLMHead

# The attention implementation name a TSP model reports: transformers builds no mask for it.
ATTN_IMPLEMENTATION = "tsp"
# RoPE variants whose cos/sin depend on the token's position only (not on the sequence seen)
_POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class TSPState:
    """What ``apply_tsp`` records on the model (``model.tsp``)."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    config: TSPConfig  # as applied: ``tsp_size`` is the mesh's
    family: Family  # where the model keeps its parts (``hf.families``)
    hf_config_values: dict  # config fields apply_tsp changed, as they were (for export)
    bucketed: tuple[str, ...] = ()  # replicated vectors whose gradients share one all-reduce
    host_store: HostStore | None = None  # the offloaded layer checkpoints (offload_checkpoints)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


def apply_tsp(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    tsp_size: int | None = None,
    config: TSPConfig | None = None,
) -> nn.Module:
    """Make ``model`` a TSP model on the mesh's ``"tsp"`` axis, in place; returns it.

    Args:
        model: a Hugging Face ``*ForCausalLM`` (or vision-language model) of a supported family
            (``hf.families.FAMILIES``, or any model with one's structure that the self-check
            proves exact), with the same weights on
            every rank; or a
            ``peft.PeftModel`` of one with a LoRA adapter on some of q/k/v/o/gate/up/down
            (``get_peft_model`` first, then ``apply_tsp``; the same adapter on every rank).
        mesh: a mesh with a ``"tsp"`` dimension; built with ``init_tsp_mesh(tsp_size)`` if None.
        tsp_size: TSP axis size when no mesh is given (else ``config.tsp_size``).
        config: engine options (``TSPConfig``).

    Raises:
        ValueError: unsupported model or config (a miniature of it folded wrong included), a
            TSP size larger than the number of query
            heads, or a mesh whose TSP size disagrees with ``tsp_size`` / ``config``.
    """
    config = config or TSPConfig()
    if getattr(model, "tsp", None) is not None:
        return _fold_new_adapters(model, config)
    peft_model, adapter = model, None
    if peft_base(model) is not None:
        adapter = check_peft_model(model)
        model = peft_base(model)
    # 1. check the model, the mesh and the split, before anything is touched
    family = check_supported(model)
    if config.quantize_base == "nf4" and family.hybrid:
        raise ValueError(
            f"quantize_base='nf4' (QLoRA) of {type(model).__name__} is not supported under TSP "
            "(its gated q_proj and linear-attention layers are not quantized): use LoRA on a "
            "bf16 base"
        )
    if config.checkpoint_every > 1 and family.vision is not None and family.vision.deepstack:
        raise ValueError(
            f"checkpoint_every={config.checkpoint_every} with {family.name}: its deepstack "
            "features join the hidden states between layers, inside an interval; use "
            "checkpoint_every=1"
        )
    mesh, group = _resolve_mesh(mesh, tsp_size or config.tsp_size)
    moe = any(family.is_moe(getattr(x, family.mlp)) for x in family.layers_of(model))
    _check_split(model.config.get_text_config(), dist.get_world_size(group), moe)
    if adapter is not None:
        check_adapters_agree(peft_model, group)
    if config.self_check:  # a miniature of the model's config folds exactly, or nothing moves
        self_check(model, mesh, group, config)
    # 2. replace the decoder layers' parts, the embedding and the LM head by their shards; the
    # parameters frozen before stay frozen (the TSP modules' shards start trainable)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    _shard_layers(model, family, group, config, adapter=adapter)
    _shard_vocabulary(model, family, group, config)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    # 3. QLoRA: the frozen base's shards in NF4
    if config.quantize_base == "nf4":
        if adapter is None:
            raise ValueError(
                "quantize_base='nf4' (QLoRA) quantizes a frozen base: apply TSP to a PEFT LoRA "
                "model (get_peft_model first)"
            )
        quantize_projections(model)
    # 4. TSP-aware behaviour (masks, cache, loss, inputs, generate), then layer checkpointing
    _switch_behaviour(model, mesh, group, config, family=family)
    if config.checkpoint_layers:
        store = enable_layer_checkpointing(
            model,
            config.offload_checkpoints,
            config.checkpoint_device_bytes,
            config.checkpoint_every,
        )
        model.tsp = replace(model.tsp, host_store=store)
    if adapter is not None:
        _patch_peft(peft_model)
    return peft_model


def _fold_new_adapters(model: nn.Module, config: TSPConfig) -> nn.Module:
    """``apply_tsp`` of a PEFT model made by ``get_peft_model`` on a TSP model: fold the adapters
    it added onto the shards (and quantize the base for QLoRA)."""
    if peft_base(model) is None:
        raise ValueError("apply_tsp was already applied to this model")
    fold_on_shards(model)
    base = peft_base(model)
    if config.quantize_base == "nf4":
        quantize_projections(base)
    base.tsp = replace(base.tsp, bucketed=replicated_vectors(base))
    _patch_peft(model)
    return model


def _resolve_mesh(
    mesh: DeviceMesh | None, size: int | None
) -> tuple[DeviceMesh, dist.ProcessGroup]:
    """The mesh (``init_tsp_mesh(size)`` if None) and its TSP group, checked against ``size``."""
    if mesh is None:
        if size is None:
            raise ValueError("apply_tsp needs a mesh or a tsp_size (argument or TSPConfig)")
        mesh = init_tsp_mesh(size)
    group = tsp_group(mesh)
    D = dist.get_world_size(group)
    if size is not None and size != D:
        raise ValueError(f"tsp_size={size} but the mesh's 'tsp' dimension has {D} ranks")
    return mesh, group


def _shard_layers(model: nn.Module, f: Family, group, config: TSPConfig, adapter) -> None:
    """Each decoder layer's attention (head group p), MLP (slice p, or E/D experts) and norms as
    TSP modules; LoRA adapters move onto the new modules' shards."""
    for layer in f.layers_of(model):
        # Phi-3's qkv_proj / gate_up_proj, Qwen3.5's in_proj_qkv: their parts, as TSP shards them
        unfuse(f, layer, model.config.get_text_config())
    for layer in f.layers_of(model):
        token, channel = f.token_mixer(layer), f.channel_mixer(layer)
        for kind, registry in ((token, TOKEN_MIXERS), (channel, CHANNEL_MIXERS)):
            hf_module = getattr(layer, kind.module)
            taken = detach_adapters(hf_module, kind.projections)
            tsp_class = registry[kind.kind].tsp_class
            setattr(layer, kind.module, tsp_class.from_hf(hf_module, group, config, family=f))
            attach_adapters(getattr(layer, kind.module), taken, adapter)
        for name in f.layer_norms:
            setattr(layer, name, _norm(f, getattr(layer, name), group))
    base = f.base_of(model)
    setattr(base, f.final_norm, _norm(f, getattr(base, f.final_norm), group))


def _shard_vocabulary(model: nn.Module, f: Family, group, config: TSPConfig) -> None:
    """The embedding and LM head by vocabulary row block p (``shard_vocab``), else replicated."""
    base = f.base_of(model)
    embedding, head = getattr(base, f.embedding), getattr(model, f.lm_head)
    if config.shard_vocab:
        tied = head.weight is embedding.weight
        embedding = TSPVocabEmbedding.from_hf(embedding, group)
        head = TSPVocabLMHead.from_hf(head, group, config, embedding if tied else None)
    else:
        embedding, head = TSPEmbedding.from_hf(embedding, group), TSPLMHead.from_hf(head, group)
    setattr(base, f.embedding, embedding)
    setattr(model, f.lm_head, head)


def _switch_behaviour(model: nn.Module, mesh, group, config: TSPConfig, family: Family) -> None:
    """No masks (causal by global position), no cache in training calls, the global-mean loss,
    the input check, TSP's forward and ``generate``; records ``model.tsp``."""
    text = model.config.get_text_config()  # the model's config, or a VLM's language model's
    changed = {"_attn_implementation": text._attn_implementation, "use_cache": text.use_cache}
    text._attn_implementation = ATTN_IMPLEMENTATION
    text.use_cache = False  # training calls keep no cache; generate passes a TSPCache
    model.loss_function = TSPCausalLMLoss(group)
    D = dist.get_world_size(group)
    model.tsp = TSPState(
        mesh, group, config=replace(config, tsp_size=D), family=family, hf_config_values=changed
    )
    model.tsp = replace(model.tsp, bucketed=replicated_vectors(model))
    forward = tsp_forward if family.vision is None else tsp_vision_forward
    model.forward = types.MethodType(forward, model)
    model.generate = types.MethodType(tsp_generate, model)
    model.register_forward_pre_hook(check_inputs, with_kwargs=True)


def _patch_peft(peft_model) -> None:
    """A TSP PEFT model's ``save_pretrained`` gathers the adapter from the shards."""
    peft_model.save_pretrained = types.MethodType(_save_adapter, peft_model)


def _save_adapter(peft_model, save_directory, **kwargs) -> None:
    """``PeftModel.save_pretrained`` of a TSP PEFT model: the adapter gathered from the shards
    (collective: every rank calls it; ``hf.adapter_save.save_adapter``)."""
    save_adapter(peft_model, save_directory)


def _norm(f: Family, norm: nn.Module, group) -> TSPRMSNorm:
    return TSPRMSNorm.from_hf(norm, group, f.norm_eps, f.norm_offset)


def check_supported(model: nn.Module) -> Family:
    """Raise ``ValueError`` naming the reason if ``model`` cannot be run under TSP; else return
    its family (``hf.families``)."""
    name = type(model).__name__
    if getattr(model, "config", None) is None:
        raise ValueError(f"{name} has no config: not a Hugging Face causal LM")
    family = f = family_of(model)
    cfg = model.config.get_text_config()  # a vision-language model's: its language model's
    for i, layer in enumerate(f.layers_of(model)):
        check_layer(name, i, layer, f)
        for norm in f.layer_norms:
            module = getattr(layer, norm, None)
            if module is None:
                raise ValueError(
                    f"{name} layer {i}: no {norm}, which the {f.name} family's layers have; "
                    f"supported: {supported_names()} and models of the same structure"
                )
            if not hasattr(module, f.norm_eps):
                kind = "(1 + weight)" if f.norm_offset else "weight"
                raise ValueError(
                    f"{name} (model_type={getattr(cfg, 'model_type', None)!r}) layer {i}: "
                    f"{norm} is a {type(module).__name__}, not the {f.name} family's RMSNorm "
                    f"(x / rms(x) * {kind}, with {f.norm_eps}); supported: "
                    f"{supported_names()} and models of the same structure"
                )
    runs = layer_types(f)
    kinds = set(getattr(cfg, "layer_types", None) or ()) - runs
    if kinds:
        raise ValueError(
            f"{name}: layer types {sorted(kinds)} are not supported; TSP runs {sorted(runs)} "
            f"layers in the {f.name} family"
        )
    try:
        gate_activation(cfg, f.activation)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{name}: MLP biases (mlp_bias=True) are not supported")
    if getattr(cfg, "attention_dropout", 0.0):
        raise ValueError(f"{name}: attention dropout is not supported; set attention_dropout=0")
    rope = getattr(cfg, "rope_parameters", None) or {}
    per_type = [p for p in rope.values() if isinstance(p, dict)]  # Gemma-3: one per layer type
    for params in per_type or [rope]:
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if partial != 1.0 and not f.partial_rotary:
            raise ValueError(
                f"{name}: partial_rotary_factor={partial} (RoPE on part of each head) is not "
                "supported under TSP; it rotates whole heads"
            )
        rope_type = params.get("rope_type", "default")
        if rope_type not in _POSITION_ONLY_ROPE:
            # e.g. dynamic NTK: its scaling depends on the largest position each rank sees
            raise ValueError(f"{name}: rope type {rope_type!r} is not supported under TSP")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None) is not None:
            raise ValueError(
                f"{name}: {key}={getattr(cfg, key)} (tanh soft-capping) is not supported under "
                f"TSP; supported: {supported_names()} without soft-capping"
            )
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{name}: bidirectional attention is not supported; TSP is causal")
    return family


def _check_split(cfg, D: int, moe: bool) -> None:
    """Every rank gets at least one query head (and MLP row, of every expert where ``moe``),
    checked before any weight is sliced; head counts, MLP widths and vocabularies need not be
    multiples of D."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    AttentionSpec(
        cfg.hidden_size,
        cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        tsp_size=D,
        scaling=1.0,
    )
    if getattr(cfg, "intermediate_size", None):  # none in Qwen3.5-MoE: experts only
        check_split(cfg.intermediate_size, D, "intermediate_size", "use a smaller TSP size")
    if getattr(cfg, "linear_num_key_heads", None):  # Gated DeltaNet head groups
        check_split(cfg.linear_num_key_heads, D, "linear_num_key_heads", "use a smaller TSP size")
    if moe:
        hint = "use a smaller TSP size"
        check_split(n_experts_of(cfg), D, "the number of experts", hint)
        shared = getattr(cfg, "shared_expert_intermediate_size", None)
        if shared:
            check_split(shared, D, "shared_expert_intermediate_size", hint)
