"""``recipes/grpo.py``: its verifiable tasks and rewards, and the recipe end to end on 2 processes
(D = 2, LoRA, a tiny preset)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

from _tasks import TASKS, answer_only, correct_answer, file_dataset, task_dataset  # noqa: E402


@pytest.mark.parametrize("task", sorted(TASKS))
def test_tasks_are_seeded_and_their_answers_score_one(task):
    rows = task_dataset(task, 8, digits=2, seed=3)
    assert rows.to_dict() == task_dataset(task, 8, digits=2, seed=3).to_dict()
    assert rows["prompt"] != task_dataset(task, 8, digits=2, seed=4)["prompt"]
    prompts, answers = rows["prompt"], rows["answer"]
    assert len({p.rsplit("\n", 1)[0] for p in prompts}) == 1  # the same worked examples
    right = [f" {a}\n{a} ->" for a in answers]  # the answer first, then more text
    assert correct_answer(prompts, right, answer=answers) == [1.0] * 8
    assert answer_only(prompts, right) == [0.0] * 8
    assert answer_only(prompts, [f" {a}." for a in answers]) == [1.0] * 8
    wrong = [f" x{a}" for a in answers]
    assert correct_answer(prompts, wrong, answer=answers) == [0.0] * 8


def test_add_answers_are_the_sums():
    rows = task_dataset("add", 16, digits=3, seed=0)
    for prompt, answer in zip(rows["prompt"], rows["answer"]):
        a, b = prompt.rsplit("\n", 1)[1].removesuffix(" =").split(" + ")
        assert int(a) + int(b) == int(answer) and int(a) < 1000 and int(b) < 1000


def test_dataset_files_need_a_prompt_and_an_answer(tmp):
    good, bad = f"{tmp}/good.jsonl", f"{tmp}/bad.jsonl"
    with open(good, "w") as f:
        f.writelines(json.dumps({"prompt": f"{i} + 1 =", "answer": i + 1}) + "\n" for i in range(3))
    with open(bad, "w") as f:
        f.write(json.dumps({"prompt": "1 + 1 ="}) + "\n")
    assert list(file_dataset(f"json:{good}")["answer"]) == ["1", "2", "3"]
    with pytest.raises(SystemExit, match="no answer column"):
        file_dataset(bad)
    with pytest.raises(SystemExit, match="no file matches"):
        file_dataset(f"{tmp}/none-*.jsonl")


def test_documented_run_table_is_its_json():
    """docs/recipes.md's table of the SmolLM2 run: 10-step means of the rows of its JSON."""
    from checks import table

    with open(os.path.join(ROOT, "docs", "benchmarks", "grpo_smollm2.json")) as f:
        curve = json.load(f)
    rows = table("docs/recipes.md", "| steps | mean reward |")
    assert len(rows) * 10 == len(curve["steps"]) == curve["settings"]["max_steps"]
    keys = ("reward", "frac_reward_zero_std", "kl", "entropy")
    for i, (steps, *cells) in enumerate(rows):
        block = curve["steps"][10 * i : 10 * i + 10]
        assert steps == f"{block[0]['step']}–{block[-1]['step']}"
        means = [sum(r[k] for r in block) / len(block) for k in keys]
        assert cells == [f"{m:.{d}f}" for m, d in zip(means, (3, 2, 4, 3))]
    final = curve["final_eval"]
    text = " ".join(open(os.path.join(ROOT, "docs", "recipes.md")).read().split())
    before, after = final["eval_reward_before"], final["eval_reward"]
    assert f"went from {before:.3f} before training to {after:.3f} after" in text
    seconds = [r["step_s"] for r in curve["steps"]]
    peak = max(r["peak_mem_bytes"] for r in curve["steps"]) / 2**20
    assert (
        f"steps of {min(seconds):.0f}–{max(seconds):.0f} s ({sum(seconds) / len(seconds):.1f} s "
        f"on average), peak process memory {peak:.0f} MB per rank"
    ) in text


@pytest.mark.multiproc
def test_grpo_recipe_trains_two_steps_and_exports(workers, tmp):
    """Two GRPO steps of a tiny preset with LoRA at D = 2 (β > 0: the adapters-disabled
    reference, KL logged; the format reward on): the per-step rows with finite rewards, the
    log line, the held-out reward before and after, the merged checkpoint and the adapter; then
    ``reward_curve.py`` collects the run into its JSON and PNG."""
    from test_recipe import run_on

    out = f"{tmp}/grpo"
    args = ["--model", "tiny-llama", "--vocab-size", "300", "--prompts", "16"]
    args += ["--eval-prompts", "1", "--num-generations", "4", "--max-completion-length", "6"]
    args += ["--beta", "0.05", "--format-reward", "0.5", "--max-steps", "2", "--warmup-steps", "1"]
    args += ["--lr", "1e-3", "--lora-r", "4", "--tsp-size", "2", "--output-dir", out]
    done = run_on(workers, *args, script=os.path.join(ROOT, "recipes", "grpo.py"))
    assert done.returncode == 0, done.stdout[-3000:]
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    keys = ("reward", "reward_std", "rewards/correct_answer/mean", "rewards/answer_only/mean")
    for row in rows:
        assert all(math.isfinite(row[k]) for k in (*keys, "kl", "entropy", "loss"))
        assert 0.0 <= row["reward"] <= 1.5 and 0.0 <= row["clip_ratio/region_mean"] <= 1.0
        assert 0 < row["completions/mean_length"] <= 6
    assert "reward" in done.stdout and "length" in done.stdout and "kl" in done.stdout
    assert "held-out evaluation: batch 1, 4 completions" in done.stdout  # progress shown
    assert "tokens/s" in done.stdout and "held-out reward after training" in done.stdout
    with open(f"{out}/final_eval.json") as f:
        final = json.load(f)
    assert all(0.0 <= final[k] <= 1.5 for k in ("eval_reward_before", "eval_reward"))
    assert os.path.isfile(f"{out}/final/config.json")  # merged
    assert os.path.isfile(f"{out}/final-adapter/adapter_config.json")
    from reward_curve import main as reward_curve

    reward_curve([out, "--json", f"{out}/curve.json", "--png", f"{out}/curve.png"])
    with open(f"{out}/curve.json") as f:
        curve = json.load(f)
    assert curve["steps"] == rows and curve["final_eval"] == final
    assert curve["settings"]["beta"] == 0.05 and os.path.getsize(f"{out}/curve.png") > 0
