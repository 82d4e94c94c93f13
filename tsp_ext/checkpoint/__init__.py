"""Checkpoints of TSP models.

- ``save`` / ``load``: training state (model, optimizer, scheduler, extra state) through
  ``torch.distributed.checkpoint``, resumable at any TSP / dp size and with any engine;
  ``inspect`` reads and validates one without a process group.
- ``tsp_ext.save_pretrained`` (``export.py``): a plain Hugging Face checkpoint, streamed.
- ``tsp_ext.load_pretrained`` (``loading.py``): shard-on-read loading of a Hugging Face checkpoint.
- ``state.py``: full tensors under the Hugging Face names (compare, debug).
"""

from .training import PendingSave, inspect, load, save

__all__ = ["PendingSave", "inspect", "load", "save"]
