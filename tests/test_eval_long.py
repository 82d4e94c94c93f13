"""``recipes/eval_long.py``: perplexity by position and passkey retrieval under TSP give one
process's numbers (per-position losses fp64 to 1e-12, float32 to 1e-5; the same passkey answers)
at D = 2 and 4; the recipe end to end (TSP, replicas); clear errors on every rank."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

from _long_eval import (  # noqa: E402
    ANSWER_TOKENS,
    Passkeys,
    bucket_perplexity,
    long_documents,
    passkey_answer,
    position_nll,
    read_key,
)

SCRIPT = os.path.join(ROOT, "recipes", "eval_long.py")
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}
YARN["rope_theta"] = 10000.0
LENGTHS = (202, 250)  # passkey prompts (at least 178 tokens); 202 is no multiple of 2·D
DEPTHS = (0, 50, 100)


@functools.cache
def tokenizer_dir(tmp: str) -> str:
    """A BPE of 300 tokens trained on the plays, saved (the workers load it)."""
    from _data import SHAKESPEARE, load_texts, train_tokenizer

    path = os.path.join(tmp, "tokenizer")
    train_tokenizer(load_texts(SHAKESPEARE, "text"), 300).save_pretrained(path)
    return path


def tiny_llama(dtype: torch.dtype, vocab: int):
    """A YaRN-scaled tiny Llama (GQA, 256 positions), the same weights on every rank."""
    from models import build

    torch.manual_seed(0)
    model = build(
        "llama", dtype, vocab_size=vocab, max_position_embeddings=256, rope_parameters=YARN
    )
    model.generation_config.update(eos_token_id=None)  # always the full answer
    return model.eval()


def parity_worker(rank: int, world: int, tokenizer_path: str) -> dict:
    """Per dtype: the per-position losses of two rows and the passkey answers of a small grid,
    under TSP at D = world; rank 0 also returns the single-process model's."""
    from transformers import AutoTokenizer

    from tsp_ext import apply_tsp, init_tsp_mesh

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    mesh = init_tsp_mesh(world)
    keys = Passkeys(tok, seed=1)
    prompts = [keys.prompt(n, d, keys.key(n, d, 0)) for n in LENGTHS for d in DEPTHS]
    ids = torch.randint(0, len(tok), (2, 62), generator=torch.Generator().manual_seed(2))
    out = {}
    for dtype in (torch.float64, torch.float32):
        model = tiny_llama(dtype, len(tok))
        if rank == 0:
            out[dtype, "ref"] = measure(model, tok, ids, prompts)
        torch.manual_seed(100 + rank)  # each rank's own random state: nothing may read it
        out[dtype] = measure(apply_tsp(model, mesh), tok, ids, prompts)
    return out


def measure(model, tok, ids, prompts) -> tuple[torch.Tensor, list[str]]:
    return position_nll(model, ids), [passkey_answer(model, tok, p) for p in prompts]


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_losses_and_passkey_answers_match_one_process(workers, world, tmp):
    runs = workers.run(parity_worker, world, tokenizer_dir(tmp), timeout=300)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        ref_nll, ref_answers = runs[0][dtype, "ref"]
        assert ref_nll.shape == (2, 61) and len(ref_answers) == len(LENGTHS) * len(DEPTHS)
        for rank, run in enumerate(runs):
            nll, answers = run[dtype]
            torch.testing.assert_close(nll, ref_nll, rtol=tol, atol=tol)
            assert answers == ref_answers, f"D={world} rank={rank} {dtype}"


def test_passkey_prompts_have_their_length_and_depth(tmp):
    from transformers import AutoTokenizer

    keys = Passkeys(AutoTokenizer.from_pretrained(tokenizer_dir(tmp)), seed=0)
    key = keys.key(300, 50, 0)
    assert key == keys.key(300, 50, 0) != keys.key(300, 50, 1) and len(key) == 5
    needle = keys._ids(f" The pass key is {key}. Remember it. {key} is the pass key.")
    starts = []
    for depth in (0, 50, 100):
        ids = keys.prompt(300, depth, key)
        assert len(ids) == 300 - ANSWER_TOKENS and ids[-len(keys.question) :] == keys.question
        starts.append(next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle))
    fill = 300 - keys.shortest()
    assert starts == [len(keys.task) + round(d / 100 * fill) for d in (0, 50, 100)]
    with pytest.raises(SystemExit, match=f"need {keys.shortest()} tokens without any filler"):
        keys.prompt(keys.shortest() - 1, 0, key)
    assert read_key(" 12345. Remember") == "12345" and read_key(" the pass key") == ""


def test_list_flags_take_spaces_or_commas_and_every_flag_is_described():
    from eval_long import parse_args, parser

    args = ["--model", "ckpt", "--lengths", "1024", "2048,4096", "--depths", "0", "50", "100"]
    args = parse_args(args)
    assert args.lengths == [1024, 2048, 4096] and args.depths == [0, 50, 100]
    assert parse_args(["--model", "ckpt", "--lengths", "1024,2048"]).lengths == [1024, 2048]
    assert all(a.help for a in parser()._actions), "a flag without a description in --help"


def test_buckets_average_positions_and_documents():
    nll = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 2.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    rows = bucket_perplexity(nll, 2)  # positions 0-1 (token 1 only), 2-3, 4-5
    assert [(r["start"], r["end"]) for r in rows] == [(0, 2), (2, 4), (4, 6)]
    assert [r["nll"] for r in rows] == [2.0, 2.0, 2.5]  # columns 0; 1-2; 3-4
    assert rows[2]["ppl"] == pytest.approx(math.exp(2.5))


def test_long_documents_are_the_last_long_enough(tmp):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(tmp))
    texts = ["short", "a b " * 200, "tiny", "c d " * 300]
    docs = long_documents(texts, tok, 100, samples=1)
    assert docs == [tok(texts[3])["input_ids"][:100]]
    assert len(long_documents(texts, tok, 100, samples=5)) == 2
    with pytest.raises(SystemExit, match="no document of the dataset has 5000 tokens"):
        long_documents(texts, tok, 5000, samples=1)


@functools.cache
def checkpoint(tmp: str) -> str:
    """A tiny YaRN Llama saved with its tokenizer: what the recipe reads."""
    from transformers import AutoTokenizer

    path = os.path.join(tmp, "checkpoint")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(tmp))
    tiny_llama(torch.float32, len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def recipe(workers, tmp: str, *args: str):
    from test_recipe import run_on

    model = ("--model", checkpoint(tmp), "--lengths", ",".join(map(str, LENGTHS)))
    grid = ("--depths", ",".join(map(str, DEPTHS)), "--bucket", "50")
    return run_on(workers, *model, *grid, *args, script=SCRIPT)


@pytest.mark.multiproc
def test_recipe_gives_one_process_numbers_with_tsp_and_replicas(workers, tmp):
    """The recipe at TSP = 2 and at TSP = 1 with two replicas: its JSON's buckets and answers are
    those of the checkpoint in one plain process; tables, JSON and plots written."""
    from _data import SHAKESPEARE, load_texts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint(tmp))
    model = AutoModelForCausalLM.from_pretrained(checkpoint(tmp)).eval()
    model.generation_config.update(eos_token_id=None)
    doc = long_documents(load_texts(SHAKESPEARE, "text"), tok, LENGTHS[-1], 1)
    buckets = bucket_perplexity(position_nll(model, torch.tensor(doc)), 50)
    keys = Passkeys(tok, seed=0)
    answers = [
        passkey_answer(model, tok, keys.prompt(n, d, keys.key(n, d, 0)))
        for n in LENGTHS
        for d in DEPTHS
    ]
    for tsp in ("2", "1"):
        out = os.path.join(tmp, f"recipe-tsp{tsp}")
        done = recipe(workers, tmp, "--tsp-size", tsp, "--output-dir", out)
        assert done.returncode == 0, done.stdout[-3000:]
        assert "perplexity by position" in done.stdout and "passkey accuracy" in done.stdout
        with open(os.path.join(out, "eval_long.json")) as f:
            run = json.load(f)
        assert run["rope_parameters"]["rope_type"] == "yarn" and run["tsp_size"] == int(tsp)
        assert [r["start"] for r in run["ppl"]["buckets"]] == [r["start"] for r in buckets]
        for got, want in zip(run["ppl"]["buckets"], buckets):
            assert got["nll"] == pytest.approx(want["nll"], rel=1e-5)
        grid = run["passkey"]
        assert [a["answer"] for a in grid["answers"]] == answers
        assert grid["lengths"] == list(LENGTHS) and len(grid["accuracy"][0]) == len(DEPTHS)
        assert all(os.path.getsize(os.path.join(out, f)) > 0 for f in ("ppl.png", "passkey.png"))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "args, expected",
    [
        (("--lengths", "300"), "--lengths 300 is beyond .* max_position_embeddings=256"),
        (
            ("--lengths", "40", "--tasks", "passkey"),
            "--lengths 40: a passkey prompt and its answer need",
        ),
        (("--dataset", "text:{short}", "--tasks", "ppl"), "no document of the dataset has 250"),
    ],
)
def test_bad_input_stops_every_rank(workers, args, expected, tmp):
    short = os.path.join(tmp, "short.txt")
    with open(short, "w") as f:
        f.write("Too short to be long.")
    args = [a.format(short=short) for a in args]
    done = recipe(workers, tmp, *args, "--output-dir", os.path.join(tmp, "refused"))
    errors = [line for line in done.stdout.splitlines() if line]
    assert done.returncode == 1
    assert sum(bool(re.search(expected, e)) for e in errors) == 2, done.stdout[-2000:]
