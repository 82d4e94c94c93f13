"""Reload a recipe's Hugging Face checkpoint in ONE plain process and compute its eval loss.

    python recipes/eval_checkpoint.py --checkpoint outputs/finetune/final --seq-len 4096

Uses the same held-out blocks as ``finetune_long_llama.py`` (the last ``--eval-blocks`` blocks of
the packed dataset), with the tokenizer saved beside the weights; no TSP, no process group.
"""

from __future__ import annotations

import argparse
import json

import torch
from _data import SHAKESPEARE, load_texts, pack
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dataset", default=SHAKESPEARE)
    p.add_argument("--text-column", default="text")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--eval-blocks", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print {'eval_loss': ...} only")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    blocks = pack(load_texts(args.dataset, args.text_column), tokenizer, args.seq_len)
    blocks = blocks[-min(args.eval_blocks, len(blocks) - 1) :]
    with torch.no_grad():
        losses = [model(input_ids=b[None], labels=b[None]).loss.item() for b in blocks]
    loss = sum(losses) / len(losses)
    if args.json:
        print(json.dumps({"eval_loss": loss}))
    else:
        print(f"{args.checkpoint}: single-process eval loss {loss:.4f} on {len(blocks)} blocks")


if __name__ == "__main__":
    main()
