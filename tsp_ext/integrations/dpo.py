"""TRL's ``DPOTrainer`` on a TSP model: preference training at long context.

    trainer = TSPDPOTrainer(model=model, args=DPOConfig(...), train_dataset=pairs,
                            processing_class=tokenizer, tsp=2, peft_config=LoraConfig(...))
    trainer.train()

TRL scores every chosen and rejected sequence through the fused-LM-head protocol,
``model(input_ids, attention_mask, labels, fused_lm_head=True).log_probs``; a TSP model answers
it itself (``hf.log_probs``): it shards the full batch, runs the vocab-sharded ring (no rank
ever holds logits beyond one ``[loss_chunk, V/D]`` block) and returns the per-token fields of the
whole sequences on every rank. TRL's own loss code then runs unchanged, with the same values on
every rank of a TSP group: every ``loss_type``, ``ld_alpha``, WPO weighting, its metrics (reward
margins and accuracies, log-probs, entropy, token accuracy).

The reference model is folded like the policy (1/D of its weights, run under ``no_grad``):

- with LoRA (``peft_config=``, or a PEFT model whose adapters are still zero): the policy with
  its adapters disabled, no second model;
- ``ref_model=``: a plain Hugging Face model is made a frozen TSP model on the policy's mesh; a
  TSP model must be on the policy's TSP group;
- neither (full fine-tuning): a frozen copy of the policy, made from its shards once it is
  folded (1/D of the weights: no rank ever holds a second full model).

Everything else is ``TSPTrainerMixin``'s: the (dp, tsp) mesh, DDP / FSDP2 / DeepSpeed ZeRO over
dp, the same batches on every rank of a TSP group, checkpoints and export.
"""

from __future__ import annotations

import torch.distributed as dist
from accelerate.utils import is_peft_model
from torch import nn
from trl import DPOConfig, DPOTrainer
from trl.trainer import dpo_trainer

from ..engine.parallel.agreement import agree
from ..hf.lora import peft_base
from .reference import (
    adapter_made_already,
    bind_tsp_forward,
    fold_reference,
    fresh_adapter,
    frozen_copy,
)
from .trainer import TSPTrainerMixin


class TSPDPOTrainer(TSPTrainerMixin, DPOTrainer):
    """``trl.DPOTrainer`` for a TSP model; see the module docstring.

    Args (besides ``DPOTrainer``'s): ``tsp`` and ``data_parallel`` as for ``TSPTrainer``.
    """

    def __init__(
        self,
        model: nn.Module,
        ref_model: nn.Module | None = None,
        args: DPOConfig | None = None,
        **kwargs,
    ) -> None:
        if not isinstance(args, DPOConfig):
            raise ValueError("TSPDPOTrainer needs args=DPOConfig(...)")
        _check_config(args)
        self._reference = ref_model
        super().__init__(model, args, **kwargs)

    def _folded(self, model: nn.Module) -> None:
        """Full fine-tuning without ``ref_model``: the reference is a copy of the policy's shards
        (with LoRA it is the policy with its adapters disabled)."""
        if self._reference is None and not is_peft_model(model):
            self._reference = frozen_copy(model)

    def _init_trainer(self, model: nn.Module, args: DPOConfig, **kwargs) -> None:
        ref = fold_reference(self._reference, model, self.tsp_mesh)
        del self._reference
        if is_peft_model(model):
            adapter = fresh_adapter(model, "TSPDPOTrainer")
            with adapter_made_already(dpo_trainer, model):
                base = peft_base(model)
                DPOTrainer.__init__(self, base, ref, args, peft_config=adapter, **kwargs)
        else:
            DPOTrainer.__init__(self, model, ref, args, **kwargs)
        bind_tsp_forward(self.model, self.ref_model)
        self._tp_size = self.get_tp_size()  # TRL's token count: every token once per TSP group

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's DPO loss of the full batch (the model shards it itself)."""
        _check_pairs(inputs)
        return DPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)


def _check_config(args: DPOConfig) -> None:
    if args.precompute_ref_log_probs:
        raise ValueError(
            "TSPDPOTrainer computes the reference log-probs in each step (the reference is "
            "folded: 1/D of its weights per rank): drop precompute_ref_log_probs"
        )
    if args.sync_ref_model:
        raise ValueError("TSPDPOTrainer does not support sync_ref_model: drop it")


def _check_pairs(inputs: dict) -> None:
    """The batch is ``[chosen; rejected]`` pairs and every sequence has completion tokens
    (collective: on every rank at once)."""
    mask = inputs["completion_mask"]
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    error = None
    if mask.shape[0] % 2:
        error = (
            f"the batch has {mask.shape[0]} sequences, but DPO's are [chosen; rejected] with as "
            "many of each: give every prompt one chosen and one rejected completion"
        )
    elif empty:
        half = mask.shape[0] // 2
        which = "chosen" if empty[0] < half else "rejected"
        error = (
            f"the {which} sequence of pair {empty[0] % half} has no completion tokens (its "
            "prompt fills max_length): raise DPOConfig.max_length or drop the pair"
        )
    agree(error, [], dist.group.WORLD)
