"""Integrations with training frameworks, above the ``hf``, ``dp`` and ``checkpoint`` layers.

- ``trainer``: ``TSPTrainer`` / ``TSPTrainerMixin`` (Hugging Face ``Trainer``, TRL's
  ``SFTTrainer``), data parallelism through ``tsp_ext.dp.engines``
- ``dpo``: ``TSPDPOTrainer`` (TRL's ``DPOTrainer``)
"""
