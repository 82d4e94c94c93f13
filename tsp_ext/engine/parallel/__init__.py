"""Communication on the TSP axis, below every schedule.

- ``comm``: collectives on the TSP axis, the ring, and their autograd duals
- ``weight_ring``: weight shards circulating the ring, their gradients riding back to the owner;
  the owners' broadcast of theirs in turn (``broadcast_stream``)
- ``agreement``: every rank of a group passes or fails a check together
"""
