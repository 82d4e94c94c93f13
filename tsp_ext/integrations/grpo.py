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

from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer

from .online import TSPOnlineMixin
from .trainer import TSPTrainerMixin


class TSPGRPOTrainer(TSPOnlineMixin, TSPTrainerMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` for a TSP model; see the module docstring.

    Args (besides ``GRPOTrainer``'s, whose ``args`` must be a ``GRPOConfig``): ``tsp`` and
    ``data_parallel`` as for ``TSPTrainer``.
    """

    _trl, _trl_module, _config = GRPOTrainer, grpo_trainer, GRPOConfig

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """The TSP training state, and TRL's adaptive entropy controller's."""
        TSPTrainerMixin._load_optimizer_and_scheduler(self, checkpoint_dir)
        path = os.path.join(checkpoint_dir or "", "entropy_ctrl_state.json")
        if self.use_adaptive_entropy and checkpoint_dir is not None and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.entropy_coef = state["entropy_coef"]
            self._last_world_entropy = state["last_world_entropy"]
