"""Local maths of the schedules: no module here communicates (``tests/test_boundaries.py``).

- ``pointwise``: RMSNorm, RoPE, gate activations, GEMM helpers
- ``lse``: the softmax statistics' dtype and the log-sum-exp merge of partial attentions, sinks
- ``backends``: fused attention kernels (CPU flash, CUDA flash / cuDNN / efficient, flash_attn,
  blockwise) behind one interface, and ``select_backend``
- ``chunked``: causal attention of local query chunks on any backend
- ``blockwise``: causal attention by global position, blockwise, with log-sum-exp
- ``masked``: exact attention under a key mask with its lse
- ``gated_delta``: the gated delta rule, chunked (WY) and recurrent kernels, with resets
"""
