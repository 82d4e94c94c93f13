"""What TSP changes in TRL's online trainers (GRPO, RLOO), whatever the algorithm.

``TSPOnlineMixin`` goes in front of ``TSPTrainerMixin`` and the TRL trainer class; it names the
class (``_trl``) and the module its code lives in (``_trl_module``: collectives and model
loading are patched there). See ``grpo`` for what it does and why.
"""

from __future__ import annotations

import types

import torch
from accelerate.utils import is_peft_model
from torch import nn
from transformers import ProcessorMixin

from ..hf.generate import sync_sampling_state
from ..hf.lora import peft_base
from .reference import adapter_made_already, bind_tsp_forward, fresh_adapter, frozen_copy
from .replicas import over_replicas
from .rollouts import check_same_ids, check_within_positions, rewards_once_per_group
from .scoring import check_temperature, completion_logps, tempered

_REFUSED = {
    "tools": "tool calling (multi-turn rollouts)",
    "environment_factory": "environments (multi-turn rollouts)",
}


class TSPOnlineMixin:
    """Rollouts, rewards, scoring and loss of a TRL online trainer on a TSP model."""

    _trl: type  # the TRL trainer class
    _trl_module: types.ModuleType  # where its code is
    _config: type  # its config class

    def __init__(self, model: nn.Module, reward_funcs=None, args=None, **kwargs) -> None:
        if not isinstance(args, self._config):
            raise ValueError(f"{type(self).__name__} needs args={self._config.__name__}(...)")
        check_online_config(args, kwargs, type(self).__name__)
        self._beta, self._reference = args.beta, None
        super().__init__(model, args, reward_funcs=reward_funcs, **kwargs)

    def _folded(self, model: nn.Module) -> None:
        """Full fine-tuning with ``beta > 0``: the reference is a frozen copy of the policy's
        shards, made before data parallelism wraps or shards the policy."""
        if self._beta != 0.0 and not is_peft_model(model):
            self._reference = frozen_copy(model)

    def _init_trainer(self, model: nn.Module, args, **kwargs) -> None:
        zero = (self.data_parallel.config.get("zero_optimization") or {}).get("stage", 0)
        if self.data_parallel.name == "deepspeed" and zero == 3:
            raise ValueError(
                f"{type(self).__name__} generates through the KV cache's decode path, which reads "
                "weights that ZeRO-3 keeps partitioned: use ZeRO stage 1 or 2, or "
                "data_parallel='fsdp2' (its shards are gathered for each rollout round)"
            )
        check_temperature(model, args.temperature)
        count_replicas(args, self.tsp_mesh["dp"].size())
        with _reference_is(self._trl_module, self._reference):
            if is_peft_model(model):
                adapter = fresh_adapter(model, type(self).__name__)
                with adapter_made_already(self._trl_module, model):
                    base = peft_base(model)
                    self._trl.__init__(self, base, args=args, peft_config=adapter, **kwargs)
            else:
                self._trl.__init__(self, model, args=args, **kwargs)
        del self._reference
        bind_tsp_forward(self.model, self.ref_model)

    # -- rollouts ----------------------------------------------------------------------------

    def _replicas(self):
        return over_replicas(self, self._trl_module, self.tsp_mesh["dp"].get_group())

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        """TRL's rollout round with its collectives over the dp replicas; the TSP group leaves it
        with one random state (its reward functions ran on one rank), so TRL's shuffle of the
        round agrees too."""
        with self._replicas():
            out = self._trl._generate_and_score_completions(self, inputs)
        sync_sampling_state(self.tsp_mesh["tsp"].get_group(), self.accelerator.device)
        return out

    def _generate(self, prompts: list):
        """TRL's rollouts (generated, or a ``rollout_func``'s), checked to be the same on every
        rank of the TSP group: prompts and completions in one all-gather."""
        out = self._trl._generate(self, prompts)
        check_same_ids([*out[0], *out[1]], "rollout", self.tsp_mesh["tsp"].get_group())
        return out

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        """TRL's generation with the TSP model itself, not its data-parallel wrapper (its
        ``generate`` is TSP's), with FSDP2's dp shards gathered for the whole call."""
        check_same_ids(prompt_ids, "prompt", self.tsp_mesh["tsp"].get_group())
        check_within_positions(self.model, prompt_ids, self.max_completion_length)
        wrapped, self.model_wrapped = self.model_wrapped, self.model
        try:
            with self.data_parallel.whole_weights(self.model):
                return self._trl._generate_single_turn(self, prompt_ids, *args, **kwargs)
        finally:
            self.model_wrapped = wrapped

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rows = (inputs, prompts, completions, completion_ids_list)
        return rewards_once_per_group(
            lambda: self._trl._calculate_rewards(self, *rows),
            (len(prompts), len(self.reward_funcs)),
            self.tsp_mesh,
            self.accelerator.device,
            module=self._trl_module,
        )

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's scoring (in row chunks of ``batch_size``) through ``completion_logps``."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise ValueError(f"{type(self).__name__} scores text only: got {given}")
        batch_size = batch_size or input_ids.size(0)
        parts = []
        with tempered(model, self.temperature), self.accelerator.autocast():
            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                parts.append(
                    completion_logps(
                        model,
                        input_ids[rows],
                        attention_mask[rows],
                        logits_to_keep,
                        entropy=compute_entropy,
                        router_logits=compute_aux_loss,
                    )  # fmt: skip
                )
        logps, entropies, aux = zip(*parts)
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    # -- loss ------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on the rollout rows (the model shards them itself)."""
        with self._replicas():
            return self._trl.compute_loss(
                self,
                model,
                inputs,
                return_outputs=return_outputs,
                num_items_in_batch=num_items_in_batch,
            )


def check_online_config(args, kwargs: dict, trainer: str) -> None:
    """Refuse what TSP's online trainers do not run, before anything is built."""
    if args.use_vllm:
        raise ValueError(
            f"{trainer} generates with the TSP model itself (1/D of the weights and KV cache per "
            "rank): drop use_vllm (colocate would load a full model per process; to feed an "
            "external vLLM server, stream the weights with tsp_ext.stream_weights)"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(f"{trainer} does not support continuous batching: drop it")
    if getattr(args, "cast_lm_head_to_fp32", False):
        raise ValueError(
            f"{trainer}: cast_lm_head_to_fp32 replaces the LM head, which TSP shards over the "
            "vocabulary (its ring computes the log-softmax in float32 already): drop it"
        )
    if getattr(args, "sync_ref_model", False):
        raise ValueError(f"{trainer} does not support sync_ref_model: drop it")
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{trainer} does not support {what}: drop {name}=")
    if isinstance(kwargs.get("processing_class"), ProcessorMixin):
        raise ValueError(f"{trainer} trains text models: pass a tokenizer, not a processor")
    for split in ("train_dataset", "eval_dataset"):
        check_prompt_column(kwargs.get(split), split, trainer)


def check_prompt_column(dataset, split: str, trainer: str) -> None:
    """A dataset (or a dict of them, for evaluation) whose rows have no ``prompt`` is refused
    when the trainer is built, not at its first step."""
    datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
    for d in datasets:
        columns = getattr(d, "column_names", None)  # an iterable dataset may not know them
        if columns is not None and "prompt" not in columns:
            raise ValueError(
                f"{trainer}: the {split} has no 'prompt' column (its columns: {columns}); TRL's "
                "online trainers generate from each row's prompt: rename the column holding "
                "the prompts (dataset.rename_column(..., 'prompt'))"
            )


def count_replicas(args, dp: int) -> None:
    """``generation_batch_size`` over the dp replicas (TRL counts every process; a TSP group
    reads one replica's rows), checked to hold whole prompt groups."""
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise ValueError(
            "a generation round holds per_device_train_batch_size "
            f"({args.per_device_train_batch_size}) x dp ({dp}) x steps_per_generation "
            f"({args.steps_per_generation}) = "
            f"{args.generation_batch_size} completions, which num_generations "
            f"({args.num_generations}) does not divide: every prompt's group must be whole "
            "(the TSP ranks of a group share rows: count dp replicas, not processes)"
        )


class _reference_is:
    """Within: TRL's ``create_model_from_path`` (as ``module`` imported it) returns ``ref`` (the
    folded copy) instead of loading a full model from the hub."""

    def __init__(self, module: types.ModuleType, ref: nn.Module | None) -> None:
        self.module, self.ref = module, ref

    def __enter__(self):
        self.saved = self.module.create_model_from_path
        if self.ref is not None:
            self.module.create_model_from_path = lambda *args, **kwargs: self.ref

    def __exit__(self, *exc):
        self.module.create_model_from_path = self.saved
