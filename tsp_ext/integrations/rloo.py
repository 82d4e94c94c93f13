"""TRL's ``RLOOTrainer`` on a TSP model: REINFORCE leave-one-out with long rollouts.

    trainer = TSPRLOOTrainer(model, reward_funcs=[exact_match], args=RLOOConfig(...),
                             train_dataset=prompts, processing_class=tokenizer, tsp=2)

Everything ``TSPGRPOTrainer`` does (``grpo``: rollouts by the TSP model's ``generate()``, the
same on every rank of a TSP group; scoring through the fused ring; rewards once per group;
TRL's collectives over the dp replicas; the reference folded), with RLOO's own loss: the KL to
the reference subtracted from the reward (``beta``, 0.05 by default: a reference is folded),
the leave-one-out baseline, a sequence-level clipped ratio. TRL's code runs unchanged.
"""

from __future__ import annotations

from trl import RLOOConfig, RLOOTrainer
from trl.trainer import rloo_trainer

from .online import TSPOnlineMixin
from .trainer import TSPTrainerMixin


class TSPRLOOTrainer(TSPOnlineMixin, TSPTrainerMixin, RLOOTrainer):
    """``trl.RLOOTrainer`` for a TSP model; see the module docstring.

    Args (besides ``RLOOTrainer``'s, whose ``args`` must be an ``RLOOConfig``): ``tsp`` and
    ``data_parallel`` as for ``TSPTrainer``.
    """

    _trl, _trl_module, _config = RLOOTrainer, rloo_trainer, RLOOConfig
