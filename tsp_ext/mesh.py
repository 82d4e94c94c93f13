"""The (dp, tsp) device mesh: TSP inside a group of contiguous ranks, data parallel across."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def init_tsp_mesh(
    tsp_size: int, *, backend: str | None = None, timeout: timedelta | float | None = None
) -> DeviceMesh:
    """Build the 2-D mesh ``("dp", "tsp")`` with ``dp = world // tsp_size``.

    Initialises the default process group from the launcher's environment (torchrun,
    ``accelerate launch``, deepspeed) if it is not initialised yet: NCCL when CUDA is available,
    gloo otherwise. TSP ranks are contiguous (rank = dp_index * tsp_size + tsp_index), so a TSP
    group sits inside one node when ``tsp_size`` divides the GPUs per node.

    ``timeout`` (a ``timedelta`` or seconds) bounds how long a collective of the mesh's groups
    (and of the default group, when this call creates it) waits for a peer that stopped or hung
    before it raises on the ranks still running. None keeps PyTorch's defaults: 30 minutes for
    gloo, 10 for NCCL (the mesh's groups do not inherit the default group's timeout, so pass it
    here too when the launcher set one).
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    if timeout is not None and timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    world = dist.get_world_size()
    if tsp_size < 1 or world % tsp_size:
        raise ValueError(
            f"tsp_size={tsp_size} does not divide the world size {world}: choose a TSP size that "
            f"divides the number of processes (e.g. {', '.join(map(str, _divisors(world)))})"
        )
    backend = dist.get_backend()
    override = None
    if timeout is not None:
        options = _group_options(backend, timeout)
        override = {"dp": options, "tsp": options}
    return init_device_mesh(
        "cuda" if backend == "nccl" else "cpu",
        (world // tsp_size, tsp_size),
        mesh_dim_names=("dp", "tsp"),
        backend_override=override,
    )


def _group_options(backend: str, timeout: timedelta) -> C10dBackend.Options:
    """Process-group options carrying ``timeout`` (``init_device_mesh`` reads it from them)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return C10dBackend.Options(backend, timeout)


def tsp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The TSP process group of this rank (mesh dim ``"tsp"``)."""
    return tsp_submesh(mesh).get_group()


def tsp_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D ``"tsp"`` sub-mesh (the mesh itself if it is 1-D)."""
    if mesh.mesh_dim_names is None or "tsp" not in mesh.mesh_dim_names:
        raise ValueError(
            f"the mesh needs a dimension named 'tsp' (got {mesh.mesh_dim_names}); build it with "
            "tsp_ext.init_tsp_mesh"
        )
    return mesh if mesh.ndim == 1 else mesh["tsp"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
