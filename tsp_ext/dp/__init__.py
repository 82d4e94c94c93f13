"""Data parallelism across TSP groups: DDP, DeepSpeed ZeRO and FSDP2 behind one interface
(``engines``), the TSP-aware gradient norm and how each engine stores a rank's parameters
(``storage``).

``tsp_ext.deepspeed`` and ``tsp_ext.fsdp`` are the ``deepspeed`` / ``fsdp`` modules under their
public names.
"""
