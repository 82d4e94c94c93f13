"""Reload a recipe's Hugging Face checkpoint in ONE plain process and compute its eval loss.

    python recipes/eval_checkpoint.py --checkpoint outputs/finetune/final --seq-len 4096

Uses the same held-out blocks as ``finetune_long_llama.py`` (the last ``--eval-blocks`` blocks of
the packed dataset, ``--packing`` as in training), with the tokenizer saved beside the weights; no
TSP, no process group. Rows of whole documents run with per-document positions and the
block-diagonal causal mask, ignoring the targets across documents and on padding.
"""

from __future__ import annotations

import argparse
import json

import torch
from _data import SHAKESPEARE, load_blocks, load_texts
from transformers import AutoModelForCausalLM, AutoTokenizer


def row_loss(model, row: dict[str, torch.Tensor]) -> float:
    """Token-mean loss of one packed row (``input_ids`` and, for whole documents,
    ``position_ids`` and ``attention_mask``, each ``[seq_len]``)."""
    ids = row["input_ids"][None]
    if "position_ids" not in row:
        return model(input_ids=ids, labels=ids).loss.item()
    pos, real = row["position_ids"], row["attention_mask"]
    doc = (pos == 0).cumsum(0)  # padding is a document of its own
    mask = (doc[:, None] == doc[None, :]).tril()[None, None]
    labels = ids.masked_fill((pos == 0) | (real == 0), -100)
    out = model(input_ids=ids, position_ids=pos[None], attention_mask=mask, labels=labels)
    return out.loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dataset", default=SHAKESPEARE)
    p.add_argument("--text-column", default="text")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--packing", choices=("stream", "documents"), default="stream")
    p.add_argument("--eval-blocks", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print {'eval_loss': ...} only")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    texts = load_texts(args.dataset, args.text_column, tokenizer=tokenizer)
    blocks = load_blocks(texts, tokenizer, args.seq_len, args.packing)
    n = len(blocks["input_ids"])
    rows = range(n - min(args.eval_blocks, n - 1), n)
    with torch.no_grad():
        losses = [row_loss(model, {k: v[i] for k, v in blocks.items()}) for i in rows]
    loss = sum(losses) / len(losses)
    if args.json:
        print(json.dumps({"eval_loss": loss}))
    else:
        print(f"{args.checkpoint}: single-process eval loss {loss:.4f} on {len(losses)} blocks")


if __name__ == "__main__":
    main()
