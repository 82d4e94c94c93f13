"""DeepSpeed ZeRO-1/2/3 data parallelism across TSP groups, through a ``"tsp"`` config key.

    engine, optimizer, _, scheduler = tsp_ext.deepspeed.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization":
        {"stage": 3}, "tsp": {"size": 4}}, optimizer=lambda params: AdamW(params, lr=1e-5))

Same arguments and return value as ``deepspeed.initialize``. It builds the (dp, tsp) mesh, applies
TSP if the model is not a TSP model yet, and gives DeepSpeed an ``mpu`` so that ZeRO partitions and
reduces over the dp group only, batch sizes count dp replicas, and gradient norms count each
TSP-sharded parameter once per shard and each replicated parameter once.

``trainer_config`` / ``finish_trainer_config`` read ``TrainingArguments(deepspeed=...)``'s config
for ``TSPTrainer``. Importing this module imports neither ``deepspeed`` nor ``accelerate``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import TSPConfig
from ..engine.attention.heads import AttentionSpec
from ..hf.apply import apply_tsp
from ..hf.full_state import full_state_dict as tsp_full_state_dict
from ..hf.lora import peft_base
from ..hf.sharding import Role, param_roles
from ..mesh import init_tsp_mesh

if TYPE_CHECKING:
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

# DeepSpeed options that build their own model/sequence-parallel groups, which would then take
# precedence over TSP's and partition or average across the TSP axis
_CONFLICTING = ("sequence_parallel_size", "data_parallel_size", "mesh_param")


class TSPModelParallelUnit:
    """The ``mpu`` DeepSpeed asks for: data parallel = the mesh's dp axis, model parallel = tsp.

    Deliberately no ``get_sequence_parallel_*`` / ``get_sequence_data_parallel_*`` methods: with
    them DeepSpeed would treat TSP as Ulysses and reduce ZeRO state across the TSP axis.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._dp = mesh["dp"].get_group()
        self._tsp = mesh["tsp"].get_group()

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp)

    def get_model_parallel_group(self):
        return self._tsp

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._tsp)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._tsp)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def tsp_config_from_ds(config: dict[str, Any]) -> TSPConfig:
    """The ``TSPConfig`` described by a DeepSpeed config's ``"tsp"`` block: ``size`` (required)
    and any other ``TSPConfig`` field, e.g. ``{"size": 4, "recompute_mlp": false}``."""
    block = config.get("tsp")
    if not isinstance(block, dict) or "size" not in block:
        raise ValueError('the DeepSpeed config needs a "tsp" block with a "size", e.g. {"size": 4}')
    return TSPConfig.from_dict(block, where='the "tsp" block')


def _load(config: str | dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        raise ValueError('tsp_ext.deepspeed.initialize needs a DeepSpeed config with a "tsp" block')
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    return copy.deepcopy(config)


def _check_conflicts(config: dict[str, Any], kwargs: dict[str, Any]) -> None:
    if kwargs.get("mpu") is not None:
        raise ValueError("do not pass mpu: tsp_ext.deepspeed builds the (dp, tsp) groups itself")
    for key in _CONFLICTING:
        if key in config:
            raise ValueError(
                f"DeepSpeed config key {key!r} would build groups across the TSP axis; remove it "
                'and set the TSP size in the "tsp" block (dp is world size / tsp size)'
            )
    autotp = (config.get("tensor_parallel") or {}).get("autotp_size", 1)
    if autotp and autotp > 1:
        raise ValueError(
            "DeepSpeed AutoTP (tensor_parallel.autotp_size > 1) cannot be combined with TSP"
        )


def mark_parallel_params(model: nn.Module) -> None:
    """Tag parameters the way DeepSpeed's gradient norm expects.

    ``tensor_model_parallel=True``: counted on every TSP rank (distinct shards). Untagged:
    counted on TSP rank 0 only (replicated weights, and copies of replicated KV heads, whose
    first owner is tagged instead).
    """
    roles = param_roles(model)
    for name, p in model.named_parameters():
        p.tensor_model_parallel = roles[name] is Role.SHARDED


def _check_clipping(config: dict[str, Any], model: nn.Module) -> None:
    """DeepSpeed's gradient norm tags whole parameters, so it would count twice a shared KV head
    whose copy shares a K/V slice with a head of the rank's own (``AttentionSpec.kv_mixed``)."""
    if not config.get("gradient_clipping"):
        return
    spec = next((m.spec for m in model.modules() if isinstance(getattr(m, "spec", None),
                                                               AttentionSpec)), None)  # fmt: skip
    if spec is None or not spec.kv_mixed:
        return
    sizes = [
        D for D in range(1, spec.n_heads + 1) if not dataclasses.replace(spec, tsp_size=D).kv_mixed
    ]
    raise ValueError(
        f"gradient_clipping with tsp size {spec.tsp_size}: {spec.n_heads} query / "
        f"{spec.n_kv_heads} KV heads put a shared KV head and an own one in the same K/V slice, "
        "which DeepSpeed's gradient norm would count twice; use a tsp size in "
        f"{sizes}, or set gradient_clipping to 0"
    )


def _check_zero3_dtype(config: dict[str, Any], model: nn.Module) -> None:
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    dtypes = {p.dtype for p in model.parameters()}
    if stage == 3 and dtypes - {torch.float32, torch.bfloat16, torch.float16}:
        raise ValueError(
            f"DeepSpeed ZeRO-3 partitions float32, bfloat16 and float16 parameters only; the model "
            f"has {sorted(map(str, dtypes))}: convert it (model.float()) or use ZeRO stage 1/2"
        )


def _check_zero3_vision(config: dict[str, Any], model: nn.Module) -> None:
    """ZeRO-3 gathers each module's parameters as it runs; a vision-language model's tower runs
    on each rank's own images with its weights' gradients summed over the TSP group
    (``hf.vision.encode``), which needs them in place for the whole encoder call."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    base = peft_base(model) or model
    if stage == 3 and base.tsp.family.vision is not None:
        raise ValueError(
            f"DeepSpeed ZeRO-3 with a vision-language model ({type(base).__name__}) is not "
            "supported: use ZeRO stage 1 or 2, or FSDP2 over dp (data_parallel='fsdp2'), which "
            "shards its weights too"
        )


def _check_optimizer_params(model: nn.Module, optimizer, model_parameters) -> None:
    """An optimizer (or parameter list) built before apply_tsp points at the freed full weights."""
    live = {id(p) for p in model.parameters()}
    params = []
    if isinstance(optimizer, torch.optim.Optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
    elif model_parameters is not None:
        model_parameters = list(model_parameters)
        for item in model_parameters:
            params.extend(item["params"] if isinstance(item, dict) else [item])
    if any(id(p) not in live for p in params):
        raise ValueError(
            "the optimizer / model_parameters refer to parameters that are no longer in the model "
            "(apply_tsp replaced them): pass an optimizer factory (lambda params: AdamW(params)) "
            "or call apply_tsp before building the optimizer"
        )
    return model_parameters


def _cpu_optimizer(optimizer):
    """Torch's Adam / AdamW / Adagrad as DeepSpeed's CPU version of it, over the same parameter
    groups (the same dicts: a schedule that sets their ``lr`` still drives it); any other
    optimizer unchanged (DeepSpeed accepts its own CPU optimizers and refuses the rest)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        adamw = isinstance(optimizer, torch.optim.AdamW)  # decoupled decay, or Adam's L2
        return DeepSpeedCPUAdam(optimizer.param_groups, adamw_mode=adamw)
    if isinstance(optimizer, torch.optim.Adagrad):
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(optimizer.param_groups)
    return optimizer


def _offloaded_optimizer(cfg: dict, optimizer):
    """With ``offload_optimizer`` on the CPU, DeepSpeed steps the optimizer on the host and takes
    only its CPU optimizers (unless ``zero_force_ds_cpu_optimizer`` is false): a torch Adam,
    AdamW or Adagrad, or a factory returning one, becomes DeepSpeed's CPU version, as Accelerate
    and the HF Trainer do."""
    device = cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if device != "cpu" or not cfg.get("zero_force_ds_cpu_optimizer", True) or optimizer is None:
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return _cpu_optimizer(optimizer)
    return lambda params: _cpu_optimizer(optimizer(params))


def initialize(
    model: nn.Module,
    config: str | dict[str, Any] | None = None,
    optimizer=None,
    model_parameters=None,
    **kwargs,
):
    """``deepspeed.initialize`` for a TSP model; see the module docstring.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the engine's
    ``tsp_mesh`` is the (dp, tsp) mesh, for ``shard_batch`` / ``gather_sequence``.
    """
    import deepspeed  # the optional dependency, only when DeepSpeed runs

    cfg = _load(config)
    tsp_cfg = tsp_config_from_ds(cfg)
    _check_conflicts(cfg, kwargs)
    _check_zero3_dtype(cfg, model)
    cfg.pop("tsp")
    state = getattr(model, "tsp", None)
    if state is None:
        mesh = init_tsp_mesh(tsp_cfg.tsp_size)
        apply_tsp(model, mesh, config=tsp_cfg)
    else:
        mesh = state.mesh
        diff = state.config.differences(tsp_cfg)
        if diff:
            said = ", ".join(f"{k}={v[1]!r} (model: {v[0]!r})" for k, v in diff.items())
            raise ValueError(
                f'the "tsp" block disagrees with how the model was made a TSP model: {said}; '
                'make them agree, or pass the model before apply_tsp and let the "tsp" block '
                "apply it"
            )
    if mesh.mesh_dim_names != ("dp", "tsp"):
        raise ValueError(f"DeepSpeed needs a ('dp', 'tsp') mesh, got {mesh.mesh_dim_names}")
    _check_zero3_vision(cfg, model)
    model_parameters = _check_optimizer_params(model, optimizer, model_parameters)
    if model_parameters is None and not isinstance(optimizer, torch.optim.Optimizer):
        model_parameters = list(model.parameters())
    _check_clipping(cfg, model)
    mark_parallel_params(model)
    mpu = TSPModelParallelUnit(mesh)
    out = deepspeed.initialize(
        model=model,
        config=cfg,
        optimizer=_offloaded_optimizer(cfg, optimizer),
        model_parameters=model_parameters,
        mpu=mpu,
        **kwargs,
    )
    out[0].tsp_mesh = mesh
    return out


def trainer_config(
    args: TrainingArguments, model: nn.Module, tsp: int | TSPConfig | None
) -> tuple[HfTrainerDeepSpeedConfig, int | TSPConfig | None]:
    """The DeepSpeed config of ``TrainingArguments(deepspeed=...)`` as Hugging Face reads it
    (``HfTrainerDeepSpeedConfig``: ``"auto"`` values from the arguments), and the TSP options to
    apply: the ``"tsp"`` block's, whose size must agree with ``tsp`` / the model's."""
    # imported here: it imports accelerate, which tsp_ext.deepspeed alone does not need
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf_config = HfTrainerDeepSpeedConfig(args.deepspeed)
    for key in ("optimizer", "scheduler"):
        if key in hf_config.config:
            raise ValueError(
                f'TSPTrainer trains with Trainer\'s optimizer and schedule: remove the "{key}" '
                "block from the DeepSpeed config (set args.optim, learning_rate, "
                "lr_scheduler_type, ... instead)"
            )
    if "tsp" not in hf_config.config:
        return hf_config, tsp
    block = tsp_config_from_ds(hf_config.config)
    state = getattr(model, "tsp", None)
    given = tsp.tsp_size if isinstance(tsp, TSPConfig) else tsp
    given = state.size if given is None and state is not None else given
    if given is not None and given != block.tsp_size:
        raise ValueError(
            f'the DeepSpeed config\'s "tsp" block has size {block.tsp_size} but the TSP size is '
            f"{given} (tsp= or the TSP model): make them agree, or leave one out"
        )
    return hf_config, (block if state is None and not isinstance(tsp, TSPConfig) else tsp)


def finish_trainer_config(
    hf_config: HfTrainerDeepSpeedConfig, args: TrainingArguments, model: nn.Module, mesh: DeviceMesh
) -> None:
    """Fill the ``"auto"`` values of ``trainer_config``'s config from ``args`` (absent batch
    sizes, accumulation and clipping count as ``"auto"``); batch sizes count dp replicas, not
    processes; a config without a ``"tsp"`` block gets the model's TSP options."""
    config = hf_config.config
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        config.setdefault(key, "auto")
    batch = config.pop("train_batch_size", "auto")
    hf_config.trainer_config_process(args)  # would count every process as a replica
    hf_config.trainer_config_finalize(args, model, 0)  # no "scheduler" block: no step counts
    replicas = mesh["dp"].size() * args.gradient_accumulation_steps
    expected = replicas * config["train_micro_batch_size_per_gpu"]
    if batch not in ("auto", expected):
        raise ValueError(
            f"DeepSpeed train_batch_size={batch}, but micro batch x accumulation x dp replicas "
            f'is {expected} (dp = processes / TSP size): set it to {expected} or "auto"'
        )
    config["train_batch_size"] = expected
    config.setdefault("zero_allow_untested_optimizer", True)  # any Trainer optimizer, as HF does
    config.setdefault("tsp", model.tsp.config.to_dict())


def full_state_dict(engine, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full parameters of a DeepSpeed-wrapped TSP model under the original Hugging Face names.

    Gathers each ZeRO-3 partition over dp (``GatheredParameters``, one parameter at a time), then
    the TSP shards over the TSP group. Collective: call on every rank. Holds the whole model, for
    comparisons and debugging; ``tsp_ext.save_pretrained(engine.module, path)`` exports without it.
    """
    return tsp_full_state_dict(engine.module, rank0_only=rank0_only)
