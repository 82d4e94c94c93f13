"""Float64 twins of Hugging Face's Gated DeltaNets (Qwen3-Next's, Qwen3.5's), whose kernels, gated
norm and gate ``g`` compute in float32 even in a float64 model: the same source with float32
replaced by float64, the reference of the float64 parity tests (``test_gated_delta``,
``test_qwen3_next``)."""

from __future__ import annotations

import functools
import inspect
import sys
import textwrap
import types

from torch import nn


def exec_twin(src: str, ns: dict, name: str):
    """Define ``name`` from its source with float32 replaced by float64 (decorators dropped)."""
    src = textwrap.dedent(src)
    lines = src.split("\n")
    while lines[0].lstrip().startswith("@"):
        lines.pop(0)
    exec("\n".join(lines).replace("torch.float32", "torch.float64").replace(".float()", ""), ns)
    return ns[name]


@functools.cache
def twins(cls: type) -> dict:
    """The twins of Gated DeltaNet class ``cls``'s forward, its gated norm's and its kernels,
    defined in its modeling module's namespace."""
    mod = sys.modules[cls.__module__]
    ns = dict(vars(mod))
    kernels = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    for n in kernels:
        exec_twin(inspect.getsource(getattr(mod, n)), ns, n)
    out = {n: ns[n] for n in kernels}
    norm = next(v for k, v in vars(mod).items() if k.endswith("RMSNormGated"))
    out["norm"] = exec_twin(inspect.getsource(norm.forward), ns, "forward")
    out["layer"] = exec_twin(inspect.getsource(cls.forward), ns, "forward")
    return out


def float64_twin(module: nn.Module) -> nn.Module:
    """``module`` (a ``Qwen3NextGatedDeltaNet`` or ``Qwen3_5GatedDeltaNet``) computing in
    float64: its forward, its gated norm's and its kernels are the twins (in place; returns
    it)."""
    found = twins(type(module))
    module.forward = types.MethodType(found["layer"], module)
    module.norm.forward = types.MethodType(found["norm"], module.norm)
    return module
