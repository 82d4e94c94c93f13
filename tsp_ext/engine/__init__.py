"""The paper's schedules as pure tensor code (imports torch only, never transformers), in
sub-packages by role. Only ``parallel`` and the schedules that call it communicate; ``sharding``
(but ``documents``) and ``kernels`` never do (``tests/test_boundaries.py`` checks it).

- ``sharding``: which tokens and weight rows a rank holds (zigzag layout, balanced splits,
  packed documents)
- ``parallel``: collectives on the TSP axis and their autograd duals, the weight ring, the
  owners' broadcast, checks every rank passes or fails together
- ``kernels``: local maths that never communicates: RMSNorm, RoPE, attention kernels and their
  backends, log-sum-exp merges, the gated delta rule
- ``attention``: the softmax-attention schedule (head-group broadcast + K/V all-gather), its head
  groups, projections, K/V exchange and sliding windows
- ``linear_attention``: the Gated DeltaNet schedule and its chunk-state exchange
- ``feed_forward``: the ring gated MLP and the mixture-of-experts schedules
- ``adapters``: LoRA maths, the schedules' LoRA hooks and the NF4 shard codecs (the schedules
  call these; they hold no schedule logic)
- ``vocab``: embedding row exchange, ring LM head + fused cross-entropy
- ``decode``: the TP decode schedules on the TSP shards (attention, MLP, embedding, logits)
- ``options``: ``EngineOptions``, the options the schedules read (``TSPConfig`` extends it)
"""
