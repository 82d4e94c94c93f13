"""TSPTrainer (transformers.Trainer with TSP) vs the same Trainer script without TSP."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from models import batch, build, causal_lm_loss
from test_recipe import DATASET, run_on

pytestmark = pytest.mark.multiproc

STEPS, SEQ, ROWS, LR = 3, 24, 16, 1e-2
# DeepSpeed the Hugging Face way: TrainingArguments(deepspeed=...), "auto" from the arguments
ZERO2 = {
    "zero_optimization": {"stage": 2},
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "tsp": {"size": 2},
}


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


def make_trainer(tsp, out_dir, data_parallel="ddp", peft_config=None, **overrides):
    """2 sequences x 2 accumulation steps per replica and step, AdamW with clipping;
    ``data_parallel="zero2"`` / ``"zero3"``: ``TrainingArguments(deepspeed=ZERO2)`` / stage 3
    (``"zero3_offload"``: with ``offload_optimizer`` on the CPU)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from tsp_ext import TSPTrainer

    settings = dict(
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
    if data_parallel.startswith("zero"):  # "zero3_offload": the optimizer state on the CPU
        zero = {"stage": int(data_parallel[4])}
        if data_parallel.endswith("_offload"):
            zero["offload_optimizer"] = {"device": "cpu"}
        settings["deepspeed"], data_parallel = {**ZERO2, "zero_optimization": zero}, None
    model = build("llama", torch.float32)
    if peft_config is not None and not tsp:  # the reference: PEFT the way TSPTrainer does it
        from peft import get_peft_model

        torch.manual_seed(settings["seed"])
        model = get_peft_model(model, peft_config)
    kw = dict(
        model=model,
        args=TrainingArguments(**{**settings, **overrides}),
        train_dataset=rows(1, ROWS),
        eval_dataset=rows(2, 4),
        data_collator=default_data_collator,
    )
    if not tsp:
        return Trainer(**kw)
    return TSPTrainer(**kw, tsp=tsp, data_parallel=data_parallel, peft_config=peft_config)


def curve(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs]}


def trainer_run(rank, world, tsp, out_dir, data_parallel="ddp"):
    """The loss curve and the eval loss on 4 held-out sequences."""
    trainer = make_trainer(tsp, out_dir, data_parallel)
    trainer.train()
    return {**curve(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}


def tsp_runs_worker(rank, world, out_dir, data_parallel="ddp"):
    """D=2: train saving a checkpoint at step 2, export into the (occupied) output dir, then
    resume a fresh trainer from the checkpoint."""
    trainer = make_trainer(2, out_dir, data_parallel, save_strategy="steps", save_steps=2)
    trainer.train()
    out = {**curve(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
    trainer.save_model()
    resumed = make_trainer(2, out_dir, data_parallel, save_strategy="no")
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    out["resumed"] = curve(resumed)
    return out


def dp2_worker(rank, world, out_dir):
    """dp=2 x tsp=2 with DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 (checkpoint, export and resume)
    on the dp axis."""
    out = {
        dp: trainer_run(rank, world, 2, f"{out_dir}/{dp}", dp) for dp in ("ddp", "fsdp2", "zero2")
    }
    out["zero3"] = tsp_runs_worker(rank, world, f"{out_dir}/zero3", "zero3")
    return out


@functools.cache
def runs(workers, tmp: str) -> dict:
    return {
        "one_process": workers.run(trainer_run, 1, 0, f"{tmp}/one", timeout=300)[0],
        "tsp2": workers.run(tsp_runs_worker, 2, f"{tmp}/tsp2", timeout=300)[0],
        "zero2": workers.run(tsp_runs_worker, 2, f"{tmp}/zero2", "zero2", timeout=300)[0],
        "zero3_offload": workers.run(
            trainer_run, 2, 2, f"{tmp}/zero3_offload", "zero3_offload", timeout=300
        )[0],
    }


@functools.cache
def dp2_runs(workers, tmp: str) -> dict:
    return {
        "ddp": workers.run(trainer_run, 2, 0, f"{tmp}/ddp", timeout=300)[0],
        "tsp": workers.run(dp2_worker, 4, f"{tmp}/dp2", timeout=600)[0],
    }


def assert_same_curve(got: dict, ref: dict) -> None:
    assert len(got["loss"]) == STEPS
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


def checkpointed(workers, tmp: str, run: str) -> tuple[dict, str]:
    """A run that saved a checkpoint, exported and resumed, and its output dir: D=2 (dp=1) with
    DDP or DeepSpeed ZeRO-2, dp=2 x D=2 with ZeRO-3."""
    if run == "dp2_zero3":
        return dp2_runs(workers, tmp)["tsp"]["zero3"], f"{tmp}/dp2/zero3"
    return runs(workers, tmp)[run], f"{tmp}/{run}"


CHECKPOINTED = ["tsp2", "zero2", "dp2_zero3"]


@pytest.mark.parametrize("run", ["tsp2", "zero2", "zero3_offload"])
def test_trainer_loss_curve_matches_one_process(workers, tmp, run):
    """zero3_offload: ZeRO-3 with the optimizer state on the CPU, where Trainer's AdamW becomes
    DeepSpeed's CPU Adam with the same hyperparameters (as Accelerate does)."""
    got, ref = runs(workers, tmp)[run], runs(workers, tmp)["one_process"]
    assert_same_curve(got, ref)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("run", CHECKPOINTED)
def test_trainer_resumes_from_checkpoint(workers, tmp, run):
    got = checkpointed(workers, tmp, run)[0]
    resumed = got["resumed"]  # the log history of steps 1-2 comes back from the checkpoint
    assert resumed["loss"][:2] == got["loss"][:2]
    assert resumed["loss"][2:] == pytest.approx(got["loss"][2:], rel=1e-6)
    assert resumed["grad_norm"][2:] == pytest.approx(got["grad_norm"][2:], rel=1e-6)


@pytest.mark.parametrize("run", CHECKPOINTED)
def test_trainer_export_reloads_in_one_process(workers, tmp, run):
    from transformers import AutoModelForCausalLM, default_data_collator

    got, out_dir = checkpointed(workers, tmp, run)
    assert os.path.isdir(f"{out_dir}/checkpoint-2/tsp_state")  # kept by save_model()
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    data = default_data_collator(rows(2, 4))
    with torch.no_grad():
        loss = causal_lm_loss(model, data)
    assert loss.item() == pytest.approx(got["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp2", "zero2", "zero3"])
def test_trainer_dp2_matches_plain_ddp(workers, tmp, data_parallel):
    got, ref = dp2_runs(workers, tmp)["tsp"][data_parallel], dp2_runs(workers, tmp)["ddp"]
    assert_same_curve(got, ref)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


def lora_worker(rank, world, tsp, out_dir, data_parallel="ddp"):
    """``peft_config=LoraConfig(...)``, as TRL's trainers take it: the curve, the eval loss and
    the saved adapter (PEFT's format)."""
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    trainer = make_trainer(tsp, out_dir, data_parallel, peft_config=config)
    trainer.train()
    out = {**curve(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
    trainer.save_model()
    return out


def test_trainer_peft_config_matches_one_process_peft(workers, tmp):
    """TSPTrainer(peft_config=...) at D = 2 with ZeRO-2 vs Trainer on the same PEFT model in one
    process: the same curve; the adapter it saves reloads with PeftModel.from_pretrained."""
    from peft import PeftModel
    from transformers import default_data_collator

    ref = workers.run(lora_worker, 1, 0, f"{tmp}/lora-one", timeout=300)[0]
    got = workers.run(lora_worker, 2, 2, f"{tmp}/lora-tsp", "zero2", timeout=300)[0]
    assert_same_curve(got, ref)
    model = PeftModel.from_pretrained(build("llama", torch.float32), f"{tmp}/lora-tsp")
    with torch.no_grad():
        loss = causal_lm_loss(model, default_data_collator(rows(2, 4)))
    assert loss.item() == pytest.approx(got["eval_loss"], rel=1e-5)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "sft_trainer.py")
TINY = ["--seq-len", "512", "--vocab-size", "512", "--max-steps", "4", "--eval-every", "2"]
TINY += ["--warmup-steps", "1", "--tsp-size", "2", "--packing", "documents"]
TINY += ["--dataset", DATASET]  # four plays


def run_recipe(workers, *args: str) -> None:
    """``sft_trainer.py``'s ``main`` on the kept 2-process group, as ``accelerate launch``
    would run it (the start-up is most of a tiny run)."""
    done = run_on(workers, *TINY, *args, script=RECIPE)
    assert done.returncode == 0, done.stdout[-3000:]


def read_metrics(out_dir: str) -> list[dict]:
    import json

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_sft_recipe_trl_equals_trainer_and_export_reloads(workers, tmp):
    """TRL's SFTTrainer and transformers' Trainer with TSP (D=2, packed documents): the same
    curve; the export reloads in one plain process with the recipe's eval loss."""
    import json
    import subprocess
    import sys

    run_recipe(workers, "--trainer", "sft", "--output-dir", f"{tmp}/sft")
    run_recipe(workers, "--trainer", "hf", "--output-dir", f"{tmp}/hf")
    sft, hf = read_metrics(f"{tmp}/sft"), read_metrics(f"{tmp}/hf")
    assert [r["step"] for r in sft] == [1, 2, 3, 4]
    assert [r["step"] for r in sft if "eval_loss" in r] == [2, 4]
    for key in ("loss", "grad_norm", "eval_loss"):
        got, ref = ([r[key] for r in rows if key in r] for rows in (sft, hf))
        assert got == pytest.approx(ref, rel=1e-6), key
    with open(f"{tmp}/sft/final_eval.json") as f:
        final = json.load(f)
    evaluate = [sys.executable, os.path.join(ROOT, "recipes", "eval_checkpoint.py"), "--json"]
    evaluate += ["--checkpoint", final["checkpoint"], "--seq-len", "512"]
    evaluate += ["--packing", "documents", "--dataset", DATASET]
    out = subprocess.run(evaluate, capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(
        final["eval_loss"], rel=1e-5
    )


def test_deepspeed_configs_are_honoured_or_refused(tmp_path, monkeypatch):
    """A DeepSpeed config from `accelerate launch` reaches the recipe's DeepSpeed engine with
    its "tsp" size, and is refused where it would be dropped (TSPTrainer, --data-parallel ddp);
    TSPTrainer's own DeepSpeed config refuses what it cannot honour."""
    import json
    import sys

    from transformers import TrainingArguments

    from tsp_ext import TSPTrainer

    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import finetune_long_llama as recipe

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "tsp": {"size": 2}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))

    honoured = recipe.parse_args(["--data-parallel", "deepspeed"])
    recipe.resolve_ds_config(honoured)
    assert (honoured.ds_config, honoured.tsp_size) == (str(path), 2)
    with pytest.raises(SystemExit, match="pass --data-parallel deepspeed"):
        recipe.resolve_ds_config(recipe.parse_args([]))
    with pytest.raises(SystemExit, match='--tsp-size 4 disagrees with the "tsp" block'):
        recipe.resolve_ds_config(
            recipe.parse_args(["--data-parallel", "deepspeed", "--tsp-size", "4"])
        )
    with pytest.raises(ValueError, match="pass its config file as TrainingArguments"):
        TSPTrainer(model=build("llama"), args=args, tsp=2)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    with pytest.raises(ValueError, match="data_parallel='zero3': choose one of"):
        TSPTrainer(model=build("llama"), args=args, tsp=2, data_parallel="zero3")

    def ds_args(**config):
        return TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], deepspeed={**ZERO2, **config}
        )

    with pytest.raises(ValueError, match='"tsp" block has size 2 but the TSP size is 4'):
        TSPTrainer(model=build("llama"), args=ds_args(), tsp=4)
    with pytest.raises(ValueError, match='remove the "optimizer" block'):
        TSPTrainer(model=build("llama"), args=ds_args(optimizer={"type": "AdamW"}), tsp=2)
    with pytest.raises(ValueError, match="DeepSpeed runs when TrainingArguments has a deepspeed"):
        TSPTrainer(model=build("llama"), args=ds_args(), data_parallel="fsdp2")
