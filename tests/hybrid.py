"""Float64 twins of Hugging Face's Qwen3-Next Gated DeltaNet, whose kernels, gated norm and gate
``g`` compute in float32 even in a float64 model: the same source with float32 replaced by
float64, the reference of the float64 parity tests (``test_gated_delta``, ``test_qwen3_next``)."""

from __future__ import annotations

import functools
import inspect
import textwrap
import types

import transformers.models.qwen3_next.modeling_qwen3_next as mq
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
def twins() -> dict:
    ns = dict(vars(mq))
    for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        exec_twin(inspect.getsource(getattr(mq, n)), ns, n)
    out = {n: ns[n] for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}
    out["norm"] = exec_twin(inspect.getsource(mq.Qwen3NextRMSNormGated.forward), ns, "forward")
    out["layer"] = exec_twin(inspect.getsource(mq.Qwen3NextGatedDeltaNet.forward), ns, "forward")
    return out


def float64_twin(module: nn.Module) -> nn.Module:
    """``module`` (a ``Qwen3NextGatedDeltaNet``) computing in float64: its forward, its gated
    norm's and its kernels are the twins (in place; returns it)."""
    module.forward = types.MethodType(twins()["layer"], module)
    module.norm.forward = types.MethodType(twins()["norm"], module.norm)
    return module
