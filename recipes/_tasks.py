"""Verifiable tasks for ``grpo.py``, generated offline from a seed: prompts with an exact answer
and TRL reward functions that check it.

A prompt is a header line, four worked examples (the same in every prompt) and the question,
e.g. for ``add``::

    Add the numbers.
    2 + 3 = 5
    ...
    37 + 48 =

and its ``answer`` is ``"85"``. A completion is scored by its first word: ``correct_answer``
gives 1.0 when it equals the answer (a trailing ``.`` dropped), else 0.0; ``answer_only``, the
optional format reward, gives 1.0 when the completion is that one word and nothing more (the
model stopped after answering).
"""

from __future__ import annotations

import glob
import random
from collections.abc import Callable

from datasets import Dataset, Value, load_dataset

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SHOTS = 4  # worked examples in every prompt


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randrange(3, 7)))


def _add(rng: random.Random, digits: int) -> tuple[str, str]:
    a, b = (rng.randrange(10**digits) for _ in range(2))
    return f"{a} + {b} =", str(a + b)


def _copy(rng: random.Random, digits: int) -> tuple[str, str]:
    w = _word(rng)
    return f"{w} ->", w


def _reverse(rng: random.Random, digits: int) -> tuple[str, str]:
    w = _word(rng)
    return f"{w} ->", w[::-1]


def _count(rng: random.Random, digits: int) -> tuple[str, str]:
    w = _word(rng)
    return f"{w}:", str(len(w))


# name -> (header line, a question and its answer from a random generator and --digits)
TASKS: dict[str, tuple[str, Callable[[random.Random, int], tuple[str, str]]]] = {
    "add": ("Add the numbers.", _add),
    "copy": ("Repeat the word.", _copy),
    "reverse": ("Reverse the letters.", _reverse),
    "count": ("Count the letters.", _count),
}


def task_dataset(task: str, n: int, digits: int, seed: int) -> Dataset:
    """``n`` rows of ``prompt`` / ``answer`` of ``task`` (a name in ``TASKS``), the same for a
    given ``seed`` on every rank; ``digits``: the operands' digits of ``add``."""
    header, make = TASKS[task]
    shots = random.Random(f"{task}-shots")
    examples = [" ".join(make(shots, digits)) for _ in range(SHOTS)]
    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(n):
        question, answer = make(rng, digits)
        rows["prompt"].append("\n".join([header, *examples, question]))
        rows["answer"].append(answer)
    return Dataset.from_dict(rows)


def file_dataset(pattern: str) -> Dataset:
    """The ``prompt`` / ``answer`` rows of local JSON / JSON-lines files (``pattern``: a path or
    glob, ``json:`` prefix allowed); a clear error when nothing matches or a column is missing."""
    files = sorted(glob.glob(pattern.removeprefix("json:")))
    if not files:
        raise SystemExit(f"--dataset {pattern}: no file matches")
    ds = load_dataset("json", data_files=files, split="train")
    missing = [c for c in ("prompt", "answer") if c not in ds.column_names]
    if missing:
        raise SystemExit(
            f"--dataset {pattern} has no {' / '.join(missing)} column (columns: "
            f"{ds.column_names}): the exact-match reward needs a prompt and its answer"
        )
    return ds.cast_column("answer", Value("string"))


def first_word(completion: str) -> str:
    words = completion.split()
    return words[0].removesuffix(".") if words else ""


def correct_answer(prompts: list[str], completions: list[str], answer: list[str], **kwargs):
    """1.0 per completion whose first word is its row's ``answer``, else 0.0."""
    return [float(first_word(c) == a) for c, a in zip(completions, answer)]


def answer_only(prompts: list[str], completions: list[str], **kwargs):
    """1.0 per completion that is a single word (the answer, then the end of the sequence)."""
    return [float(len(c.split()) == 1) for c in completions]
