"""Integrations with training frameworks, above the ``hf``, ``dp`` and ``checkpoint`` layers.

- ``trainer``: ``TSPTrainer`` / ``TSPTrainerMixin`` (Hugging Face ``Trainer``, TRL's
  ``SFTTrainer``), data parallelism through ``tsp_ext.dp.engines``
- ``dpo``: ``TSPDPOTrainer`` (TRL's ``DPOTrainer``)
- ``grpo``: ``TSPGRPOTrainer`` (TRL's ``GRPOTrainer``: online RL, rollouts by the TSP model)
- ``rloo``: ``TSPRLOOTrainer`` (TRL's ``RLOOTrainer``), the same rollouts with RLOO's loss
- ``online``: ``TSPOnlineMixin``, what TSP changes in TRL's online trainers (GRPO, RLOO)
- ``reference``: the frozen reference of TRL's trainers, folded like the policy
- ``replicas``: TRL's collectives over the dp replicas, not the D copies of a TSP group's rows
- ``rollouts``: a TSP group's rollouts checked to agree; rewards run once per group
- ``scoring``: per-token log-probabilities of left-padded rollouts through the fused ring
"""
