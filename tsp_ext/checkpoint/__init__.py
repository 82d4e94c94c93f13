"""Checkpoints of TSP models: full tensors, shard-on-read loading, HF export, training state."""
