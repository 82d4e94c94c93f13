"""Which tokens and weight rows each rank of the TSP axis holds. ``layout`` and ``partition``
never communicate; ``documents`` agrees the documents' boundaries over the axis.

- ``layout``: zigzag sharding of the sequence (chunks p and 2D-1-p on rank p)
- ``partition``: balanced contiguous splits of heads, MLP rows and vocabulary rows over D ranks
- ``documents``: packed documents, a rank's query spans cut where documents start
"""
