"""Long-context DPO with TRL's DPOTrainer and TSP.

    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/dpo.py \
        --tsp-size 2 --seq-len 2048 --max-steps 20

Offline by default: preference pairs built from the recipes' text data, a long prompt (a stretch of
a play) followed by its true continuation (chosen) or by a line from elsewhere (rejected).
``--dataset`` with preference pairs (``prompt`` / ``chosen`` / ``rejected`` columns; a hub dataset
or local ``json:`` / ``csv:`` / ``parquet:`` files) trains on those instead; plain-text data has
pairs built from it as from the plays. ``--lora-r`` trains a LoRA adapter (the reference is then
the base model, adapters disabled); without it every weight trains against a frozen folded copy.
Every step's loss, reward margin and accuracy go to ``metrics.jsonl`` and the log; the end exports
a Hugging Face checkpoint (``final``; with LoRA merged, and the adapter in ``final-adapter``).
See docs/preference.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random

from _args import DEEPSPEED_INSTEAD, add_data_parallel_arg, add_shared_args, trainer_settings
from _data import documents, load_rows, preference_rows
from _finish import finish, start
from _metrics import peak_memory_bytes
from _model import build_tokenizer, lora_config, preset_model, pretrained_model
from _presets import PRESETS
from _warmup import WarmupFromFirstStep
from datasets import Dataset
from transformers import TrainerCallback

from tsp_ext import TSPConfig, TSPDPOTrainer, init_tsp_mesh, save_pretrained

log = logging.getLogger("dpo")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_args(p)
    p.add_argument("--beta", type=float, default=0.1, help="DPO's β")
    p.add_argument("--loss-type", default="sigmoid", help="TRL's loss_type (sigmoid, ipo, ...)")
    p.add_argument("--completion-len", type=int, default=64, help="tokens per built completion")
    p.add_argument("--pairs", type=int, default=64, help="preference pairs built from the text")
    add_data_parallel_arg(p, ("ddp", "fsdp2"), DEEPSPEED_INSTEAD)
    p.add_argument("--output-dir", default="outputs/dpo")
    p.set_defaults(max_steps=20, lr=5e-4, eval_every=10, seq_len=2048)
    return p.parse_args(argv)


def built_pairs(texts: list[str], tokenizer, args) -> Dataset:
    """``--pairs`` pairs: a prompt of ``seq_len - completion_len - 1`` tokens from the text
    stream, its true next ``completion_len`` tokens (chosen) and as many tokens from a random
    other place (rejected), decoded back to text for TRL to tokenize."""
    stream = [i for t in texts for i in tokenizer(t)["input_ids"]]
    n_prompt, n_out = args.seq_len - args.completion_len - 1, args.completion_len
    span = n_prompt + n_out
    if len(stream) < 2 * span:
        raise SystemExit(f"the data has {len(stream)} tokens: lower --seq-len")
    rng = random.Random(args.seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(args.pairs):
        i, j = rng.randrange(len(stream) - span), rng.randrange(len(stream) - n_out)
        rows["prompt"].append(tokenizer.decode(stream[i : i + n_prompt]))
        rows["chosen"].append(tokenizer.decode(stream[i + n_prompt : i + span]))
        rows["rejected"].append(tokenizer.decode(stream[j : j + n_out]))
    return Dataset.from_dict(rows)


class Progress(TrainerCallback):
    """Per step: loss, reward margin and accuracy in the log and in ``metrics.jsonl``."""

    KEYS = ("loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "grad_norm")

    def __init__(self, path: str) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        row = {"step": state.global_step, **{k: logs.get(k) for k in self.KEYS}}
        row["peak_mem_bytes"] = peak_memory_bytes()
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        log.info(
            f"step {row['step']}/{state.max_steps}  loss {row['loss']:.4f}  "
            f"margin {row['rewards/margins']:+.4f}  accuracy {row['rewards/accuracies']:.2f}"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    acc, owns_group = start(args, args.seq_len)
    rows = load_rows(args.dataset)
    pairs = preference_rows(rows, args.text_column, args.dataset)  # None: plain text
    texts = documents(rows, args.text_column, args.dataset)
    tokenizer = build_tokenizer(args, texts, acc)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    if pairs is None:
        pairs = built_pairs(texts, tokenizer, args)
    n_eval = max(1, min(args.eval_blocks, len(pairs) // 8))
    split = pairs.train_test_split(test_size=n_eval, shuffle=False)

    config = TSPConfig(tsp_size=args.tsp_size, quantize_base="nf4" if args.qlora else None)
    if args.model in PRESETS:  # the trainer makes it (and the reference) TSP models
        model, ref = preset_model(args, len(tokenizer)), None
    else:  # each rank reads only its slices; full fine-tuning reads the reference too
        mesh = init_tsp_mesh(args.tsp_size)
        model = pretrained_model(args, len(tokenizer), mesh, config)
        ref = None if args.lora_r else pretrained_model(args, len(tokenizer), mesh, config)
    from trl import DPOConfig

    dpo_args = DPOConfig(
        **trainer_settings(args),
        beta=args.beta,
        loss_type=[args.loss_type],
        max_length=args.seq_len,
        save_strategy="no",
    )
    os.makedirs(args.output_dir, exist_ok=True)
    trainer = TSPDPOTrainer(
        model,
        ref_model=ref,
        args=dpo_args,
        train_dataset=split["train"],
        eval_dataset=split["test"],
        processing_class=tokenizer,
        callbacks=[
            Progress(os.path.join(args.output_dir, "metrics.jsonl")),
            WarmupFromFirstStep(args.warmup_steps),
        ],
        tsp=config,
        data_parallel=args.data_parallel,
        peft_config=lora_config(args),
    )
    dp = acc.num_processes // args.tsp_size
    log.info(
        f"{args.model}: {len(split['train'])} preference pairs of up to {args.seq_len} tokens; "
        f"dp={dp} x tsp={args.tsp_size} with {args.data_parallel}, "
        f"{'LoRA' if args.lora_r else 'full fine-tuning'}"
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    final = os.path.join(args.output_dir, "final")
    if args.lora_r:  # the adapter (PEFT format) and the merged model
        trainer.save_model(f"{final}-adapter")
        save_pretrained(trainer.model, final, tokenizer, merge_adapter=True)
    else:
        trainer.save_model(final)
    log.info(f"final eval DPO loss {eval_loss:.4f}; Hugging Face checkpoint: {final}")
    finish(acc, args.output_dir, eval_loss, final, owns_group)


if __name__ == "__main__":
    main()
