"""A ``"tsp"`` block or a TSP model never reaches DeepSpeed unapplied.

DeepSpeed accepts unknown config keys silently, so a ``"tsp"`` block given to plain
``deepspeed.initialize`` (what HF Trainer ``--deepspeed ds.json`` and Accelerate's DeepSpeed
plugin call) would train an ordinary, un-sharded model. Once ``tsp_ext`` is imported,
``deepspeed.initialize`` is wrapped by a check that refuses, before any work:

- a config with a ``"tsp"`` block that did not come through ``tsp_ext.deepspeed.initialize``;
- a TSP model without tsp_ext's ``mpu`` (ZeRO would partition and average across the TSP axis).

The wrapper is installed when ``deepspeed`` is imported (at once if it already is). Torch-free:
importing ``tsp_ext`` imports neither torch nor deepspeed.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import json
import os
import sys
from typing import Any

HOW = (
    "call tsp_ext.deepspeed.initialize instead of deepspeed.initialize (same arguments), or "
    "run recipes/finetune_long_llama.py --data-parallel deepspeed; "
    "see docs/deepspeed.md"
)


def check_initialize(kwargs: dict[str, Any]) -> None:
    """Raise if a ``deepspeed.initialize`` call would ignore TSP (see the module docstring)."""
    from .deepspeed import TSPModelParallelUnit

    if isinstance(kwargs.get("mpu"), TSPModelParallelUnit):
        return
    config = _config(kwargs)
    if isinstance(config, dict) and "tsp" in config:
        raise ValueError(
            f'deepspeed.initialize got a DeepSpeed config with a "tsp" block ({config["tsp"]}), '
            "which plain DeepSpeed ignores: the model would train un-sharded. " + HOW
        )
    if getattr(kwargs.get("model"), "tsp", None) is not None:
        raise ValueError(
            "deepspeed.initialize got a TSP model without tsp_ext's data-parallel groups: ZeRO "
            "would partition and average across the TSP ranks. " + HOW
        )


def accelerate_deepspeed_config() -> str | None:
    """The DeepSpeed config file ``accelerate launch`` was given (its config's
    ``deepspeed_config_file``; ``""`` for a DeepSpeed plugin without one), or None. Accelerate
    hands it to plain ``deepspeed.initialize`` on a GPU and drops it on CPU, so the entry points
    that drive DeepSpeed themselves read it, and the others refuse it."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    return os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")


def _config(kwargs: dict[str, Any]) -> Any:
    """The config as ``deepspeed.initialize`` picks it: ``config``, ``config_params`` or
    ``args.deepspeed_config``; a JSON path is read, anything else returned as given."""
    config = kwargs.get("config")
    if config is None:
        config = kwargs.get("config_params")
    if config is None:
        config = getattr(kwargs.get("args"), "deepspeed_config", None)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            return json.load(f)
    return config


def _wrap(module) -> None:
    """Replace ``module.initialize`` by the checked one (once)."""
    original = module.initialize
    if getattr(original, "__tsp_checked__", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        check_initialize(signature.bind_partial(*args, **kwargs).arguments)
        return original(*args, **kwargs)

    initialize.__tsp_checked__ = True
    module.initialize = initialize


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps ``deepspeed.initialize`` right after ``deepspeed`` is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                _wrap_after_exec(spec.loader)
                return spec
        return None


def _wrap_after_exec(loader) -> None:
    exec_module = loader.exec_module

    def exec_and_wrap(module):
        exec_module(module)
        _wrap(module)

    loader.exec_module = exec_and_wrap


def install() -> None:
    """Check every later ``deepspeed.initialize`` call; idempotent."""
    if "deepspeed" in sys.modules:
        _wrap(sys.modules["deepspeed"])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
