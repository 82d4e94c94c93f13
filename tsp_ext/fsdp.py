"""Public name of ``tsp_ext.dp.fsdp`` (the same module object)."""

import sys

from .dp import fsdp

sys.modules[__name__] = fsdp
