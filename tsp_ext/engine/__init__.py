"""The paper's schedules as pure tensor code (imports torch only, never transformers).

- ``layout``: zigzag sharding of the sequence (chunks p and 2D-1-p on rank p)
- ``comm``: collectives on the TSP axis, the ring, and their autograd duals
- ``weight_ring``: weight shards circulating the ring, their gradients riding back to the owner
- ``attention_kernels``: fused attention backends (CPU flash, CUDA flash / cuDNN / efficient,
  flash_attn) behind one interface, and the chunked causal attention (one call per chunk, or
  prefix + diagonal LSE-merged)
- ``blockwise_attention``: causal attention by global position, blockwise, with log-sum-exp
- ``attention``: head-group broadcast + K/V all-gather schedule, hand-written backward
- ``mlp``: ring SwiGLU schedule
- ``vocab``: embedding row exchange, ring LM head + fused cross-entropy
- ``pointwise``: RMSNorm and RoPE
- ``masked_attention``: exact attention under a key mask with its lse, LSE merge of partials
- ``options``: ``EngineOptions``, the options the schedules read (``TSPConfig.engine_options()``)
- ``decode``: the TP decode schedules on the TSP shards (attention, MLP, embedding, logits)
"""
