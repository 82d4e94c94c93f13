"""The paper's schedules as pure tensor code (imports torch only, never transformers).

- ``layout``: zigzag sharding of the sequence (chunks p and 2D-1-p on rank p)
- ``comm``: collectives on the TSP axis, the ring, and their autograd duals
- ``weight_ring``: weight shards circulating the ring, their gradients riding back to the owner;
  the owners' broadcast of theirs in turn (``broadcast_stream``)
- ``attention_backends``: fused attention kernels (CPU flash, CUDA flash / cuDNN / efficient,
  flash_attn, blockwise) behind one interface, and ``select_backend``
- ``chunked_attention``: causal attention of local query chunks on any backend (one call per
  chunk, or prefix + diagonal LSE-merged)
- ``lse``: the softmax statistics' dtype and the log-sum-exp merge of partial attentions
- ``blockwise_attention``: causal attention by global position, blockwise, with log-sum-exp
- ``attention``: head-group broadcast + K/V all-gather schedule, hand-written backward
- ``head_groups``: one attention call's head groups (their shards streamed by
  ``weight_ring.broadcast_stream``, each projected, its K/V exchanged), shared with ``qk_rms``
- ``kv_exchange``: a head group's K/V all-gather (or window exchange), its dK/dV dual, and the
  sum of a shared KV head's gradient over its users
- ``mlp``: ring SwiGLU schedule
- ``moe``: mixture-of-experts layers, experts on the ring or tokens by all-to-all
  (``moe_traffic``: what each moves, the per-call choice; no torch)
- ``vocab``: embedding row exchange, ring LM head + fused cross-entropy
- ``pointwise``: RMSNorm and RoPE
- ``masked_attention``: exact attention under a key mask with its lse
- ``options``: ``EngineOptions``, the options the schedules read (``TSPConfig.engine_options()``)
- ``decode``: the TP decode schedules on the TSP shards (attention, MLP, embedding, logits)
"""
