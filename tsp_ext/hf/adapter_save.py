"""Write the LoRA adapter of a TSP PEFT model in PEFT's own format, from the shards.

Only the adapter is gathered (each tensor on its own, to the writing rank: ``r x (in + out)``
values per projection), never the base model. The folder (``adapter_config.json`` +
``adapter_model.safetensors``) loads with ``PeftModel.from_pretrained(base, path)`` in one plain
process. It is written beside ``path`` and renamed into place, as ``save_pretrained`` does.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from torch import nn

from ..writer import WRITER, on_writer, replace_dir
from .full_state import full_tensor, require_tsp
from .lora import ADAPTER_MARK


def adapter_names(model: nn.Module) -> list[str]:
    """Names of a PEFT model's adapter parameters."""
    return [n for n, _ in model.named_parameters() if ADAPTER_MARK in n]


def save_adapter(model: nn.Module, path: str | os.PathLike, tokenizer=None) -> None:
    """Write the adapter of ``model`` (a TSP ``peft.PeftModel``) to ``path`` as PEFT's
    ``save_pretrained`` would in one process (collective: every rank). A failure is raised on
    every rank and leaves any previous folder at ``path`` intact."""
    from peft import PeftModel

    require_tsp(model)
    path = os.fspath(path)
    params = dict(model.named_parameters())
    state = {}
    for name in adapter_names(model):  # every rank takes part in each gather
        full = full_tensor(model, name, params[name], dst=WRITER)
        if full is not None:
            state[name] = full

    def write() -> None:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
        try:
            PeftModel.save_pretrained(model, tmp, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    on_writer(write, f"save_adapter({path!r})")
