"""TSPTrainer (transformers.Trainer with TSP) vs the same Trainer script without TSP."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from models import batch, build, causal_lm_loss

from tsp_ext.testing.launch import run_processes

pytestmark = pytest.mark.multiproc

STEPS, SEQ, ROWS, LR = 3, 24, 16, 1e-2


def rows(seed: int, n: int) -> list[dict]:
    """``n`` sequences, every other one right-padded (labels -100 on the padding)."""
    data = batch(96, n, SEQ, seed=seed, pad_last=0)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[1::2, SEQ - 5 :] = 0
    labels = data["input_ids"].masked_fill(mask == 0, -100)
    return [
        {"input_ids": data["input_ids"][i], "attention_mask": mask[i], "labels": labels[i]}
        for i in range(n)
    ]


def trainer_run(rank, world, tsp, out_dir, data_parallel="ddp"):
    """STEPS steps of 2 sequences x 2 accumulation steps per replica, AdamW with clipping; then
    the eval loss on 4 held-out sequences and (TSP) the exported checkpoint."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from tsp_ext import TSPTrainer

    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        adam_epsilon=1e-6,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    kw = dict(
        model=build("llama", torch.float32),
        args=args,
        train_dataset=rows(1, ROWS),
        eval_dataset=rows(2, 4),
        data_collator=default_data_collator,
    )
    trainer = TSPTrainer(**kw, tsp=tsp, data_parallel=data_parallel) if tsp else Trainer(**kw)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out = {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "eval_loss": trainer.evaluate()["eval_loss"],
    }
    if tsp:
        trainer.save_model(os.path.join(out_dir, "hf"))
    return out


@functools.cache
def runs(tmp: str) -> dict:
    return {
        "one_process": run_processes(trainer_run, 1, 0, f"{tmp}/one", timeout=300)[0],
        "tsp2": run_processes(trainer_run, 2, 2, f"{tmp}/tsp2", timeout=300)[0],
    }


def test_trainer_loss_curve_matches_one_process(tmp):
    got, ref = runs(tmp)["tsp2"], runs(tmp)["one_process"]
    assert len(got["loss"]) == STEPS
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


def test_trainer_export_reloads_in_one_process(tmp):
    from transformers import AutoModelForCausalLM, default_data_collator

    got = runs(tmp)["tsp2"]
    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/tsp2/hf", dtype=torch.float32)
    data = default_data_collator(rows(2, 4))
    with torch.no_grad():
        loss = causal_lm_loss(model, data)
    assert loss.item() == pytest.approx(got["eval_loss"], rel=1e-5)
