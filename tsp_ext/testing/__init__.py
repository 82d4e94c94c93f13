"""Tools for tests and benchmarks.

- ``launch``: the one process launcher (gloo / nccl / fake backends, worker pools)
"""
