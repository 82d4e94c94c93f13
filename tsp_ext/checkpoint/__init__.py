"""Checkpoints of TSP models (where each engine keeps the state: ``dp.training_state``).

- ``training``: ``save`` / ``load`` of training state (model, optimizer, scheduler, extra state)
  through ``torch.distributed.checkpoint``, resumable at any TSP / dp size and with any engine;
  ``inspect`` reads and validates one without a process group
- ``export``: ``tsp_ext.save_pretrained``, a plain Hugging Face checkpoint, streamed
- ``weight_sync``: ``tsp_ext.stream_weights`` / ``iter_weights`` / ``weight_metadata``, the full
  weights one tensor at a time under Hugging Face's names (an external generator such as vLLM;
  the stream ``save_pretrained`` writes)
- ``loading``: ``tsp_ext.load_pretrained``, shard-on-read loading of a Hugging Face checkpoint
- ``layout``: this rank's pieces of every full tensor, with their global offsets
- ``rng``: each rank's random generator states as tensors
"""

from .training import PendingSave, inspect, load, save

__all__ = ["PendingSave", "inspect", "load", "save"]
