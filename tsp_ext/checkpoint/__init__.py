"""Checkpoints of TSP models.

- ``training``: ``save`` / ``load`` of training state (model, optimizer, scheduler, extra state)
  through ``torch.distributed.checkpoint``, resumable at any TSP / dp size and with any engine;
  ``inspect`` reads and validates one without a process group
- ``export``: ``tsp_ext.save_pretrained``, a plain Hugging Face checkpoint, streamed
- ``weight_sync``: ``tsp_ext.stream_weights`` / ``iter_weights`` / ``weight_metadata``, the full
  weights one tensor at a time under Hugging Face's names (an external generator such as vLLM;
  the stream ``save_pretrained`` writes)
- ``adapter``: a TSP PEFT model's LoRA adapter in PEFT's own format, from the shards
- ``loading``: ``tsp_ext.load_pretrained``, shard-on-read loading of a Hugging Face checkpoint
- ``layout``: this rank's pieces of every full tensor, with their global offsets
- ``sources``: where each data-parallel engine keeps a rank's model and optimizer state
- ``state``: full tensors under the Hugging Face names (compare, debug)
- ``rng``: each rank's random generator states as tensors
- ``writer``: the one rank that writes shared files, and how its failure reaches every rank
"""

from .training import PendingSave, inspect, load, save

__all__ = ["PendingSave", "inspect", "load", "save"]
