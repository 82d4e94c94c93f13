"""What ``eval_long.py`` measures, on a TSP model or a plain Hugging Face one: the loss at every
position of long documents (fused vocab-sharded head: no rank builds ``[S, V]`` logits),
perplexity by position bucket, and passkey retrieval (a number hidden in filler text, asked for
at the end, read back by greedy decoding)."""

from __future__ import annotations

import math
import random
import re

import torch
import torch.nn.functional as F

# LongLoRA's / Landmark Attention's passkey prompt
TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER_TOKENS = 8  # generated after a passkey prompt: a cell of length L prompts L - 8 tokens


def position_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S - 1]``: the loss (-log p) of each next token of ``ids [B, S]`` (column i predicts
    token i + 1), in float64. A TSP model answers through its fused head, the same on every rank
    of its group; a plain model through its logits."""
    with torch.no_grad():
        if getattr(model, "tsp", None) is not None:
            logp = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
        else:
            logits = model(input_ids=ids).logits[:, :-1]
            logp = F.log_softmax(logits.double(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]
    return -logp.double()


def bucket_perplexity(nll: torch.Tensor, bucket: int) -> list[dict]:
    """Perplexity by position: ``nll [N, S - 1]`` (``position_nll`` of N documents) averaged
    over the documents and over each ``bucket`` of predicted positions (the token at position
    i + 1 is predicted at column i); one row per bucket: ``start``, ``end`` (positions
    ``[start, end)``), ``nll`` and ``ppl``."""
    S = nll.shape[1] + 1
    rows = []
    for start in range(0, S, bucket):
        end = min(start + bucket, S)
        cols = nll[:, max(start - 1, 0) : end - 1]
        mean = cols.mean().item()
        rows.append({"start": start, "end": end, "nll": mean, "ppl": math.exp(mean)})
    return rows


def long_documents(texts: list[str], tokenizer, length: int, samples: int) -> list[list[int]]:
    """The first ``length`` tokens of the last ``samples`` texts at least that long (the held-out
    end of a dataset); a clear error when none is."""
    ids = [tokenizer(t)["input_ids"] for t in texts]
    long = [d[:length] for d in ids if len(d) >= length]
    if not long:
        longest = max(map(len, ids), default=0)
        raise SystemExit(
            f"no document of the dataset has {length} tokens (the longest has {longest}): give "
            f"a --dataset of longer documents, or --lengths up to {longest}"
        )
    return long[-samples:]


class Passkeys:
    """Passkey prompts of exact token lengths, built from the tokenized pieces of the prompt
    (``TASK``, filler, ``NEEDLE``, ``QUESTION``) for ``tokenizer``."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.tokenizer, self.seed = tokenizer, seed
        self.task = tokenizer(TASK)["input_ids"]
        self.question = self._ids(QUESTION)
        self.filler = self._ids(FILLER)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def key(self, length: int, depth: float, sample: int) -> str:
        """The 5-digit passkey of one cell's sample: the same on every rank and every run."""
        return str(random.Random(f"{self.seed}:{length}:{depth}:{sample}").randrange(10**4, 10**5))

    def shortest(self) -> int:
        """Tokens of the prompt without any filler, and its answer."""
        needle = len(self._ids(NEEDLE.format(key="00000")))
        return len(self.task) + needle + len(self.question) + ANSWER_TOKENS

    def prompt(self, length: int, depth: float, key: str) -> list[int]:
        """``length - ANSWER_TOKENS`` tokens (prompt and answer fill ``length``): the task,
        filler with the needle at ``depth`` percent of it, the question; a clear error when
        ``length`` cannot hold the prompt and its answer."""
        needle = self._ids(NEEDLE.format(key=key))
        fill = length - ANSWER_TOKENS - len(self.task) - len(needle) - len(self.question)
        if fill < 0:
            raise SystemExit(
                f"--lengths {length}: a passkey prompt and its answer need "
                f"{length - fill} tokens without any filler; give lengths above that"
            )
        repeats = -(-fill // len(self.filler))
        filler = (self.filler * repeats)[:fill]
        before = round(depth / 100 * fill)
        return self.task + filler[:before] + needle + filler[before:] + self.question


def read_key(text: str) -> str:
    """The first number in a generated answer ("" when there is none)."""
    found = re.search(r"\d+", text)
    return found.group() if found else ""


def passkey_answer(model, tokenizer, prompt: list[int]) -> str:
    """The greedy continuation of ``prompt``, ``ANSWER_TOKENS`` tokens (a TSP model: prefill on
    the TSP schedule, decode on its sharded KV cache), decoded."""
    ids = torch.tensor([prompt], device=model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=ANSWER_TOKENS,
            do_sample=False,
            pad_token_id=pad,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
