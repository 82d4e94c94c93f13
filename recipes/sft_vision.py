"""Vision-language SFT with TRL's SFTTrainer and TSP: images and their captions, long sequences.

    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/sft_vision.py \\
        --tsp-size 2 --images-per-sample 16 --max-steps 40

TRL's own vision collator (the processor turns each sample's images into ``pixel_values`` and
placeholder tokens); the only TSP lines are the trainer class (``TSPTrainerMixin`` in front of
``SFTTrainer``) and its ``tsp=`` argument: each rank holds 1/D of the language model and of the
tokens, and encodes 1/D of the images. ``--model`` is the ``tiny-llava`` preset (random weights,
a BPE trained on the captions) or a Qwen2.5-VL / Qwen3-VL / LLaVA checkpoint with its
processor. ``--dataset shapes`` draws coloured shapes offline; a
JSON-lines file of ``{"images": [paths], "text": ...}`` rows (each image behind its
placeholder in the text) trains on your own. Writes ``metrics.jsonl`` and a Hugging Face
export (``final/``, with the processor). See docs/vision.md.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from _args import trainer_settings
from _finish import finish, start
from _metrics import TrainerRows
from _vision import VLM_PRESETS, load_image_rows, preset_model, preset_processor, pretrained, shapes
from _warmup import WarmupFromFirstStep
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from tsp_ext import TSPConfig, TSPTrainerMixin

log = logging.getLogger("sft_vision")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llava", help=f"{list(VLM_PRESETS)} or a checkpoint")
    p.add_argument("--dataset", default="shapes", help="'shapes' or a JSON-lines file")
    p.add_argument("--samples", type=int, default=64, help="shapes: samples drawn")
    p.add_argument("--images-per-sample", type=int, default=8, help="shapes: images per sample")
    p.add_argument("--image-size", type=int, default=56, help="shapes / presets: pixels a side")
    p.add_argument("--vocab-size", type=int, default=512, help="presets: the BPE's vocabulary")
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--tsp-size", type=int, default=2)
    p.add_argument("--freeze-vision", action="store_true", help="train the language model only")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="outputs/sft_vision")
    return p.parse_args(argv)


class TSPSFTTrainer(TSPTrainerMixin, SFTTrainer):
    pass


def model_and_processor(args, texts: list[str], tsp: TSPConfig, acc):
    """The ``--model`` preset (its processor saved in ``<output-dir>/processor`` by the main
    process; the trainer makes it a TSP model) or checkpoint (read shard-on-read as a TSP
    model), with its processor."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.model not in VLM_PRESETS:
        return pretrained(args.model, tsp, dtype)
    from transformers import AutoProcessor

    path = os.path.join(args.output_dir, "processor")
    if acc.is_main_process:
        preset_processor(texts, args.vocab_size, path, args.image_size)
    acc.wait_for_everyone()
    processor = AutoProcessor.from_pretrained(path)
    return preset_model(args.model, processor, args.image_size, args.seed, dtype), processor


def main(argv=None) -> None:
    args = parse_args(argv)
    acc, owns_group = start(args, text_model=False)
    if args.dataset == "shapes":
        n = args.samples + args.eval_samples
        rows = shapes(n, args.images_per_sample, args.image_size, args.seed)
    else:
        rows = load_image_rows(args.dataset)
    os.makedirs(args.output_dir, exist_ok=True)
    tsp = TSPConfig(tsp_size=args.tsp_size)
    model, processor = model_and_processor(args, [r["text"] for r in rows], tsp, acc)
    if args.freeze_vision:
        for name, p in model.named_parameters():
            if "visual" in name or "vision_tower" in name or "projector" in name:
                p.requires_grad_(False)
    data = {"images": [r["images"] for r in rows], "text": [r["text"] for r in rows]}
    train = Dataset.from_dict({k: v[: -args.eval_samples] for k, v in data.items()})
    held_out = Dataset.from_dict({k: v[-args.eval_samples :] for k, v in data.items()})
    config = SFTConfig(
        **trainer_settings(args),
        lr_scheduler_type="cosine",
        save_strategy="no",
        max_length=None,  # never cut a sample's image tokens
        remove_unused_columns=False,
    )
    trainer = TSPSFTTrainer(
        model=model,
        args=config,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=processor,
        callbacks=[
            TrainerRows(os.path.join(args.output_dir, "metrics.jsonl")),
            WarmupFromFirstStep(args.warmup_steps),
        ],
        tsp=tsp,
    )
    log.info(
        f"{args.model}: {len(train)} samples of {args.images_per_sample} images; "
        f"tsp={args.tsp_size}, dp={acc.num_processes // args.tsp_size}"
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    if acc.is_main_process:
        processor.save_pretrained(final)
    log.info(f"final eval loss {eval_loss:.4f}; Hugging Face checkpoint: {final}")
    finish(acc, args.output_dir, eval_loss, final, owns_group)


if __name__ == "__main__":
    main()
