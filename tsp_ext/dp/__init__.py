"""Data parallelism across TSP groups: TSP-aware gradient norm, DeepSpeed ZeRO and FSDP2.

``tsp_ext.deepspeed`` and ``tsp_ext.fsdp`` are these modules under their public names.
"""
