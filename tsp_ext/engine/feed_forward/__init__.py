"""Channel mixers on the TSP axis: the gated MLP and mixtures of experts.

- ``mlp``: ring gated-MLP schedule
- ``moe``: mixture-of-experts layers, experts on the ring or tokens by all-to-all
- ``moe_traffic``: what each MoE schedule moves, the per-call choice (no torch: the planner reads
  it)
- ``moe_clamped``: gpt-oss's biased experts and clamped SwiGLU
"""
