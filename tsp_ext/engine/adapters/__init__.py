"""Adapters and quantized shards: the schedules call these; they hold no schedule logic.

- ``lora``: LoRA maths under TSP (plan, seeded dropout, input projection and its adjoint)
- ``hooks``: the attention schedule's and the MLP ring's LoRA hooks
- ``nf4``: 4-bit NormalFloat packing and the codecs of shards that travel packed
"""
