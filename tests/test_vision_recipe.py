"""``recipes/sft_vision.py``: TRL's SFTTrainer fine-tuning a vision-language model under TSP."""

from __future__ import annotations

import json
import os

import pytest
from test_recipe import ROOT, run_on

pytestmark = pytest.mark.multiproc

RECIPE = os.path.join(ROOT, "recipes", "sft_vision.py")
TINY = ["--samples", "6", "--images-per-sample", "4", "--max-steps", "4", "--eval-every", "2"]


def read(out_dir: str, name: str) -> list[dict]:
    with open(os.path.join(out_dir, name)) as f:
        return [json.loads(line) for line in f]


def test_trl_sft_of_a_vlm_under_tsp_equals_one_process_and_exports(workers, tmp):
    """TSP = 2 (each rank 1/2 of the language model, the tokens and the images) gives the
    one-process curve; the export reloads in one plain process with the recipe's eval loss."""
    runs = {}
    for tsp in (2, 1):
        out = f"{tmp}/tsp{tsp}"
        done = run_on(
            workers, *TINY, "--tsp-size", str(tsp), "--output-dir", out,
            processes=tsp, script=RECIPE,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:]
        runs[tsp] = read(out, "metrics.jsonl")
    assert [r["step"] for r in runs[2]] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "eval_loss"):
        got, ref = ([r[key] for r in rows if key in r] for rows in (runs[2], runs[1]))
        assert got == pytest.approx(ref, rel=1e-5), key
    assert runs[2][-1]["loss"] < runs[2][0]["loss"]
    final = read(f"{tmp}/tsp2", "final_eval.json")[0]
    assert reloaded_eval_loss(final["checkpoint"]) == pytest.approx(final["eval_loss"], rel=1e-5)
    # the export fine-tuned further, read shard-on-read with its processor
    again = f"{tmp}/again"
    done = run_on(
        workers, *TINY, "--tsp-size", "2", "--model", final["checkpoint"], "--output-dir", again,
        script=RECIPE,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert read(again, "metrics.jsonl")[1]["eval_loss"] < final["eval_loss"]


def reloaded_eval_loss(path: str) -> float:
    """The held-out loss of the exported model and processor in this plain process, as TRL's
    collator and Trainer's evaluation compute it (token mean over the held-out samples)."""
    import sys

    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from _vision import shapes

    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    held_out = shapes(6 + 4, 4, 56, 0)[-4:]
    losses = []
    with torch.no_grad():
        for row in held_out:
            batch = processor(images=row["images"], text=[row["text"]], return_tensors="pt")
            losses.append(model(**batch, labels=batch["input_ids"]).loss)
    return float(torch.stack(losses).mean())
