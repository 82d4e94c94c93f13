"""Where each engine keeps a TSP rank's model and optimizer state, one parameter at a time.

``training_state(model, optimizer, engine)`` is the one place that tells engines apart:
``TrainingState`` reads the live tensors of a plain or FSDP2 model and its torch optimizer
(DTensor chunks included); ``DeepSpeedState`` the fp32 master / optimizer state of this TSP
rank's shard, assembled over dp by DeepSpeed's ``safe_get_full_*`` (ZeRO-1/2/3).

``local`` yields ``(name, key, tensor, param)``: ``key`` is ``"param"``, a per-parameter
optimizer tensor (``"exp_avg"``, ...) laid out like the parameter, or ``"step"`` (a scalar);
``targets`` yields the tensors to load such pieces into, and ``restore`` writes them back. All
take the parameter ``names`` to visit (a checkpoint is written and read a group of parameters at
a time).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from torch import nn

from ..storage import local_tensor, reshard_fsdp, tsp_shape

PARAM = "param"
STEP = "step"

Piece = tuple[str, str, torch.Tensor, nn.Parameter]


class TrainingState:
    """A plain or FSDP2 model's state: its live parameters and its torch optimizer's tensors."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer  # the one whose ``param_groups`` a checkpoint keeps

    def _named(self, names: Collection[str]) -> Iterator[tuple[str, nn.Parameter]]:
        reshard_fsdp(self.model)
        return ((n, p) for n, p in self.model.named_parameters() if n in names)

    def local(self, names: Collection[str]) -> Iterator[Piece]:
        """This rank's pieces of the training state of parameters ``names`` (collective for
        DeepSpeed: every rank must consume the iterator)."""
        for name, p in self._named(names):
            yield name, PARAM, local_tensor(p.detach()), p
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    yield name, key, local_tensor(value.detach()), p
                elif key == STEP:
                    yield name, key, torch.as_tensor(value).detach().clone(), p

    def targets(self, keys: dict[str, list[str]], names: Collection[str]) -> Iterator[Piece]:
        """Tensors to load parameters ``names`` into, like ``local``: the live parameters and
        optimizer tensors themselves (created, zero, where the optimizer has none yet).
        ``keys``: per parameter name, the optimizer keys the checkpoint holds."""
        for name, p in self._named(names):
            yield name, PARAM, local_tensor(p.detach()), p
            state = self.optimizer.state[p]  # a defaultdict: created if it never stepped
            for key in keys.get(name, []):
                if key not in state:
                    state[key] = (
                        torch.zeros((), dtype=torch.float32)
                        if key == STEP
                        else torch.zeros_like(p, memory_format=torch.preserve_format).detach()
                    )
                value = state[key]
                yield name, key, local_tensor(value) if value.dim() else value, p

    def prepare_restore(self, keys: set[str]) -> None:
        """Before the first ``restore``: nothing to prepare (targets are the live tensors)."""

    def restore(self, pieces: list[Piece]) -> None:
        """After loading into ``targets``: nothing to write back (they were loaded in place)."""

    def finish_restore(self) -> None:
        """After the last group: nothing to refresh."""


class DeepSpeedState(TrainingState):
    """A DeepSpeed engine's state: fp32 masters and optimizer state of this TSP rank's shards."""

    def __init__(self, model: nn.Module, engine) -> None:
        super().__init__(model, engine.optimizer)
        self.engine = engine

    def _base_state(self) -> dict:
        """One entry of the wrapped torch optimizer's state (all share keys and step)."""
        state = self.engine.optimizer.optimizer.state
        if not state:
            raise ValueError("the DeepSpeed optimizer has no state yet (it creates it at init)")
        return next(iter(state.values()))

    def _link_fragments(self) -> None:
        """(Re)link ZeRO-1/2's per-parameter views of the optimizer state. DeepSpeed links them
        once, right after stepping its first parameter group: the views of later groups (e.g.
        Trainer's no-weight-decay group) would stay empty."""
        opt = self.engine.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def local(self, names: Collection[str]) -> Iterator[Piece]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        base = self._base_state()
        self._link_fragments()
        keys = [k for k, v in base.items() if torch.is_tensor(v) and v.dim() > 0]
        for name, p in self._named(names):
            yield name, PARAM, safe_get_full_fp32_param(p).view(tsp_shape(p)), p
            for key in keys:
                yield name, key, safe_get_full_optimizer_state(p, key).view(tsp_shape(p)), p
            if STEP in base:
                yield name, STEP, torch.as_tensor(base[STEP]).detach().clone(), p

    def targets(self, keys: dict[str, list[str]], names: Collection[str]) -> Iterator[Piece]:
        """Fresh fp32 buffers of this TSP rank's shapes, handed to ``restore`` after loading."""
        for name, p in self._named(names):
            yield name, PARAM, torch.empty(tsp_shape(p), dtype=torch.float32), p
            for key in keys.get(name, []):
                shape = () if key == STEP else tsp_shape(p)
                yield name, key, torch.empty(shape, dtype=torch.float32), p

    def prepare_restore(self, keys: set[str]) -> None:
        """Give the wrapped torch optimizer zero state for the optimizer ``keys`` of the
        checkpoint on each flat fp32 partition, as its first step would (it creates it lazily),
        and link it to the parameters' ``safe_*`` fragments."""
        opt = self.engine.optimizer
        flats = getattr(opt, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
        if flats is None:
            flats = opt.fp32_partitioned_groups_flat  # ZeRO-3
        for flat in flats:
            state = opt.optimizer.state[flat]
            for key in keys - set(state):
                state[key] = torch.zeros(()) if key == STEP else torch.zeros_like(flat)
        self._link_fragments()

    def restore(self, pieces: list[Piece]) -> None:
        """Set the fp32 master and optimizer state of each parameter from loaded ``targets``
        buffers (one group of parameters; the step is set by the group that holds it)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for _, key, value, p in pieces:
            if key == PARAM:
                safe_set_full_fp32_param(p, value)
            elif key == STEP:
                for st in self.engine.optimizer.optimizer.state.values():
                    if torch.is_tensor(st.get(STEP)):
                        st[STEP].copy_(value)
                    else:
                        st[STEP] = value.item()
            else:
                safe_set_full_optimizer_state(p, value, key)

    def finish_restore(self) -> None:
        """Refresh the (low-precision) model weights from the restored fp32 masters."""
        opt = self.engine.optimizer
        if hasattr(opt, "update_lp_params"):  # ZeRO-1/2: fp32 partitions -> model weights
            opt.update_lp_params()
        else:  # ZeRO-3: the model's partitions are views of fp16_partitioned_groups_flat
            for lp, hp in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
                lp.data.copy_(hp.data)


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, engine=None
) -> TrainingState:
    """The state accessor of ``model`` trained by ``optimizer``, or by the DeepSpeed ``engine``
    (its own optimizer then) when one is given."""
    return TrainingState(model, optimizer) if engine is None else DeepSpeedState(model, engine)
