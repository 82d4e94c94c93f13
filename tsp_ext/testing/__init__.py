"""Tools for tests and benchmarks: the one process launcher (gloo / nccl / fake backends)."""
