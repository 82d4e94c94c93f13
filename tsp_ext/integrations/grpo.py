"""TRL's ``GRPOTrainer`` on a TSP model: online RL with long rollouts.

    trainer = TSPGRPOTrainer(model, reward_funcs=[exact_match], args=GRPOConfig(...),
                             train_dataset=prompts, processing_class=tokenizer, tsp=2,
                             peft_config=LoraConfig(...))
    trainer.train()

Each step is TRL's: generate ``num_generations`` completions per prompt, reward them, score them
under the policy (and the old policy, the reference), and train on TRL's loss, unchanged (every
``loss_type``, token / sequence importance sampling, ``mask_truncated_completions``, entropy
masking and metrics). What TSP changes:

- **Rollouts** come from the TSP model's own ``generate()`` (1/D of the weights and of the KV
  cache per rank). Every rank of a TSP group samples the *same* tokens by construction: its
  logits are the all-gather of the ranks' vocab shards (the same bits everywhere) and its
  sampling generator starts from the group's first rank's state (``hf.generate``); a checksum
  of the prompts and completions, compared across the group, guards any other rollout source.
  Different dp replicas read different prompts and sample independently.
- **Scoring** goes through the fused ring (``scoring.completion_logps``): no rank ever holds
  logits beyond one ``[loss_chunk, V/D]`` block; old-policy and reference scoring run under
  ``no_grad``. The reference is folded like DPO's (``reference``): LoRA disables the adapters,
  full fine-tuning scores with a frozen copy of the policy's shards.
- **Rewards** run once per TSP group (its first rank), are broadcast to the group, and TRL's
  gathers, token counts and metrics cover the dp replicas, not the D copies of each row
  (``replicas``).
- ``generation_batch_size`` counts dp replicas: ``per_device_train_batch_size × dp ×
  steps_per_generation`` prompts' completions per generation round.

Not supported (refused): vLLM generation (colocate or server: an external generator can get
the weights with ``tsp_ext.stream_weights``), continuous batching, tools and environments
(multi-turn), vision-language models, ``cast_lm_head_to_fp32``, ``sync_ref_model``.
"""

from __future__ import annotations

import json
import os

import torch
from accelerate.utils import is_peft_model
from torch import nn
from transformers import ProcessorMixin
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer

from ..hf.generate import sync_sampling_state
from ..hf.lora import peft_base
from .reference import adapter_made_already, bind_tsp_forward, fresh_adapter, frozen_copy
from .replicas import over_replicas
from .rollouts import check_same_ids, check_within_positions, rewards_once_per_group
from .scoring import check_temperature, completion_logps, tempered
from .trainer import TSPTrainerMixin

_REFUSED = {
    "tools": "tool calling (multi-turn rollouts)",
    "environment_factory": "environments (multi-turn rollouts)",
}


class TSPGRPOTrainer(TSPTrainerMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` for a TSP model; see the module docstring.

    Args (besides ``GRPOTrainer``'s): ``tsp`` and ``data_parallel`` as for ``TSPTrainer``.
    """

    def __init__(self, model: nn.Module, reward_funcs=None, args: GRPOConfig | None = None, **kw):
        if not isinstance(args, GRPOConfig):
            raise ValueError("TSPGRPOTrainer needs args=GRPOConfig(...)")
        check_online_config(args, kw, "TSPGRPOTrainer")
        self._beta, self._reference = args.beta, None
        super().__init__(model, args, reward_funcs=reward_funcs, **kw)

    def _folded(self, model: nn.Module) -> None:
        """Full fine-tuning with ``beta > 0``: the reference is a frozen copy of the policy's
        shards, made before data parallelism wraps or shards the policy."""
        if self._beta != 0.0 and not is_peft_model(model):
            self._reference = frozen_copy(model)

    def _init_trainer(self, model: nn.Module, args: GRPOConfig, **kwargs) -> None:
        check_temperature(model, args.temperature)
        count_replicas(args, self.tsp_mesh["dp"].size())
        with _reference_is(self._reference):
            if is_peft_model(model):
                adapter = fresh_adapter(model, "TSPGRPOTrainer")
                with adapter_made_already(grpo_trainer, model):
                    GRPOTrainer.__init__(
                        self, peft_base(model), args=args, peft_config=adapter, **kwargs
                    )
            else:
                GRPOTrainer.__init__(self, model, args=args, **kwargs)
        del self._reference
        bind_tsp_forward(self.model, self.ref_model)

    # -- rollouts ----------------------------------------------------------------------------

    def _replicas(self):
        return over_replicas(self, grpo_trainer, self.tsp_mesh["dp"].get_group())

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        """TRL's rollout round with its collectives over the dp replicas; the TSP group leaves it
        with one random state (its reward functions ran on one rank), so TRL's shuffle of the
        round agrees too."""
        with self._replicas():
            out = GRPOTrainer._generate_and_score_completions(self, inputs)
        sync_sampling_state(self.tsp_mesh["tsp"].get_group(), self.accelerator.device)
        return out

    def _generate(self, prompts: list):
        out = GRPOTrainer._generate(self, prompts)
        group = self.tsp_mesh["tsp"].get_group()
        check_same_ids(out[0], "prompt", group)
        check_same_ids(out[1], "completion", group)
        return out

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        """TRL's generation with the TSP model itself (not its data-parallel wrapper: its
        ``generate`` is TSP's, and FSDP2 / ZeRO-3 gather their dp shards in its forward)."""
        check_same_ids(prompt_ids, "prompt", self.tsp_mesh["tsp"].get_group())
        check_within_positions(self.model, prompt_ids, self.max_completion_length)
        wrapped, self.model_wrapped = self.model_wrapped, self.model
        try:
            return GRPOTrainer._generate_single_turn(self, prompt_ids, *args, **kwargs)
        finally:
            self.model_wrapped = wrapped

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return rewards_once_per_group(
            lambda: GRPOTrainer._calculate_rewards(
                self, inputs, prompts, completions, completion_ids_list
            ),
            (len(prompts), len(self.reward_funcs)),
            self.tsp_mesh,
            self.accelerator.device,
            grpo_trainer,
        )

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's scoring (in row chunks of ``batch_size``) through ``completion_logps``."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise ValueError(f"TSPGRPOTrainer scores text only: got {given}")
        batch_size = batch_size or input_ids.size(0)
        parts = []
        with tempered(model, self.temperature), self.accelerator.autocast():
            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                parts.append(
                    completion_logps(
                        model,
                        input_ids[rows],
                        attention_mask[rows],
                        logits_to_keep,
                        entropy=compute_entropy,
                        router_logits=compute_aux_loss,
                    )  # fmt: skip
                )
        logps, entropies, aux = zip(*parts)
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    # -- loss ------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's GRPO loss on the rollout rows (the model shards them itself)."""
        with self._replicas():
            return GRPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """The TSP training state, and TRL's adaptive entropy controller's."""
        TSPTrainerMixin._load_optimizer_and_scheduler(self, checkpoint_dir)
        path = os.path.join(checkpoint_dir or "", "entropy_ctrl_state.json")
        if self.use_adaptive_entropy and checkpoint_dir is not None and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.entropy_coef = state["entropy_coef"]
            self._last_world_entropy = state["last_world_entropy"]


def check_online_config(args, kwargs: dict, trainer: str) -> None:
    """Refuse what TSP's online trainers do not run, before anything is built."""
    if args.use_vllm:
        raise ValueError(
            f"{trainer} generates with the TSP model itself (1/D of the weights and KV cache per "
            "rank): drop use_vllm (colocate would load a full model per process; to feed an "
            "external vLLM server, stream the weights with tsp_ext.stream_weights)"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(f"{trainer} does not support continuous batching: drop it")
    if args.cast_lm_head_to_fp32:
        raise ValueError(
            f"{trainer}: cast_lm_head_to_fp32 replaces the LM head, which TSP shards over the "
            "vocabulary (its ring computes the log-softmax in float32 already): drop it"
        )
    if getattr(args, "sync_ref_model", False):
        raise ValueError(f"{trainer} does not support sync_ref_model: drop it")
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{trainer} does not support {what}: drop {name}=")
    if isinstance(kwargs.get("processing_class"), ProcessorMixin):
        raise ValueError(f"{trainer} trains text models: pass a tokenizer, not a processor")


def count_replicas(args, dp: int) -> None:
    """``generation_batch_size`` over the dp replicas (TRL counts every process; a TSP group
    reads one replica's rows), checked to hold whole prompt groups."""
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise ValueError(
            "a generation round holds per_device_train_batch_size "
            f"({args.per_device_train_batch_size}) x dp ({dp}) x steps_per_generation "
            f"({args.steps_per_generation}) = "
            f"{args.generation_batch_size} completions, which num_generations "
            f"({args.num_generations}) does not divide: every prompt's group must be whole "
            "(the TSP ranks of a group share rows: count dp replicas, not processes)"
        )


class _reference_is:
    """Within: TRL's ``create_model_from_path`` returns ``ref`` (the folded copy) instead of
    loading a full model from the hub."""

    def __init__(self, ref: nn.Module | None) -> None:
        self.ref = ref

    def __enter__(self):
        self.saved = grpo_trainer.create_model_from_path
        if self.ref is not None:
            grpo_trainer.create_model_from_path = lambda *args, **kwargs: self.ref

    def __exit__(self, *exc):
        grpo_trainer.create_model_from_path = self.saved
