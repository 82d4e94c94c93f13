"""The paper's schedules as pure tensor code (imports torch only, never transformers).

Layout and communication:

- ``layout``: zigzag sharding of the sequence (chunks p and 2D-1-p on rank p)
- ``partition``: balanced contiguous splits of heads, MLP rows and vocabulary rows over D ranks
- ``documents``: packed documents, a rank's query spans cut where documents start
- ``comm``: collectives on the TSP axis, the ring, and their autograd duals
- ``weight_ring``: weight shards circulating the ring, their gradients riding back to the owner;
  the owners' broadcast of theirs in turn (``broadcast_stream``)
- ``agreement``: every rank of a group passes or fails a check together
- ``options``: ``EngineOptions``, the options the schedules read (``TSPConfig`` extends it)

Attention:

- ``attention``: head-group broadcast + K/V all-gather schedule, hand-written backward
- ``head_groups``: one attention call's head groups (shards streamed, projected, K/V in flight)
- ``group_attention``: a head group's attention kernels over its head buckets, forward and backward
- ``heads``: which query and KV heads each group holds (``AttentionSpec``)
- ``qkv``: one head group's Q/K/V projection, q/k norms, RoPE and their adjoint
- ``qk_rms``: full-width q/k RMS norms (OLMo-2) across the head groups
- ``kv_exchange``: a head group's K/V all-gather, its dK/dV reduce-scatter, shared KV heads' sums
- ``key_stream``: a head bucket's K/V broadcast a zigzag chunk at a time, dK/dV reduced to owners
- ``window``: sliding-window K/V exchange (only the keys a rank's queries see)
- ``attention_backends``: fused attention kernels (CPU flash, CUDA flash / cuDNN / efficient,
  flash_attn, blockwise) behind one interface, and ``select_backend``
- ``chunked_attention``: causal attention of local query chunks on any backend
- ``blockwise_attention``: causal attention by global position, blockwise, with log-sum-exp
- ``masked_attention``: exact attention under a key mask with its lse
- ``lse``: the softmax statistics' dtype and the log-sum-exp merge of partial attentions

Linear attention (Gated DeltaNet):

- ``gated_delta``: the gated delta rule, chunked (WY) and recurrent kernels, with resets
- ``linear_attention``: head-group schedule of one layer (``LinearAttentionSpec``), conv, norm
- ``state_exchange``: the chunk transitions' all-gather and composition, the conv halo

MLP, experts, vocabulary, decode:

- ``mlp``: ring gated-MLP schedule
- ``moe``: mixture-of-experts layers, experts on the ring or tokens by all-to-all
  (``moe_traffic``: what each moves, the per-call choice; no torch; ``moe_clamped``: gpt-oss's
  biased experts and clamped SwiGLU)
- ``vocab``: embedding row exchange, ring LM head + fused cross-entropy
- ``pointwise``: RMSNorm, RoPE, gate activations, GEMM helpers
- ``decode``: the TP decode schedules on the TSP shards (attention, MLP, embedding, logits)

Adapters and quantized shards (the schedules call these; they hold no schedule logic):

- ``lora``: LoRA maths under TSP (plan, seeded dropout, input projection and its adjoint)
- ``adapters``: the attention schedule's and the MLP ring's LoRA hooks
- ``nf4``: 4-bit NormalFloat packing and the codecs of shards that travel packed
"""
