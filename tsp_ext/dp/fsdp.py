"""FSDP2 data parallelism across TSP groups on a (dp, tsp) mesh.

    mesh = init_tsp_mesh(tsp_size=4)
    model = tsp_ext.fsdp.shard_model(model, mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    ...
    loss.backward()
    tsp_ext.fsdp.clip_grad_norm_(model, 1.0)
    optimizer.step()

FSDP2 shards every parameter over ``mesh["dp"]`` only; TSP keeps its own layout on ``mesh["tsp"]``.
Passing the 2-D mesh to ``fully_shard`` would make it HSDP over both axes, mixing TSP shards.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ..hf.apply import apply_tsp
from ..hf.lora import peft_base
from .grad_norm import clip_grad_norm_


def shard_model(model: nn.Module, mesh: DeviceMesh, **fully_shard_kwargs) -> nn.Module:
    """``fully_shard`` each decoder layer and the root over ``mesh["dp"]``; returns the model.

    Applies TSP first if the model is not a TSP model yet. ``fully_shard_kwargs`` go to every
    ``fully_shard`` call (``mp_policy``, ``reshard_after_forward``, ``offload_policy``, ...).
    """
    if "mesh" in fully_shard_kwargs:
        raise ValueError(
            "pass the (dp, tsp) mesh as `mesh`; FSDP2 is applied on its 'dp' axis only"
        )
    if mesh.mesh_dim_names != ("dp", "tsp"):
        raise ValueError(
            f"shard_model needs a ('dp', 'tsp') mesh (init_tsp_mesh), got {mesh.mesh_dim_names}"
        )
    if getattr(model, "tsp", None) is None:
        apply_tsp(model, mesh)
    hf = peft_base(model) or model  # a PEFT model: its Hugging Face model is the FSDP root
    for layer in hf.tsp.family.layers_of(hf):
        fully_shard(layer, mesh=mesh["dp"], **fully_shard_kwargs)
    fully_shard(hf, mesh=mesh["dp"], **fully_shard_kwargs)
    return model


__all__ = ["clip_grad_norm_", "shard_model"]
