"""Linear attention (Gated DeltaNet) on the TSP axis: head groups folded, tokens sharded.

- ``schedule``: head-group schedule of one layer (``LinearAttentionSpec``), conv, norm
- ``state_exchange``: the chunk transitions' all-gather and composition, the conv halo
"""
