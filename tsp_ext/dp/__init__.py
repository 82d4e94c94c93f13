"""Data parallelism across TSP groups.

- ``engines``: DDP, DeepSpeed ZeRO and FSDP2 behind one interface (``DataParallel``, by name in
  ``ENGINES``), used by the recipes and ``TSPTrainer``
- ``deepspeed``: ``initialize`` with a ``"tsp"`` config block (ZeRO over the dp group only)
- ``fsdp``: ``shard_model``, FSDP2 over the dp axis
- ``storage``: how each engine stores a rank's parameters, and how to reach them
- ``grad_norm``: the TSP-aware gradient norm (every distinct value counted once)
- ``guard``: a ``"tsp"`` block or a TSP model never reaches plain DeepSpeed

``tsp_ext.deepspeed`` and ``tsp_ext.fsdp`` are the ``deepspeed`` / ``fsdp`` modules under their
public names.
"""
