"""Each rank's torch random generator states, as plain uint8 tensors for DCP (nothing pickled).

Keys ``rng.<rank>.cpu`` (``torch.get_rng_state()``, ``[5056]`` uint8) and, when CUDA is
initialised, ``rng.<rank>.cuda`` (the current device's generator). Each rank writes and reads
only its own keys, so they are restored only on the same number of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_GET = {"cpu": torch.get_rng_state, "cuda": lambda: torch.cuda.get_rng_state()}
_SET = {"cpu": torch.set_rng_state, "cuda": lambda t: torch.cuda.set_rng_state(t)}


def rng_kinds() -> list[str]:
    """The generators this process uses: ``["cpu"]``, plus ``"cuda"`` once CUDA is initialised."""
    return ["cpu", "cuda"] if torch.cuda.is_available() and torch.cuda.is_initialized() else ["cpu"]


def _key(kind: str) -> str:
    return f"rng.{dist.get_rank()}.{kind}"


def rng_state(kinds: list[str]) -> dict[str, torch.Tensor]:
    """This rank's generator states (copies) under its own keys."""
    return {_key(kind): _GET[kind]() for kind in kinds}


def rng_targets(kinds: list[str]) -> dict[str, torch.Tensor]:
    """Buffers to load this rank's saved generator states into."""
    return {_key(kind): torch.empty_like(_GET[kind]()) for kind in kinds}


def set_rng_state(loaded: dict[str, torch.Tensor]) -> None:
    """Restore the generators from ``rng_targets`` buffers filled by a load."""
    for key, value in loaded.items():
        _SET[key.rsplit(".", 1)[1]](value)
