"""Data parallelism across TSP groups.

- ``engines``: DDP, DeepSpeed ZeRO and FSDP2 behind one interface (``DataParallel``, by name in
  ``ENGINES``), used by the recipes and ``TSPTrainer``
- ``deepspeed``: ``initialize`` with a ``"tsp"`` config block (ZeRO over the dp group only)
- ``fsdp``: ``shard_model``, FSDP2 over the dp axis
- ``training_state``: where each engine keeps a rank's model and optimizer state (checkpoints
  read and write it through ``training_state``; how it stores parameters: ``tsp_ext.storage``)
- ``grad_norm``: the TSP-aware gradient norm (every distinct value counted once)
- ``guard``: a ``"tsp"`` block or a TSP model never reaches plain DeepSpeed

``tsp_ext.deepspeed`` and ``tsp_ext.fsdp`` are the ``deepspeed`` / ``fsdp`` modules under their
public names.
"""
