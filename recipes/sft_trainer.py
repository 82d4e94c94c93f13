"""Long-context SFT with TRL's SFTTrainer (or transformers.Trainer) and TSP.

    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/sft_trainer.py \
        --tsp-size 2 --seq-len 4096 --max-steps 30

The same offline data, packing, ``metrics.jsonl`` and Hugging Face export as
``finetune_long_llama.py``, through a normal Trainer script: the only TSP lines are the trainer
class (``TSPTrainerMixin`` in front of ``SFTTrainer``) and its ``tsp=`` argument. See
docs/trainer.md.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from _args import DEEPSPEED_INSTEAD, add_data_parallel_arg, add_shared_args, trainer_settings
from _data import documents, load_blocks, load_rows
from _finish import finish, start
from _metrics import TrainerRows
from _model import build_tokenizer, lora_config, preset_model, pretrained_model
from _presets import PRESETS
from _warmup import WarmupFromFirstStep
from datasets import Dataset

from tsp_ext import TSPConfig, TSPTrainer, TSPTrainerMixin, init_tsp_mesh

log = logging.getLogger("sft_trainer")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=("sft", "hf"), default="sft", help="TRL or transformers")
    add_shared_args(p)
    add_data_parallel_arg(p, ("ddp", "fsdp2"), DEEPSPEED_INSTEAD)
    p.add_argument("--save-every", type=int, default=0, help="Trainer checkpoints (0: none)")
    p.add_argument("--output-dir", default="outputs/sft")
    p.add_argument("--resume-from", default=None, help="a checkpoint-<step> directory")
    p.set_defaults(max_steps=30, eval_every=10)
    return p.parse_args(argv)


class Collator:
    """Stacks packed rows; the targets are the inputs, ``-100`` on row-end padding."""

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}
        labels = batch["input_ids"].clone()
        if "attention_mask" in batch:
            labels[batch["attention_mask"] == 0] = -100
        return {**batch, "labels": labels}


def trainer_class(kind: str):
    if kind == "hf":
        return TSPTrainer
    try:
        from trl import SFTTrainer
    except ImportError:
        raise SystemExit(
            "--trainer sft needs TRL: pip install -e '.[trl]' (or --trainer hf)"
        ) from None

    class TSPSFTTrainer(TSPTrainerMixin, SFTTrainer):
        pass

    return TSPSFTTrainer


def training_args(args, kind: str):
    settings = trainer_settings(args)
    settings.update(
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500,
        remove_unused_columns=False,
    )
    if kind == "hf":
        from transformers import TrainingArguments

        return TrainingArguments(**settings)
    from trl import SFTConfig

    # the rows are tokenized and packed already (the same blocks as finetune_long_llama.py)
    return SFTConfig(**settings, dataset_kwargs={"skip_prepare_dataset": True}, max_length=None)


def main(argv=None) -> None:
    args = parse_args(argv)
    acc, owns_group = start(args, args.seq_len)
    rows = load_rows(args.dataset)  # a BPE trains on chats as role-prefixed lines
    tokenizer = build_tokenizer(args, documents(rows, args.text_column, args.dataset), acc)
    texts = documents(rows, args.text_column, args.dataset, tokenizer)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    blocks = load_blocks(texts, tokenizer, args.seq_len, args.packing)
    blocks = {k: v.tolist() for k, v in blocks.items()}
    n_eval = min(args.eval_blocks, len(blocks["input_ids"]) - 1)
    train = Dataset.from_dict({k: v[:-n_eval] for k, v in blocks.items()})
    held_out = Dataset.from_dict({k: v[-n_eval:] for k, v in blocks.items()})

    peft_config = lora_config(args)
    config = TSPConfig(tsp_size=args.tsp_size, quantize_base="nf4" if args.qlora else None)
    if args.model in PRESETS:  # the trainer makes it a TSP model
        model = preset_model(args, len(tokenizer))
    else:  # each rank reads only its slices
        model = pretrained_model(args, len(tokenizer), init_tsp_mesh(args.tsp_size), config)
    os.makedirs(args.output_dir, exist_ok=True)
    dp = acc.num_processes // args.tsp_size
    tokens = args.micro_batch_size * args.gradient_accumulation_steps * dp * args.seq_len
    trainer = trainer_class(args.trainer)(
        model=model,
        args=training_args(args, args.trainer),
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=Collator(),
        processing_class=tokenizer,
        callbacks=[
            TrainerRows(os.path.join(args.output_dir, "metrics.jsonl"), tokens),
            WarmupFromFirstStep(args.warmup_steps),
        ],
        tsp=config,
        data_parallel=args.data_parallel,
        peft_config=peft_config,
    )
    log.info(
        f"{args.model}: {len(train)} training blocks of {args.seq_len} tokens ({args.packing} "
        f"packing); dp={dp} x tsp={args.tsp_size} with {args.data_parallel}, "
        f"{type(trainer).__name__}"
    )
    trainer.train(resume_from_checkpoint=args.resume_from)
    eval_loss = trainer.evaluate()["eval_loss"]
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    log.info(f"final eval loss {eval_loss:.4f}; Hugging Face checkpoint: {final}")
    finish(acc, args.output_dir, eval_loss, final, owns_group)


if __name__ == "__main__":
    main()
