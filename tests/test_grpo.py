"""GRPO under TSP against single-process TRL ``GRPOTrainer``: the same rollouts (a rollout
function gives fixed completions), the same rewards; loss, advantages, metrics and every
gradient of two training steps. Then generation (greedy = the one-process model, sampling the
same on every rank), memory, and bad input."""

from __future__ import annotations

import copy
import functools
import zlib

import pytest
import torch
import torch.distributed as dist
from checks import error_message, rel_err
from models import LORA_TARGETS, build
from test_preference import LargestTensor, word_tokenizer

from tsp_ext import TSPConfig, full_grads

pytestmark = pytest.mark.multiproc

V, G, C = 128, 4, 8  # vocabulary, completions per prompt, max completion length
EOS = V - 1

# per D: a beta = 0 / one-iteration case and a beta > 0 / several-iteration one, TRL's loss
# types, sequence-level importance sampling, truncated completions masked, temperature, the
# high-entropy token mask, LoRA
CASES = {
    1: {
        "dapo": dict(loss_type="dapo"),
        "grpo_kl": dict(
            loss_type="grpo", beta=0.2, num_iterations=2, importance_sampling_level="sequence",
            mask_truncated_completions=True,
        ),
    },
    2: {
        "dr_grpo_t": dict(loss_type="dr_grpo", temperature=0.7),
        "lora_kl": dict(loss_type="dapo", beta=0.1, num_iterations=2, lora=True),
    },
    3: {
        "bnpo_entropy": dict(loss_type="bnpo", top_entropy_quantile=0.5),
        "dapo_kl": dict(loss_type="dapo", beta=0.1, num_iterations=2, mask_truncated_completions=True),
    },
    4: {
        "grpo": dict(loss_type="grpo"),
        "bnpo_kl": dict(
            loss_type="bnpo", beta=0.2, num_iterations=2, importance_sampling_level="sequence"
        ),
    },
}  # fmt: skip
ALL_CASES = {name: case for cases in CASES.values() for name, case in cases.items()}


def prompts_dataset(n: int = 8, seed: int = 0):
    """``n`` prompts of 3-9 random words (left padding differs per row)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(3, 10, (1,), generator=g))
        rows.append(" ".join(f"w{int(i)}" for i in torch.randint(0, V - 1, (k,), generator=g)))
    return Dataset.from_dict({"prompt": rows})


def fixed_rollouts(prompts: list[str], trainer) -> dict:
    """TRL's ``rollout_func``: completions fixed by each prompt and its place in its group of G
    (1 to C tokens; about half end with EOS, the others are truncated)."""
    prompt_ids, completion_ids = [], []
    for i, p in enumerate(prompts):
        g = torch.Generator().manual_seed(zlib.crc32(p.encode()) + i % G)
        n = int(torch.randint(1, C + 1, (1,), generator=g))
        ids = torch.randint(0, V - 1, (n,), generator=g).tolist()
        if n < C and bool(torch.rand(1, generator=g) < 0.5):
            ids.append(EOS)
        prompt_ids.append(trainer.processing_class(p, add_special_tokens=False)["input_ids"])
        completion_ids.append(ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def score(prompts, completions, completion_ids, **kwargs) -> list[float]:
    return [float((sum(ids) * 7 + len(ids)) % 5) for ids in completion_ids]


def grpo_args(tmp: str, **kw):
    from trl import GRPOConfig

    base = dict(
        output_dir=tmp, per_device_train_batch_size=8, num_generations=G, max_completion_length=C,
        use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", max_steps=2, seed=3,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", disable_tqdm=True,
    )  # fmt: skip
    return GRPOConfig(**{**base, **kw})


def exact_fused_head(model, temperature: float) -> None:
    """TRL's fused-LM-head protocol from the full fp64 logits / T (TRL's own kernel computes in
    float32); the loss code stays TRL's."""
    import types

    from trl.trainer.utils import FusedCausalLMOutput

    def forward(self, input_ids=None, labels=None, fused_lm_head=False, **kwargs):
        if not fused_lm_head:
            return type(self).forward(self, input_ids=input_ids, labels=labels, **kwargs)
        logits = type(self).forward(self, input_ids=input_ids, **kwargs).logits[:, :-1]
        logp = (logits.double() / temperature).log_softmax(-1)
        target = labels[:, 1:]
        mask = target != -100
        picked = logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        zero = torch.zeros_like(picked)
        return FusedCausalLMOutput(
            log_probs=torch.where(mask, picked, zero), entropy=torch.where(mask, entropy, zero),
            label_mask=mask,
        )  # fmt: skip

    model.forward = types.MethodType(forward, model)


class Recorder:
    """A trainer's advantages per rollout round, its losses (fp64: the log keeps float32) and
    gradients (full, HF names) per step."""

    def __init__(self, trainer, full: bool) -> None:
        from transformers import TrainerCallback

        self.advantages, self.losses, self.grads = [], [], []
        score_round, compute_loss = trainer._generate_and_score_completions, trainer.compute_loss

        def recorded(inputs):
            out = score_round(inputs)
            self.advantages.append(out["advantages"].detach().clone())
            return out

        def loss(*args, **kwargs):
            out = compute_loss(*args, **kwargs)
            self.losses.append(out.detach().clone())
            return out

        trainer._generate_and_score_completions, trainer.compute_loss = recorded, loss
        outer = self

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                if full:
                    outer.grads.append(full_grads(model))
                else:
                    named = model.named_parameters()
                    outer.grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})

        trainer.add_callback(Grads())


def run_case(tmp: str, name: str, tsp: int | None, dp: int = 1, data_parallel: str = "ddp"):
    """Two steps of ``name``: TRL in one process (``tsp`` None; its reference model a copy of
    the initial policy) or ``TSPGRPOTrainer`` at ``tsp`` x ``dp``. Logs, advantages, grads."""
    from peft import LoraConfig
    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    from tsp_ext import TSPGRPOTrainer

    settings = dict(ALL_CASES[name])
    lora = settings.pop("lora", False)
    batch = 8 if tsp is None else 8 // dp
    args = grpo_args(f"{tmp}/{name}_{tsp}_{dp}", per_device_train_batch_size=batch, **settings)
    model = build("llama", torch.float64, vocab_size=V)
    kw = dict(reward_funcs=[score], args=args, train_dataset=prompts_dataset())
    kw.update(processing_class=word_tokenizer(V), rollout_func=fixed_rollouts)
    if lora:
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)
    if tsp is None:
        initial, load = copy.deepcopy(model), grpo_trainer.create_model_from_path
        grpo_trainer.create_model_from_path = lambda *a, **k: copy.deepcopy(initial)  # the hub
        try:
            trainer = GRPOTrainer(model, **kw)
        finally:
            grpo_trainer.create_model_from_path = load
        base = trainer.model.get_base_model() if lora else trainer.model
        for m in (base, trainer.ref_model):
            if m is not None:
                exact_fused_head(m, args.temperature)
    else:
        config = TSPConfig(tsp_size=tsp, loss_chunk=16)
        trainer = TSPGRPOTrainer(model, tsp=config, data_parallel=data_parallel, **kw)
    record = Recorder(trainer, full=tsp is not None)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, record.advantages, record.losses, record.grads


def compare(got, ref) -> dict[str, float]:
    """Relative errors of logs (every metric but times and the float32 loss), advantages,
    losses and gradients."""
    (logs, adv, losses, grads), (ref_logs, ref_adv, ref_losses, ref_grads) = got, ref
    errs = {}
    for step, (a, b) in enumerate(zip(logs, ref_logs, strict=True)):
        for k, v in b.items():
            if "time" not in k and k != "loss" and isinstance(v, float):
                errs[f"{k}@{step}"] = abs(a[k] - v) / max(abs(v), 1.0)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        errs[f"loss@{step}"] = rel_err(a, b)
    for i, (a, b) in enumerate(zip(adv, ref_adv, strict=True)):
        errs[f"advantages@{i}"] = rel_err(a, b)
    for step, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
        errs[f"grads@{step}"] = max(rel_err(a[n], g) for n, g in b.items())
        errs[f"grad names@{step}"] = float(a.keys() != b.keys())
    return errs


def reference_worker(rank, world, tmp):
    return {name: run_case(tmp, name, None) for name in ALL_CASES}


@functools.cache
def references(workers, tmp: str) -> dict:
    return workers.run(reference_worker, 1, tmp, timeout=300)[0]


def tsp_worker(rank, world, tmp, ref):
    return {name: compare(run_case(tmp, name, world), ref[name]) for name in CASES[world]}


@pytest.mark.parametrize("world", sorted(CASES))
def test_grpo_matches_trl(workers, tmp, world):
    """Two steps per case (the second reuses the rollouts when num_iterations = 2: the old
    policy's log-probs differ, the clip and KL terms act), fp64."""
    ref = references(workers, tmp)
    for results in workers.run(tsp_worker, world, tmp, ref, timeout=300):
        for name, errs in results.items():
            assert max(errs.values()) < 1e-10, (name, errs)
