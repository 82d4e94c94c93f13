"""Hugging Face integration: TSP modules replacing the decoder's, ``apply_tsp``, batches.

- ``sharding``: the sharded-module protocol (local slices of full HF tensors, parameter roles)
- ``families``: where each model family keeps its parts (read by apply, inference, FSDP2, loading)
- ``attention``, ``mlp``, ``vocab``, ``replicated``: the TSP modules
- ``apply``: ``apply_tsp`` (module replacement) and ``check_supported``
- ``causal_lm``: the global loss, the vocab-sharded ``forward`` and the input check
- ``batch``: ``shard_batch`` / ``gather_sequence``
- ``cache``, ``inference``, ``generate``: the sharded KV cache, prefill / decode, ``generate``
"""
