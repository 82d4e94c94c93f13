"""Softmax attention on the TSP axis: head-group weights by broadcast, K/V by all-gather.

- ``schedule``: the head-group schedule (``tsp_attention``), hand-written backward
- ``heads``: which query and KV heads each group holds (``AttentionSpec``) and the names and
  kinds of a group's shards (``SHARDS``; no torch: the planner reads it)
- ``head_groups``: one attention call's inputs (``AttentionInputs``) and head groups (shards
  streamed, projected, K/V in flight)
- ``attend``: a head group's attention kernels over its head buckets, forward and backward
- ``qkv``: one head group's Q/K/V projection, q/k norms, RoPE and their adjoint
- ``qk_rms``: full-width q/k RMS norms (OLMo-2) across the head groups
- ``kv_exchange``: a head group's K/V all-gather, its dK/dV reduce-scatter, shared KV heads' sums
- ``key_stream``: a head bucket's K/V broadcast a zigzag chunk at a time, dK/dV reduced to owners
- ``window``: sliding-window K/V exchange (only the keys a rank's queries see)
"""
