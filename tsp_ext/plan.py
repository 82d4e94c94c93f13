"""Stable alias of ``tsp_ext.planner``, the torch-free layout planner: the same public names."""

from .planner import *  # noqa: F403
from .planner import __all__  # noqa: F401
