"""Generate text with a TSP model: long-prompt prefill on the TSP schedule, token-by-token decode
with a sharded KV cache (each rank 1/D of the weights and of the cache).

    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/generate.py \\
        --checkpoint outputs/demo/final --prompt "Friends, Romans" --max-new-tokens 64
    torchrun --nproc-per-node 2 recipes/generate.py --model tiny-llama --prompt-file prompt.txt

A checkpoint is read shard-on-read (``tsp_ext.load_pretrained``: no rank ever holds the full
weights) with the tokenizer saved beside it; a preset builds a randomly initialised model and a
BPE tokenizer trained on the offline Shakespeare plays. Rank 0 prints the continuation, prefill
and decode tokens/s, and every rank's KV-cache and weight bytes.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _data import SHAKESPEARE, load_texts, train_tokenizer
from _presets import PRESETS
from _single_process import init_single_process
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LogitsProcessor

from tsp_ext import apply_tsp, init_tsp_mesh, load_pretrained, tsp_group

log = logging.getLogger("generate")


class StepClock(LogitsProcessor):
    """Records when each step's logits arrive (the first one right after the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="a Hugging Face checkpoint directory (safetensors)")
    src.add_argument("--model", default="tiny-llama", choices=list(PRESETS))
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", default="Friends, Romans, countrymen, lend me your ears;")
    text.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--tsp-size", type=int, default=None, help="default: the world size")
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="seconds a collective waits for a stopped or hung peer before failing",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=2048, help="preset tokenizer size")
    args = p.parse_args(argv)
    check_paths(args)
    return args


def check_paths(args: argparse.Namespace) -> None:
    """Refuse a ``--checkpoint`` that is not a checkpoint directory or a missing
    ``--prompt-file`` before any process group or model is built."""
    if args.checkpoint and not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        what = "has no config.json" if os.path.isdir(args.checkpoint) else "no such directory"
        raise SystemExit(
            f"--checkpoint {args.checkpoint}: {what}; give a Hugging Face checkpoint directory "
            "(e.g. outputs/demo/final, which `make demo` writes)"
        )
    if args.prompt_file and not os.path.isfile(args.prompt_file):
        raise SystemExit(f"--prompt-file {args.prompt_file}: no such file")


def build(args, mesh):
    """(TSP model, tokenizer) from a checkpoint (shard-on-read) or a preset."""
    if args.checkpoint:
        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        return load_pretrained(args.checkpoint, mesh).eval(), tokenizer
    tokenizer = train_tokenizer(load_texts(SHAKESPEARE, "text"), args.vocab_size)
    D = dist.get_world_size(tsp_group(mesh))
    vocab = -(-len(tokenizer) // D) * D  # a vocabulary divisible by D, as resize would pad it
    cfg = LlamaConfig(**PRESETS[args.model], vocab_size=vocab, max_position_embeddings=16384)
    torch.manual_seed(args.seed)  # the same weights on every rank
    return apply_tsp(LlamaForCausalLM(cfg), mesh).eval(), tokenizer


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    owns_group = not dist.is_initialized()
    init_single_process(timedelta(seconds=args.dist_timeout))  # plain `python recipes/generate.py`
    mesh = init_tsp_mesh(
        args.tsp_size or int(os.environ.get("WORLD_SIZE", 1)), timeout=args.dist_timeout
    )
    main_rank = dist.get_rank() == 0
    model, tokenizer = build(args, mesh)
    text = open(args.prompt_file).read() if args.prompt_file else args.prompt
    ids = tokenizer(text, return_tensors="pt")["input_ids"].to(model.device)
    clock = StepClock()
    kw = dict(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(
        ids,
        max_new_tokens=args.max_new_tokens,
        logits_processor=[clock],
        return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id,
        **(kw if args.sample else {"do_sample": False}),
    )
    end = time.perf_counter()
    new = out.sequences.shape[1] - ids.shape[1]
    prefill_s = clock.times[0] - start
    decode_s = end - clock.times[0]
    weights = sum(p.nbytes for p in model.parameters())
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, (out.cache.kv_bytes(), weights))
    if main_rank:
        log.info("%s", tokenizer.decode(out.sequences[0, ids.shape[1] :]))
        log.info(
            "prompt %d tokens, prefill %.3f s (%.0f tokens/s)",
            ids.shape[1],
            prefill_s,
            ids.shape[1] / prefill_s,
        )
        log.info(
            "decode %d tokens, %.3f s (%.1f tokens/s)",
            new - 1,
            decode_s,
            (new - 1) / max(decode_s, 1e-9),
        )
        for rank, (kv, w) in enumerate(sizes):
            log.info("rank %d: KV cache %d bytes, weights %d bytes", rank, kv, w)
    dist.barrier()
    if owns_group:  # a caller's own group outlives this run, as in the other recipes
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
