"""The data-parallel engines behind one interface, by name: ``ddp``, ``deepspeed``, ``fsdp2``.

    dp = data_parallel_engine("fsdp2")
    dp.prepare(model, mesh)                          # a TSP model: FSDP2 shards it over dp
    module, optimizer, scheduler = dp.wrap(model, mesh, make_optimizer, make_scheduler)
    for micro in range(accumulation):
        dp.backward(module(**batch).loss, accumulation)
        norm, updated = dp.step(max_norm, last_micro=micro == accumulation - 1)
    tsp_ext.checkpoint.save(path, model, optimizer, scheduler=scheduler, engine=dp.engine)

Every engine runs over the dp axis of the model's (dp, tsp) mesh only. The recipes' training loop
(``recipes/_training.py``) and ``TSPTrainerMixin`` both drive these classes; adding an engine is
one ``DataParallel`` subclass and its entry in ``ENGINES``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ..config import TSPConfig
from .deepspeed import finish_trainer_config, initialize, trainer_config
from .fsdp import shard_model
from .grad_norm import clip_grad_norm_

if TYPE_CHECKING:
    from transformers import TrainingArguments

# an optimizer, or a factory making one from the parameters to train; a factory making the
# learning-rate schedule of an optimizer
OptimizerOrFactory = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class DataParallel:
    """One data-parallel engine over the dp axis of a TSP model's (dp, tsp) mesh.

    In order: ``prepare`` once the model is a TSP model (before its optimizer is made); ``wrap``
    (the module to run forward, the optimizer and schedule); per micro batch ``backward`` and
    ``step``. ``TSPTrainerMixin`` calls ``check_trainer_args`` and ``configure_trainer`` before
    TSP is applied, and lets Trainer step unless ``engine`` steps itself (``engine_backward``).

    ``config``: the engine's own options (DDP: ``DistributedDataParallel`` keywords; FSDP2:
    ``fully_shard`` keywords; DeepSpeed: its JSON config with the ``"tsp"`` block).
    """

    name: ClassVar[str]

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        # a wrapper that runs backward and the optimizer step itself (DeepSpeed's engine), None
        # where the training loop does; what tsp_ext.checkpoint.save / load take as engine=
        self.engine = None
        self.model = self.optimizer = self.scheduler = None

    # -- TSPTrainer: before the model is a TSP model ----------------------------------------

    def check_trainer_args(self, args: TrainingArguments) -> None:
        """Refuse ``TrainingArguments`` this engine would ignore."""
        if args.deepspeed:
            raise ValueError(_deepspeed_mismatch(self.name, args))

    def configure_trainer(
        self, args: TrainingArguments, model: nn.Module, tsp: int | TSPConfig | None
    ) -> int | TSPConfig | None:
        """Read the engine's settings from ``args``; returns the TSP options to apply."""
        return tsp

    # -- training ---------------------------------------------------------------------------

    def prepare(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """Once ``model`` is a TSP model on ``mesh``, before its optimizer is made."""

    def wrap(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        optimizer: OptimizerOrFactory,
        lr_scheduler: SchedulerFactory | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
        """``(module to run forward, optimizer, schedule)``; a factory ``optimizer`` gets the
        parameters that train (LoRA: the adapter's only)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
        self.model, self.optimizer = model, optimizer
        self.scheduler = lr_scheduler(optimizer) if lr_scheduler is not None else None
        return self._module(model, mesh), optimizer, self.scheduler

    def _module(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """The module to run forward through (``model`` itself: already sharded)."""
        return model

    def backward(self, loss: torch.Tensor, accumulation_steps: int) -> None:
        """Backward of one micro batch's loss, averaged over the ``accumulation_steps``."""
        (loss / accumulation_steps).backward()

    def step(
        self, max_norm: float, last_micro: bool, skip: bool = False
    ) -> tuple[float | None, bool]:
        """After each micro batch: at the last one clip, update and advance the schedule.
        Returns ``(norm, updated)``: the global gradient norm before clipping (None before the
        last micro batch; the same on every rank), and whether the weights changed. A non-finite
        norm, or ``skip`` (a non-finite loss), drops the gradients: neither the optimizer nor
        the schedule advances."""
        if not last_micro:
            return None, False
        norm = self.clip_grad_norm(self.model, max_norm).item()
        updated = not skip and math.isfinite(norm)
        if updated:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, updated

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor | float:
        """Clip the gradients in place; returns their global norm before clipping."""
        return clip_grad_norm_(model, max_norm)

    def grad_norm(self, model: nn.Module) -> torch.Tensor | float:
        """The global gradient norm, unclipped."""
        return clip_grad_norm_(model, float("inf"))

    @contextlib.contextmanager
    def whole_weights(self, model: nn.Module) -> Iterator[None]:
        """Within: every parameter of ``model`` whole over dp (this rank's TSP shards, as DDP
        holds them), for code that reads weights outside the modules' forward hooks: the KV
        cache's decode path (generation). Peak: the TSP shards of the whole model, the memory
        a DDP replica holds all along (TRL's ``ds3_gather_for_generation``). DDP and ZeRO-1/2
        hold them already."""
        yield

    def engine_backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Backward of an already scaled loss through ``engine``, stepping at the accumulation
        ``boundary`` (only for engines that step themselves)."""
        raise NotImplementedError(f"{self.name} leaves backward and the step to the caller")


class DDP(DataParallel):
    """torch DDP over the dp group; by default the gradients live in DDP's buckets (no second
    copy of every gradient)."""

    name = "ddp"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__({"gradient_as_bucket_view": True, **(config or {})})

    def _module(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return DistributedDataParallel(model, process_group=mesh["dp"].get_group(), **self.config)


class FSDP2(DataParallel):
    """FSDP2 over ``mesh["dp"]`` (``tsp_ext.fsdp.shard_model``): each decoder layer and the root."""

    name = "fsdp2"

    def prepare(self, model: nn.Module, mesh: DeviceMesh) -> None:
        shard_model(model, mesh, **self.config)

    @contextlib.contextmanager
    def whole_weights(self, model: nn.Module) -> Iterator[None]:
        """Every FSDP2 unit unsharded over dp (``FSDPModule.unshard``), resharded on exit."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()


class DeepSpeed(DataParallel):
    """DeepSpeed ZeRO over the dp group (``tsp_ext.deepspeed.initialize``). The engine divides
    by the accumulation steps, clips and updates at the boundary itself, and skips a step whose
    gradients overflow (reported as an infinite norm); it does not skip finite gradients of a
    non-finite loss."""

    name = "deepspeed"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._trainer = None  # (HfTrainerDeepSpeedConfig, TrainingArguments) under TSPTrainer

    def check_trainer_args(self, args: TrainingArguments) -> None:
        if not args.deepspeed:
            raise ValueError(_deepspeed_mismatch(self.name, args))

    def configure_trainer(
        self, args: TrainingArguments, model: nn.Module, tsp: int | TSPConfig | None
    ) -> int | TSPConfig | None:
        """``TrainingArguments(deepspeed=...)``'s config (its ``"tsp"`` block may give the TSP
        options), hidden from Accelerate, which would hand the model to plain
        ``deepspeed.initialize``."""
        from accelerate.utils import DistributedType

        hf_config, tsp = trainer_config(args, model, tsp)
        self.config, self._trainer = hf_config.config, (hf_config, args)
        args.deepspeed_plugin = None  # on GPUs TrainingArguments set its process state up for it
        if args.distributed_state.distributed_type == DistributedType.DEEPSPEED:
            args.distributed_state.distributed_type = DistributedType.MULTI_GPU
        return tsp

    def prepare(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """Under TSPTrainer: the config's ``"auto"`` values from the arguments and the mesh."""
        if self._trainer is not None:
            hf_config, args = self._trainer
            finish_trainer_config(hf_config, args, model, mesh)

    def wrap(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        optimizer: OptimizerOrFactory,
        lr_scheduler: SchedulerFactory | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
        """The engine (``model`` made a TSP model on the ``"tsp"`` block if it is not one), its
        ZeRO optimizer and its schedule (None without ``lr_scheduler``)."""
        self.engine, self.optimizer, _, self.scheduler = initialize(
            model=model, config=self.config, optimizer=optimizer, lr_scheduler=lr_scheduler
        )
        self.model = model
        return self.engine, self.optimizer, self.scheduler

    def backward(self, loss: torch.Tensor, accumulation_steps: int) -> None:
        self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself

    def step(
        self, max_norm: float, last_micro: bool, skip: bool = False
    ) -> tuple[float | None, bool]:
        """``self.engine.step()`` after every micro batch (DeepSpeed counts them and updates at the
        boundary, clipping to its config's ``gradient_clipping``); ``skip`` is not honoured."""
        self.engine.step()
        updated = self.engine.was_step_applied()
        return (float(self.engine.get_global_grad_norm() or 0.0) if last_micro else None), updated

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor | float:
        """Clipped in ``self.engine.step``: the norm before clipping."""
        return self.grad_norm(model)

    def grad_norm(self, model: nn.Module) -> torch.Tensor | float:
        return self.engine.get_global_grad_norm()

    def engine_backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self.engine.step()


# name -> engine: the ``data_parallel=`` of TSPTrainer and the recipes' --data-parallel
ENGINES: dict[str, type[DataParallel]] = {e.name: e for e in (DDP, DeepSpeed, FSDP2)}


def data_parallel_engine(name: str, config: dict[str, Any] | None = None) -> DataParallel:
    """The engine registered as ``name`` (``ENGINES``), with its ``config``."""
    if name not in ENGINES:
        raise ValueError(f"data_parallel={name!r}: choose one of {tuple(ENGINES)}")
    return ENGINES[name](config)


def _deepspeed_mismatch(name: str, args: TrainingArguments) -> str:
    return (
        f"data_parallel={name!r} with TrainingArguments(deepspeed={args.deepspeed!r}): "
        "DeepSpeed runs when TrainingArguments has a deepspeed config (leave data_parallel "
        "unset or 'deepspeed'), DDP / FSDP2 when it has none"
    )
