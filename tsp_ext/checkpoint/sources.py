"""Where each engine keeps a TSP rank's model and optimizer state, one parameter at a time.

``local_state(model, optimizer, engine)`` yields ``(name, key, tensor, param)``: ``key`` is
``"param"``, a per-parameter optimizer tensor (``"exp_avg"``, ...) laid out like the parameter,
or ``"step"`` (a scalar). ``tensor`` is this rank's piece: the live tensor of a plain or FSDP2
model (DTensor chunks included), or for a DeepSpeed engine the fp32 master / optimizer state of
this TSP rank's shard, assembled over dp by ``deepspeed.utils.safe_get_full_*`` (ZeRO-1/2/3).
``restore`` writes such pieces back, again one parameter at a time. Both take the parameter
``names`` to visit (a checkpoint is written and read a group of parameters at a time).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from torch import nn

from ..dp.storage import local_tensor, tsp_shape
from .state import reshard_fsdp

PARAM = "param"
STEP = "step"


def _ds_base_state(engine) -> dict:
    """One entry of the wrapped torch optimizer's state (all share keys and step)."""
    state = engine.optimizer.optimizer.state
    if not state:
        raise ValueError("the DeepSpeed optimizer has no state yet (it creates it at init)")
    return next(iter(state.values()))


def prepare_restore(engine, keys: set[str]) -> None:
    """DeepSpeed, before ``restore``: give the wrapped torch optimizer zero state for the
    optimizer ``keys`` of the checkpoint on each flat fp32 partition, as its first step would (it
    creates it lazily), and link it to the parameters' ``safe_*`` fragments."""
    opt = engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    if flats is None:
        flats = opt.fp32_partitioned_groups_flat  # ZeRO-3
    for flat in flats:
        state = opt.optimizer.state[flat]
        for key in keys - set(state):
            state[key] = torch.zeros(()) if key == STEP else torch.zeros_like(flat)
    _link_fragments(opt)


def _link_fragments(opt) -> None:
    """(Re)link ZeRO-1/2's per-parameter views of the optimizer state. DeepSpeed links them once,
    right after stepping its first parameter group: the views of later groups (e.g. Trainer's
    no-weight-decay group) would stay empty."""
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _named(model: nn.Module, names: Collection[str]) -> Iterator[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if n in names)


def local_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, names: Collection[str], engine=None
) -> Iterator[tuple[str, str, torch.Tensor, nn.Parameter]]:
    """This rank's pieces of the training state of parameters ``names``; see the module
    docstring (collective for DeepSpeed: every rank must consume the iterator)."""
    reshard_fsdp(model)
    if engine is not None:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        base = _ds_base_state(engine)
        _link_fragments(engine.optimizer)
        keys = [k for k, v in base.items() if torch.is_tensor(v) and v.dim() > 0]
        for name, p in _named(model, names):
            yield name, PARAM, safe_get_full_fp32_param(p).view(tsp_shape(p)), p
            for key in keys:
                yield name, key, safe_get_full_optimizer_state(p, key).view(tsp_shape(p)), p
            if STEP in base:
                yield name, STEP, torch.as_tensor(base[STEP]).detach().clone(), p
        return
    for name, p in _named(model, names):
        yield name, PARAM, local_tensor(p.detach()), p
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                yield name, key, local_tensor(value.detach()), p
            elif key == STEP:
                yield name, key, torch.as_tensor(value).detach().clone(), p


def targets(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    keys: dict[str, list[str]],
    names: Collection[str],
    engine=None,
) -> Iterator[tuple[str, str, torch.Tensor, nn.Parameter]]:
    """Tensors to load parameters ``names`` into, like ``local_state``: for a plain / FSDP2 model
    the live parameters and optimizer tensors themselves (created, zero, where the optimizer has
    none yet); for DeepSpeed fresh fp32 buffers of this TSP rank's shape, handed to ``restore``
    after loading. ``keys``: per parameter name, the optimizer keys the checkpoint holds."""
    reshard_fsdp(model)
    for name, p in _named(model, names):
        if engine is not None:
            yield name, PARAM, torch.empty(tsp_shape(p), dtype=torch.float32), p
            for key in keys.get(name, []):
                shape = () if key == STEP else tsp_shape(p)
                yield name, key, torch.empty(shape, dtype=torch.float32), p
            continue
        yield name, PARAM, local_tensor(p.detach()), p
        state = optimizer.state[p]  # a defaultdict: created if the optimizer never stepped
        for key in keys.get(name, []):
            if key not in state:
                state[key] = (
                    torch.zeros((), dtype=torch.float32)
                    if key == STEP
                    else torch.zeros_like(p, memory_format=torch.preserve_format).detach()
                )
            value = state[key]
            yield name, key, local_tensor(value) if value.dim() else value, p


def restore(engine, pieces: list[tuple[str, str, torch.Tensor, nn.Parameter]]) -> None:
    """DeepSpeed: set the fp32 master and optimizer state of each parameter from loaded
    ``targets`` buffers (one group of parameters; the optimizer step is set by the group that
    holds it). Call ``finish_restore`` after the last group."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    for _, key, value, p in pieces:
        if key == PARAM:
            safe_set_full_fp32_param(p, value)
        elif key == STEP:
            for st in engine.optimizer.optimizer.state.values():
                if torch.is_tensor(st.get(STEP)):
                    st[STEP].copy_(value)
                else:
                    st[STEP] = value.item()
        else:
            safe_set_full_optimizer_state(p, value, key)


def finish_restore(engine) -> None:
    """DeepSpeed: refresh the (low-precision) model weights from the restored fp32 masters."""
    opt = engine.optimizer
    if hasattr(opt, "update_lp_params"):  # ZeRO-1/2: fp32 partitions -> model weights
        opt.update_lp_params()
    else:  # ZeRO-3: the model's partitions are views of fp16_partitioned_groups_flat
        for lp, hp in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
            lp.data.copy_(hp.data)
