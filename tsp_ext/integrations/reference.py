"""The frozen reference model of TRL's trainers (DPO, GRPO, RLOO), folded like the policy.

- with LoRA: the policy with its adapters disabled, no second model (``fresh_adapter`` checks
  the adapter is still untrained, ``adapter_made_already`` hands TRL the folded PEFT model);
- a plain Hugging Face ``ref_model``: made a frozen TSP model on the policy's mesh
  (``fold_reference``);
- neither, for full fine-tuning: a frozen copy of the policy's shares (``frozen_copy``): 1/D of
  the weights per rank, never a second full model.
"""

from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import replace

import torch.distributed as dist
from torch import nn

from ..hf.apply import apply_tsp
from ..hf.lora import peft_base


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of the TSP ``model``'s shards on the same TSP group and mesh, frozen, in eval mode."""
    state = model.tsp
    shared = (state.group, state.mesh, state.host_store)
    ref = copy.deepcopy(model, memo={id(o): o for o in shared})
    return ref.requires_grad_(False).eval()


def fold_reference(ref: nn.Module | None, policy: nn.Module, mesh) -> nn.Module | None:
    """``ref`` as a frozen TSP model folded like ``policy`` (None stays None)."""
    if ref is None:
        return None
    base = peft_base(policy) or policy
    state = getattr(ref, "tsp", None)
    ref.requires_grad_(False)  # before folding: apply_tsp keeps frozen parameters frozen
    if state is None:
        frozen = dict(checkpoint_layers=False, offload_checkpoints=False, quantize_base=None)
        apply_tsp(ref, mesh, config=replace(base.tsp.config, **frozen))
    else:
        ranks = dist.get_process_group_ranks
        if ranks(state.group) != ranks(base.tsp.group):
            raise ValueError(
                f"ref_model is a TSP model on ranks {ranks(state.group)} but the policy's TSP "
                f"group is {ranks(base.tsp.group)}: pass the reference before apply_tsp (the "
                "trainer folds it on the policy's mesh) or apply_tsp it on the same mesh"
            )
    return ref.eval()


def fresh_adapter(peft_model: nn.Module, trainer: str):
    """The LoRA config of ``peft_model`` if its adapters are still zero (``lora_B``): then the
    reference is the policy with adapters disabled."""
    trained = [n for n, p in peft_model.named_parameters() if "lora_B" in n and p.detach().any()]
    if trained:
        raise ValueError(
            f"{trainer} takes a PEFT model whose adapters are untrained (the reference is "
            f"the base model with adapters disabled), but {trained[0]} is not zero: merge the "
            "adapter into the base (merge_and_unload) and pass peft_config= for a new one"
        )
    return peft_model.peft_config["default"]


@contextlib.contextmanager
def adapter_made_already(module: types.ModuleType, peft_model: nn.Module):
    """TRL's ``get_peft_model(model, peft_config)`` (as ``module`` imported it) returns
    ``peft_model``: its adapters are made and folded already (before data parallelism wrapped
    or sharded them)."""
    original = module.get_peft_model
    module.get_peft_model = lambda *args, **kwargs: peft_model
    try:
        yield
    finally:
        module.get_peft_model = original


def bind_tsp_forward(*models: nn.Module | None) -> None:
    """Give each TSP model back its own ``forward`` (TRL wrapped it with its fused LM head; a
    TSP model answers ``fused_lm_head=True`` itself, from the vocab-sharded ring)."""
    from ..hf.generate import tsp_forward

    for m in models:
        if m is not None:
            base = peft_base(m) or m
            base.forward = types.MethodType(tsp_forward, base)
