"""Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``) training a TSP model.

    trainer = TSPTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, tsp=2)
    trainer.train()
    trainer.save_model("out/hf")      # a plain HF checkpoint (streamed), loads in one process

What changes against a plain ``Trainer``:

- the model is made a TSP model (``apply_tsp``) on a ``(dp, tsp)`` mesh, and data parallelism runs
  over ``dp`` only (``tsp_ext.dp.engines``): DDP on the dp group, FSDP2 on ``mesh["dp"]``
  (``data_parallel="fsdp2"``, ``tsp_ext.fsdp.shard_model``), or DeepSpeed ZeRO with
  ``TrainingArguments(deepspeed=...)`` (``tsp_ext.deepspeed.initialize``; the config's ``"tsp"``
  block may give the TSP size); Accelerate's own DDP / DeepSpeed would average or partition across
  the TSP shards;
- every rank of a TSP group reads the same batches (the sampler splits the data over dp, not over
  the world), and ``shard_batch`` gives each rank its zigzag tokens in ``compute_loss`` (and,
  for a vision-language model, its images to encode: TRL's vision collator works as it is);
- ``num_items_in_batch`` counts the targets the TSP loss averages over (``shifted_labels``), once
  per TSP group, summed over dp; the loss is scaled by dp, not the world size;
- the gradient norm is ``tsp_ext.clip_grad_norm_`` (every shard once, replicas once), with
  DeepSpeed the engine's (which counts shards the same way);
- ``save_model`` writes ``tsp_ext.save_pretrained``; checkpoints keep the training state with
  ``tsp_ext.checkpoint`` (model, optimizer, scheduler; with DeepSpeed the engine's fp32 masters
  and ZeRO optimizer state), so ``resume_from_checkpoint`` works.

The loss is always the TSP model's own global-mean loss: with TRL, ``SFTTrainer``'s fused LM head
(and its entropy / token-accuracy metrics) is not used.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DeepSpeedOptimizerWrapper
from torch import nn
from transformers import Trainer, TrainingArguments

from .. import checkpoint
from ..checkpoint.export import save_pretrained
from ..config import TSPConfig
from ..dp.engines import DataParallel, data_parallel_engine
from ..dp.guard import accelerate_deepspeed_config
from ..engine.sharding.layout import IGNORE_INDEX
from ..hf.apply import apply_tsp
from ..hf.batch import shard_batch, shifted_labels
from ..mesh import init_tsp_mesh

# varlen metadata of padding-free collators (flash attention): position_ids carry the same
# document boundaries, which is what shard_batch and the TSP attention use
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
STATE_DIR = "tsp_state"  # tsp_ext.checkpoint training state inside a Trainer checkpoint


class TSPTrainerMixin:
    """The TSP behaviour of ``TSPTrainer``, to put in front of any ``Trainer`` subclass::

        class TSPSFTTrainer(TSPTrainerMixin, trl.SFTTrainer): ...

    Extra keyword arguments: ``tsp`` (the TSP size or a ``TSPConfig``; None: the model is
    already a TSP model, or the DeepSpeed config's ``"tsp"`` block gives it) and
    ``data_parallel`` (``"ddp"`` or ``"fsdp2"``; ``"deepspeed"``, the default with
    ``args.deepspeed``). ``peft_config`` (a ``LoraConfig``, as TRL's trainers take it) makes the
    model a PEFT model before TSP folds it (``hf.lora``); ``save_model`` then writes the adapter.
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        *trainer_args,
        tsp: int | TSPConfig | None = None,
        data_parallel: str | None = None,
        **kwargs,
    ) -> None:
        self.data_parallel = _data_parallel(args, data_parallel)
        args.device  # noqa: B018  Accelerate sets up the process group (gloo / nccl)
        model = _with_adapter(model, kwargs.pop("peft_config", None), args.seed, tsp)
        tsp = self.data_parallel.configure_trainer(args, model, tsp)
        self.tsp_mesh = _apply(model, tsp)
        if args.world_size != dist.get_world_size():
            raise ValueError(
                f"TrainingArguments sees {args.world_size} process(es) but the process group has "
                f"{dist.get_world_size()}: Trainer would not run data-parallel (on CPU pass "
                "use_cpu=True to TrainingArguments)"
            )
        self._folded(model)
        self.data_parallel.prepare(model, self.tsp_mesh)
        self._init_trainer(model, args, *trainer_args, **kwargs)

    def _folded(self, model: nn.Module) -> None:
        """Called once ``model`` is a TSP model, before data parallelism wraps or shards it
        (``TSPDPOTrainer`` copies its reference from the shards here)."""

    def _init_trainer(self, model: nn.Module, args: TrainingArguments, *trainer_args, **kwargs):
        """The trainer class's own ``__init__`` with the TSP model (``TSPDPOTrainer`` adapts
        TRL's)."""
        super().__init__(model, args, *trainer_args, **kwargs)

    # -- data: the same batches on every rank of a TSP group -------------------------------

    def _get_dataloader(self, *args, **kwargs):
        """Trainer's loader, split over the dp replicas only (Accelerate would split it over
        every process, giving each TSP rank other sequences)."""
        self.accelerator.prepare = self._prepare_dp_loader
        try:
            return super()._get_dataloader(*args, **kwargs)
        finally:
            del self.accelerator.prepare

    def _prepare_dp_loader(self, loader):
        acc, dp = self.accelerator, self.tsp_mesh["dp"]
        return prepare_data_loader(
            loader,
            acc.device,
            num_processes=dp.size(),
            process_index=dp.get_local_rank(),
            split_batches=acc.split_batches,
            put_on_device=acc.device_placement,
            rng_types=acc.rng_types.copy(),
            even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
        )

    def get_tp_size(self) -> int:
        """Ranks that see the same batch: the TSP size (Trainer's batch-size and loss-scale
        arithmetic divides the world by it, giving dp)."""
        return self.tsp_mesh["tsp"].size()

    # -- loss ------------------------------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """Targets of the TSP loss in these micro batches, summed over dp (with
        ``average_tokens_across_devices``): counted once per TSP group."""
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        count = sum((shifted_labels(_model_inputs(b)) != IGNORE_INDEX).sum() for b in batch_samples)
        count = count.to(device)
        if self.args.average_tokens_across_devices and self.tsp_mesh["dp"].size() > 1:
            dist.all_reduce(count, group=self.tsp_mesh["dp"].get_group())
        return count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's ``compute_loss`` on this rank's TSP inputs: the model returns the loss of
        the TSP group's whole batch."""
        inputs = shard_batch(_model_inputs(inputs), self.tsp_mesh, model=self.model)
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    # -- data parallelism and gradient norm ------------------------------------------------

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """The data-parallel engine's module (with Trainer's optimizer; Trainer keeps stepping
        its schedule). A model the engine does not wrap (FSDP2: sharded already) is handed over
        as already wrapped, which keeps Accelerate from DDP-wrapping it."""
        if not training or model is not self.model:
            return model
        module, optimizer, _ = self.data_parallel.wrap(model, self.tsp_mesh, self.optimizer)
        if self.data_parallel.engine is not None:  # it steps in training_step: Trainer's
            # optimizer becomes Accelerate's no-op wrapper, kept as is by Trainer's prepare();
            # Trainer's no_sync would enter the engine's (ZeRO-2/3 refuse it: they reduce in
            # every backward)
            self.optimizer = DeepSpeedOptimizerWrapper(optimizer)
            self.optimizer._is_accelerate_prepared = True
            self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True
        return _Unwrapped(model) if module is model else module

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.data_parallel.engine is None or model is not self.data_parallel.engine:
            return super().training_step(model, inputs, num_items_in_batch)
        self.accelerator.backward = self._engine_backward
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del self.accelerator.backward

    def _engine_backward(self, loss: torch.Tensor, **kwargs) -> None:
        """The engine's backward (the loss is already scaled for accumulation), and its step
        (clip, update) after the last micro batch of a step."""
        self.data_parallel.engine_backward(loss, boundary=self.accelerator.sync_gradients)

    def _clip_grad_norm(self, model):
        return self.data_parallel.clip_grad_norm(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.data_parallel.grad_norm(self.model)
        return grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm

    # -- saving ----------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A plain Hugging Face checkpoint (``tsp_ext.save_pretrained``; collective). Into a
        directory that holds other files (``output_dir`` with its ``checkpoint-*``), the export
        is staged beside them and its files moved in, replacing only same-named ones."""
        output_dir = output_dir or self.args.output_dir
        # the writer's view, on every rank (other nodes may not share its file system)
        occupied = [
            dist.get_rank() == 0 and os.path.isdir(output_dir) and bool(os.listdir(output_dir))
        ]
        dist.broadcast_object_list(occupied, src=0)
        occupied = occupied[0]
        target = os.path.join(output_dir, ".tsp_export") if occupied else output_dir
        save_pretrained(self.model, target, self.processing_class)
        if dist.get_rank() == 0:
            if occupied:
                for name in os.listdir(target):
                    os.replace(os.path.join(target, name), os.path.join(output_dir, name))
                os.rmdir(target)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        dist.barrier()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # AcceleratedOptimizer
        path = os.path.join(output_dir, STATE_DIR)
        engine = self.data_parallel.engine
        checkpoint.save(path, self.model, optimizer, scheduler=self.lr_scheduler, engine=engine)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come back with the optimizer state (``_load_optimizer_and_scheduler``)."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, STATE_DIR)):
            raise ValueError(
                f"{resume_from_checkpoint} has no {STATE_DIR}/: it was not written by a "
                "TSPTrainer with the optimizer state (save_only_model=False); start from its "
                "weights with tsp_ext.load_pretrained instead"
            )

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        path = os.path.join(checkpoint_dir, STATE_DIR)
        engine = self.data_parallel.engine
        checkpoint.load(path, self.model, optimizer, scheduler=self.lr_scheduler, engine=engine)


class TSPTrainer(TSPTrainerMixin, Trainer):
    """``transformers.Trainer`` for a TSP model; see the module docstring.

    Args (besides ``Trainer``'s):
        tsp: the TSP size or a ``TSPConfig``: the model is made a TSP model on a ``(dp, tsp)``
            mesh. None: ``model`` already is one (``apply_tsp`` / ``load_pretrained``).
        data_parallel: ``"ddp"`` (default) or ``"fsdp2"`` over the dp axis; ``"deepspeed"``
            (the default with ``TrainingArguments(deepspeed=...)``): DeepSpeed ZeRO over dp.
    """


class _Unwrapped(nn.Module):
    """Hands Trainer an FSDP2-sharded model as "already wrapped" (Accelerate would DDP-wrap it)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def _with_adapter(model: nn.Module, peft_config, seed: int, tsp) -> nn.Module:
    """``model`` with a PEFT adapter of ``peft_config`` (None: unchanged), the same on every rank
    (``seed``), its adapters folded right away if ``model`` is a TSP model already (with the
    ``TSPConfig`` ``tsp``'s ``quantize_base``)."""
    if peft_config is None:
        return model
    from peft import get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(model, peft_config)
    if getattr(model, "tsp", None) is not None:
        apply_tsp(peft, config=tsp if isinstance(tsp, TSPConfig) else None)
    return peft


def _model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in VARLEN_KEYS}


def _apply(model: nn.Module, tsp: int | TSPConfig | None):
    """The model's (dp, tsp) mesh, applying TSP first if ``tsp`` is given."""
    state = getattr(model, "tsp", None)
    if state is not None:
        if tsp is not None and (tsp.tsp_size if isinstance(tsp, TSPConfig) else tsp) != state.size:
            raise ValueError(
                f"tsp={tsp} but the model is already a TSP model of size {state.size}: pass "
                "tsp=None, or the model before apply_tsp"
            )
        mesh = state.mesh
    elif tsp is None:
        raise ValueError(
            "TSPTrainer needs tsp=<size> (or a TSPConfig), a model made a TSP model already "
            '(apply_tsp / load_pretrained), or a DeepSpeed config with a "tsp" block'
        )
    else:
        config = tsp if isinstance(tsp, TSPConfig) else TSPConfig(tsp_size=tsp)
        mesh = init_tsp_mesh(config.tsp_size)
        apply_tsp(model, mesh, config=config)
    if mesh.mesh_dim_names != ("dp", "tsp"):
        raise ValueError(
            f"TSPTrainer needs a ('dp', 'tsp') mesh (init_tsp_mesh), got {mesh.mesh_dim_names}"
        )
    return mesh


def _data_parallel(args: TrainingArguments, data_parallel: str | None) -> DataParallel:
    """The data-parallel engine (``tsp_ext.dp.engines``): ``data_parallel``, or DeepSpeed with
    ``args.deepspeed``; Trainer settings that would bypass it are refused."""
    dp = data_parallel_engine(data_parallel or ("deepspeed" if args.deepspeed else "ddp"))
    dp.check_trainer_args(args)
    if accelerate_deepspeed_config() is not None:
        raise ValueError(
            "TSPTrainer drives DeepSpeed itself (tsp_ext.deepspeed.initialize): drop the "
            "Accelerate config's DeepSpeed plugin and pass its config file as "
            'TrainingArguments(deepspeed=...) (it may carry the "tsp" block)'
        )
    if args.fsdp or args.fsdp_config and args.fsdp_config.get("fsdp_version"):
        raise ValueError(
            "TSPTrainer shards with FSDP2 over the dp axis itself: drop --fsdp / fsdp_config "
            "and pass data_parallel='fsdp2' (Trainer's FSDP would shard across the TSP axis)"
        )
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError("TSPTrainer builds the (dp, tsp) mesh itself: drop parallelism_config")
    return dp
