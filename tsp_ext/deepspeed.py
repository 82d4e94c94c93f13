"""Public name of ``tsp_ext.dp.deepspeed`` (the same module object)."""

import sys

from .dp import deepspeed

sys.modules[__name__] = deepspeed
