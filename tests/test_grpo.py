"""GRPO and RLOO under TSP against single-process TRL ``GRPOTrainer`` / ``RLOOTrainer``: the
same rollouts (fixed completions), the same rewards; loss, advantages, metrics and every
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
        "rloo_kl": dict(rloo=True, beta=0.05, num_iterations=2),
    },
    3: {
        "bnpo_entropy": dict(loss_type="bnpo", top_entropy_quantile=0.5),
        "rloo": dict(rloo=True, beta=0.0, normalize_advantages=True),
        "dapo_kl": dict(
            loss_type="dapo", beta=0.1, num_iterations=2, mask_truncated_completions=True
        ),
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


def fixed_completions(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Completions fixed by each prompt and its place in its group of G (1 to C tokens; about
    half end with EOS, the others are truncated)."""
    completion_ids = []
    for i, p in enumerate(prompt_ids):
        g = torch.Generator().manual_seed(zlib.crc32(str(p).encode()) + i % G)
        n = int(torch.randint(1, C + 1, (1,), generator=g))
        ids = torch.randint(0, V - 1, (n,), generator=g).tolist()
        if n < C and bool(torch.rand(1, generator=g) < 0.5):
            ids.append(EOS)
        completion_ids.append(ids)
    return completion_ids


def fixed_rollouts(prompts: list[str], trainer) -> dict:
    """GRPO's ``rollout_func`` giving ``fixed_completions``."""
    tok = trainer.processing_class
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    completion_ids = fixed_completions(prompt_ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def score(prompts, completions, completion_ids, **kwargs) -> list[float]:
    return [float((sum(ids) * 7 + len(ids)) % 5) for ids in completion_ids]


def grpo_args(tmp: str, rloo: bool = False, **kw):
    from trl import GRPOConfig, RLOOConfig

    base = dict(
        output_dir=tmp, per_device_train_batch_size=8, num_generations=G, max_completion_length=C,
        use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", max_steps=2, seed=3,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", disable_tqdm=True,
    )  # fmt: skip
    return (RLOOConfig if rloo else GRPOConfig)(**{**base, **kw})


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
    from trl import GRPOTrainer, RLOOTrainer
    from trl.trainer import grpo_trainer, rloo_trainer

    from tsp_ext import TSPGRPOTrainer, TSPRLOOTrainer

    settings = dict(ALL_CASES[name])
    lora, rloo = settings.pop("lora", False), settings.pop("rloo", False)
    batch = 8 if tsp is None else 8 // dp
    args = grpo_args(
        f"{tmp}/{name}_{tsp}_{dp}", rloo, per_device_train_batch_size=batch, **settings
    )
    model = build("llama", torch.float64, vocab_size=V)
    kw = dict(reward_funcs=[score], args=args, train_dataset=prompts_dataset())
    kw["processing_class"] = word_tokenizer(V)
    if not rloo:  # RLOO takes no rollout function: its generation is replaced below
        kw["rollout_func"] = fixed_rollouts
    if lora:
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)
    if tsp is None:
        module = rloo_trainer if rloo else grpo_trainer
        initial, load = copy.deepcopy(model), module.create_model_from_path
        module.create_model_from_path = lambda *a, **k: copy.deepcopy(initial)  # the hub
        try:
            trainer = (RLOOTrainer if rloo else GRPOTrainer)(model, **kw)
        finally:
            module.create_model_from_path = load
        base = trainer.model.get_base_model() if lora else trainer.model
        for m in (base, trainer.ref_model):
            if m is not None:
                exact_fused_head(m, args.temperature)
    else:
        config = TSPConfig(tsp_size=tsp, loss_chunk=16)
        kind = TSPRLOOTrainer if rloo else TSPGRPOTrainer
        trainer = kind(model, tsp=config, data_parallel=data_parallel, **kw)
    if rloo:
        trainer._generate_single_turn = lambda prompt_ids, *args: fixed_completions(prompt_ids)
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


def dp_worker(rank, world, tmp, ref, data_parallel):
    """``dapo_kl`` at tsp = 2 x dp = 2: each replica holds half of the rows."""
    logs, adv, _, grads = run_case(tmp, "dapo_kl", 2, dp=2, data_parallel=data_parallel)
    ref_logs, ref_adv, _, ref_grads = ref
    replica = dist.get_rank() // 2  # its rows: the replica's half of every round
    errs = compare(
        (logs, adv, [], grads), (ref_logs, [a.view(2, -1)[replica] for a in ref_adv], [], ref_grads)
    )
    for step, (a, b) in enumerate(zip(logs, ref_logs, strict=True)):  # each replica's loss
        errs[f"loss@{step}"] = abs(a["loss"] - b["loss"]) / abs(b["loss"])  # averaged: float32
    return errs


def engines_worker(rank, world, tmp):
    """Two steps with rollouts generated at tsp = 2 x dp = 2 under FSDP2 and ZeRO-2 (float32):
    their logs; ZeRO-3's refusal."""
    from test_trainer import ZERO2

    from tsp_ext import TSPGRPOTrainer

    out = {}
    for name, engine in (("fsdp2", {"data_parallel": "fsdp2", "tsp": 2}), ("zero2", {})):
        ds = {} if engine else {"deepspeed": ZERO2}
        args = grpo_args(f"{tmp}/{name}", per_device_train_batch_size=4, beta=0.1, **ds)
        model = build("llama", torch.float32, vocab_size=V)
        data = dict(train_dataset=prompts_dataset(), processing_class=word_tokenizer(V))
        trainer = TSPGRPOTrainer(model, reward_funcs=[score], args=args, **data, **engine)
        trainer.train()
        keys = ("loss", "reward", "reward_std", "kl", "completions/mean_length")
        out[name] = [h[k] for h in trainer.state.log_history if "loss" in h for k in keys]
    zero3 = {**ZERO2, "zero_optimization": {"stage": 3}}
    args = grpo_args(f"{tmp}/zero3", per_device_train_batch_size=4, deepspeed=zero3)
    model = build("llama", torch.float32, vocab_size=V)
    data = dict(train_dataset=prompts_dataset(), processing_class=word_tokenizer(V))
    out["zero3"] = error_message(lambda: TSPGRPOTrainer(model, [score], args, **data))
    return out


@pytest.mark.parametrize("data_parallel", ["fsdp2"])
def test_grpo_over_dp_replicas_matches_trl(workers, tmp, data_parallel):
    """tsp = 2 x dp = 2 (FSDP2 over dp): rewards gathered over the replicas, not the TSP copies
    (group statistics, token counts); every gradient equals one-process TRL's on all rows; the
    logged loss (float32) to its precision. Then rollouts generated under FSDP2 (its shards
    gathered for the round) and ZeRO-2 train alike; ZeRO-3 is refused."""
    ref = references(workers, tmp)["dapo_kl"]
    for errs in workers.run(dp_worker, 4, tmp, ref, data_parallel, timeout=300):
        loss = {k: v for k, v in errs.items() if k.startswith("loss@")}
        assert max(loss.values()) < 1e-6, loss
        assert max(v for k, v in errs.items() if k not in loss) < 1e-10, errs
    runs = workers.run(engines_worker, 4, tmp, timeout=300)
    for run in runs:
        assert run["fsdp2"] == pytest.approx(runs[0]["zero2"], rel=1e-5, abs=1e-6), run
        assert len(run["fsdp2"]) == 10 and run["fsdp2"][8] > 0  # the policy moved: KL
        assert "use ZeRO stage 1 or 2" in run["zero3"]


# --- rollouts by the TSP model's generate(), memory, bad input ------------------------------


def trainer_for(tmp: str, model, world: int, **kw):
    from tsp_ext import TSPGRPOTrainer

    reward_funcs = kw.pop("reward_funcs", [score])
    tsp = TSPConfig(tsp_size=world, loss_chunk=kw.pop("loss_chunk", 1024))
    data = dict(train_dataset=kw.pop("train_dataset", prompts_dataset()))
    data["processing_class"] = word_tokenizer(V)
    if "reward_processing_classes" in kw:
        data["reward_processing_classes"] = kw.pop("reward_processing_classes")
    args = grpo_args(tmp, **kw)
    return TSPGRPOTrainer(model, reward_funcs=reward_funcs, args=args, tsp=tsp, **data)


def left_padded(prompts: list[str]):
    tok = word_tokenizer(V)
    tok.padding_side = "left"
    return tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


def until_eos(rows: torch.Tensor) -> list[list[int]]:
    """TRL's completions: each row up to and with its first EOS."""
    out = []
    for row in rows.tolist():
        out.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return out


def rollout_worker(rank, world, tmp):
    """Greedy rollouts of the trainer against the one-process model (and its KV cache: 1/D per
    rank), then sampled rollouts (top-k, top-p, min-p, repetition penalty) after a different
    seed on each rank."""
    import tsp_ext.hf.generate as tsp_generate

    model = build("llama", torch.float64, vocab_size=V)
    prompts = prompts_dataset()["prompt"][:4]
    inputs = left_padded(prompts)
    plain = copy.deepcopy(model).eval()
    ref = plain.generate(
        **inputs, max_new_tokens=C, do_sample=False, eos_token_id=EOS, pad_token_id=EOS,
        return_dict_in_generate=True,
    )  # fmt: skip
    ref_kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in ref.past_key_values.layers)
    trainer = trainer_for(f"{tmp}/rollouts", model, world, generation_kwargs={"do_sample": False})
    caches = []

    class Recorded(tsp_generate.TSPCache):
        def __init__(self, model) -> None:
            super().__init__(model)
            caches.append(self)

    tsp_generate.TSPCache, cache_class = Recorded, tsp_generate.TSPCache
    try:
        with trainer._replicas():
            greedy = trainer._generate(prompts)[1]
            sampling = dict(do_sample=True, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
            trainer.generation_config.update(**sampling)  # TRL's settings, as GRPOConfig sets them
            trainer.generation_kwargs.update(sampling)
            torch.manual_seed(100 + rank)
            sampled = trainer._generate(prompts)[1]
    finally:
        tsp_generate.TSPCache = cache_class
    width = inputs["input_ids"].shape[1]
    return {
        "greedy": greedy == until_eos(ref.sequences[:, width:]),
        "sampling changed them": sampled != greedy,
        "kv": (caches[0].kv_bytes() * world, ref_kv),
        "sampled": sampled,
    }


def memory_worker(rank, world, tmp):
    """One step (rollouts, scoring by policy / old policy / reference, loss, backward) with a
    vocabulary of 1024: the largest tensor any op makes, against one [S/D, V] logits block (the
    ring's blocks are [loss_chunk, V/D]: 16 tokens here, as S/D is small);
    the reference's weights (1/D, frozen) and what the rollout round saves for backward."""

    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tsp_ext.memory import SavedTensorBytes

    vocab, new = 1024, 160  # [S/D, V] well above the 1/D weights (a flat gradient bucket)
    model = build("llama", torch.float32, vocab_size=vocab)
    judge = LlamaForSequenceClassification(  # a reward model, beside a reward function
        LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=V, num_labels=1, pad_token_id=EOS,
        )
    )  # fmt: skip
    judged = []
    judge.register_forward_hook(lambda *args: judged.append(args[2].logits.shape[0]))
    trainer = trainer_for(
        f"{tmp}/memory", model, world, max_completion_length=new, beta=0.1, num_iterations=2,
        per_device_train_batch_size=4, max_steps=1, loss_chunk=16, reward_funcs=[score, judge],
        reward_processing_classes=[None, word_tokenizer(V)],
    )  # fmt: skip
    saved, largest = SavedTensorBytes(), LargestTensor()
    score_round, training_step = trainer._generate_and_score_completions, trainer.training_step

    def measured_round(inputs):
        with saved:
            return score_round(inputs)

    def measured_step(*args, **kwargs):  # rollouts, scoring, loss and backward; not the update
        with largest:
            return training_step(*args, **kwargs)

    trainer._generate_and_score_completions = measured_round
    trainer.training_step = measured_step
    trainer.train()
    policy = {n: p for n, p in trainer.model.named_parameters()}
    ref = dict(trainer.ref_model.named_parameters())
    longest = left_padded(list(prompts_dataset()["prompt"]))["input_ids"].shape[1] + new
    local = -(-longest // (2 * world)) * 2  # tokens per rank (zigzag: a multiple of 2D)
    return {
        "largest": largest.numel,
        "logits_block": local * vocab,
        "ref_is_policy_shape": all(ref[n].shape == p.shape for n, p in policy.items()),
        "ref_frozen": not any(p.requires_grad for p in ref.values()),
        "saved_in_rollouts": saved.nbytes,
        "judged": sum(judged),
    }


def test_grpo_rollouts_and_memory(workers, tmp):
    """Greedy rollouts equal the one-process model's token for token; sampled ones agree on
    every rank of the TSP group although each rank was seeded apart; the KV cache is 1/D per
    rank. No tensor of a GRPO step reaches [S/D, V] (logits), the reference is 1/D and frozen,
    the rollout round (generation and no-grad scoring) saves nothing for backward, and a reward
    model scores each row once per TSP group."""
    runs = workers.run(rollout_worker, 2, tmp, timeout=240)
    for run in runs:
        assert run["greedy"] is True
        assert run["kv"][0] == run["kv"][1] > 0, run["kv"]
        assert run["sampled"] == runs[0]["sampled"]
    assert runs[0]["sampling changed them"]
    for rank, mem in enumerate(workers.run(memory_worker, 2, tmp, timeout=240)):
        assert mem["largest"] < mem["logits_block"], mem
        assert mem["ref_is_policy_shape"] and mem["ref_frozen"], mem
        assert mem["saved_in_rollouts"] == 0, mem
        assert mem["judged"] == (4 if rank == 0 else 0), mem  # once per TSP group: its 4 rows


def errors_worker(rank, world, tmp):
    """Bad input: refused with a clear error, on every rank at once."""
    from transformers import TrainerCallback

    model = build("llama", torch.float32, vocab_size=V)
    msgs = {}

    def refused(**kw):
        return error_message(lambda: trainer_for(f"{tmp}/errors", copy.deepcopy(model), 2, **kw))

    msgs["divide"] = refused(per_device_train_batch_size=2, num_generations=4)
    msgs["vllm"] = refused(use_vllm=True)
    msgs["fp32 head"] = refused(cast_lm_head_to_fp32=True)
    questions = prompts_dataset().rename_column("prompt", "question")
    msgs["no prompt"] = refused(train_dataset=questions)
    trainer = trainer_for(f"{tmp}/errors", copy.deepcopy(model), world)
    prompts = list(prompts_dataset()["prompt"][:2])
    with trainer._replicas():
        mine = [p + " w1" * rank for p in prompts]  # another prompt length on each rank
        msgs["ranks differ"] = error_message(lambda: trainer._generate(mine))
        trainer.max_completion_length = 600  # the model has 512 positions
        msgs["too long"] = error_message(lambda: trainer._generate(prompts))

    def flaky(prompts, completions, **kwargs):
        if dist.get_rank() == world - 1:
            raise RuntimeError("judge unreachable")
        return [0.0] * len(prompts)

    class Stop(TrainerCallback):  # the step must not be reached
        def on_step_end(self, args, state, control, **kw):
            raise AssertionError("trained past a failed reward")

    trainer = trainer_for(f"{tmp}/errors", copy.deepcopy(model), 1, reward_funcs=[flaky])
    msgs["reward"] = error_message(lambda: (trainer.add_callback(Stop()), trainer.train()))
    return msgs


def test_grpo_bad_input_is_refused_on_every_rank(workers, tmp):
    for msgs in workers.run(errors_worker, 2, tmp, timeout=180):
        assert "num_generations (4) does not divide" in msgs["divide"], msgs
        assert "drop use_vllm" in msgs["vllm"]
        assert "drop it" in msgs["fp32 head"]
        assert (
            "train_dataset has no 'prompt' column (its columns: ['question'])" in msgs["no prompt"]
        )
        assert "hold different prompts" in msgs["ranks differ"]
        assert "beyond the model's 512" in msgs["too long"]
        assert "RuntimeError: judge unreachable" in msgs["reward"]
