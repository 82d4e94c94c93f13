"""Long-context evaluation under TSP: perplexity by position and passkey retrieval.

    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/eval_long.py \\
        --model smollm2-135m --lengths 2048,4096,8192 --output-dir outputs/eval-long/original
    python recipes/eval_long.py --model outputs/long/final --lengths 1024,2048   # one process

- **Perplexity by position**: the last ``--samples`` documents of ``--dataset`` with at least
  max(``--lengths``) tokens (the held-out end of the data), cut to that length and run once; the
  loss at every position, averaged in buckets of ``--bucket`` positions. Attention is causal, so
  the buckets below a shorter length are what that length alone would give.
- **Passkey retrieval**: a 5-digit number hidden at each of ``--depths`` (percent of the
  filler) in prompts of each of ``--lengths`` tokens, ``--samples`` keys per cell, read back by
  greedy decoding; a cell's accuracy is the share of exact matches.

The model is read shard-on-read (``tsp_ext.load_pretrained``): each rank holds 1/D of the weights,
of every sequence's activations and of the KV cache, and no rank builds ``[S, V]`` logits. The
``--rope-*`` arguments evaluate the model with another RoPE (e.g. YaRN before any training);
lengths beyond its positions are refused unless ``--beyond-positions`` asks to see how it fails
there. Processes beyond the TSP size are replicas that split the work. Rank 0 writes
``eval_long.json``, ``ppl.png`` and ``passkey.png`` into ``--output-dir`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _args import add_rope_args
from _data import SHAKESPEARE, load_texts
from _gguf import DEFAULT_CACHE
from _long_eval import (
    Passkeys,
    bucket_perplexity,
    long_documents,
    passkey_answer,
    position_nll,
    read_key,
)
from _long_plots import plot_passkey, plot_ppl
from _model import model_config, resolve_model
from _presets import PRESETS
from _single_process import init_single_process
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from transformers import AutoTokenizer

from tsp_ext import init_tsp_mesh, load_pretrained

log = logging.getLogger("eval_long")
ANSWER_FIELDS = ("length", "depth", "key", "answer", "correct")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def numbers(kind: type, flag: str):
    """An argparse type: comma-separated ``kind`` values, at least one, none negative."""

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 0:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give numbers for {flag}, space- or comma-separated"
            )
        return values

    return parse


class _Numbers(argparse.Action):
    """A list flag given either way: ``--lengths 1024 2048`` or ``--lengths 1024,2048``."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [v for part in values for v in part])


def parser() -> argparse.ArgumentParser:
    """The recipe's flags, each described in ``--help``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", required=True, help="a checkpoint directory, a .gguf file, or a shortcut"
    )
    p.add_argument("--tokenizer", default=None, help="default: the checkpoint's own")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where GGUF files are converted")
    add_rope_args(p)
    p.add_argument("--dataset", default=SHAKESPEARE, help="long documents for the perplexity")
    p.add_argument("--text-column", default="text", help="the dataset's column of documents")
    p.add_argument(
        "--lengths",
        type=numbers(int, "--lengths"),
        nargs="+",
        action=_Numbers,
        default=[2048, 4096, 8192],
        help="sequence lengths in tokens, space- or comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--depths",
        type=numbers(float, "--depths"),
        nargs="+",
        action=_Numbers,
        default=[0, 25, 50, 75, 100],
        help="passkey depths, percent of the filler (default: %(default)s)",
    )
    p.add_argument("--samples", type=int, default=1, help="documents, and keys per passkey cell")
    p.add_argument("--bucket", type=int, default=1024, help="positions per perplexity bucket")
    p.add_argument("--tasks", default="ppl,passkey", help="ppl, passkey or both")
    p.add_argument(
        "--beyond-positions",
        action="store_true",
        help="allow lengths beyond the model's max_position_embeddings (to see how it fails)",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the weights' dtype")
    p.add_argument("--tsp-size", type=int, default=None, help="default: all processes")
    p.add_argument("--label", default=None, help="the run's name in tables and plots")
    p.add_argument(
        "--output-dir", default="outputs/eval-long", help="where the JSON and the plots go"
    )
    p.add_argument("--seed", type=int, default=0, help="draws the passkeys")
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=1800.0,
        help="seconds a collective waits for a stopped or hung rank before failing",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse what would fail later, before any process group or model (every rank alike)."""
    if args.model in PRESETS:
        raise SystemExit(
            f"--model {args.model} is a randomly initialised preset: evaluate a trained checkpoint "
            "(a recipe's export such as outputs/demo/final, a .gguf file or smollm2-135m)"
        )
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks or set(tasks) - {"ppl", "passkey"}:
        raise SystemExit(f"--tasks {args.tasks}: give ppl, passkey or ppl,passkey")
    args.tasks = tasks
    if any(d > 100 for d in args.depths):
        raise SystemExit(f"--depths {args.depths}: depths are percents of the filler, 0 to 100")
    if args.samples < 1 or args.bucket < 1 or min(args.lengths) < 2:
        raise SystemExit("--samples and --bucket must be at least 1, --lengths at least 2")
    args.lengths = sorted(set(args.lengths))


def check_positions(args, hf_config) -> None:
    """Refuse lengths beyond the (extended) model's positions unless ``--beyond-positions``."""
    limit, longest = hf_config.max_position_embeddings, args.lengths[-1]
    if longest <= limit or args.beyond_positions:
        return
    raise SystemExit(
        f"--lengths {longest} is beyond {args.model_arg}'s max_position_embeddings={limit}: "
        "positions past it were never trained. Use lengths up to that, extend the RoPE for the "
        "evaluation "
        f"(--rope-scaling yarn --rope-factor {-(-longest // limit)}), or pass --beyond-positions "
        "to measure how the model does past them"
    )


def work_items(args, documents: list[list[int]], passkeys: Passkeys | None) -> list[dict]:
    """Every forward the evaluation runs: one per document, one per passkey prompt."""
    items = [{"task": "ppl", "doc": i} for i in range(len(documents))]
    if passkeys is not None:
        for length in args.lengths:
            for depth in args.depths:
                for sample in range(args.samples):
                    key = passkeys.key(length, depth, sample)
                    items.append(dict(task="passkey", length=length, depth=depth, key=key))
    return items


def run_item(item: dict, model, tokenizer, documents, passkeys) -> dict:
    """One item's result: a document's per-position losses, or a passkey's answer."""
    start = time.perf_counter()
    if item["task"] == "ppl":
        ids = torch.tensor([documents[item["doc"]]], device=model.device)
        result = {"nll": position_nll(model, ids)[0].tolist()}
    else:
        prompt = passkeys.prompt(item["length"], item["depth"], item["key"])
        result = {"answer": passkey_answer(model, tokenizer, prompt)}
    return {**item, **result, "seconds": time.perf_counter() - start}


def default_label(args, hf_config) -> str:
    """The ``--model`` as given, and the RoPE change the evaluation makes, if any."""
    rope = hf_config.rope_parameters
    change = [f"{args.rope_scaling} x{rope['factor']:g}"] if args.rope_scaling else []
    change += [f"theta {rope['rope_theta']:g}"] if args.rope_theta else []
    return " + ".join([args.model_arg, *change])


def summary(args, hf_config) -> dict:
    """The run's settings, as its JSON records them."""
    return {
        "label": args.label or default_label(args, hf_config),
        "model": args.model_arg,
        "rope_parameters": getattr(hf_config, "rope_parameters", None),
        "max_position_embeddings": hf_config.max_position_embeddings,
        "dtype": args.dtype,
        "tsp_size": args.tsp_size,
        "world_size": dist.get_world_size(),
    }


def measured(args, results: list[dict]) -> dict:
    """The run's results: seconds, perplexity buckets, passkey grid and every answer."""
    out = {"seconds": sum(r["seconds"] for r in results)}
    docs = [r for r in results if r["task"] == "ppl"]
    if docs:
        nll = torch.tensor([r["nll"] for r in docs], dtype=torch.float64)
        out["ppl"] = {
            "length": args.lengths[-1],
            "documents": len(docs),
            "bucket": args.bucket,
            "buckets": bucket_perplexity(nll, args.bucket),
        }
    answers = [r for r in results if r["task"] == "passkey"]
    if answers:
        for r in answers:
            r["correct"] = read_key(r["answer"]) == r["key"]
        cells = [
            [
                [r["correct"] for r in answers if (r["length"], r["depth"]) == (n, d)]
                for d in args.depths
            ]
            for n in args.lengths
        ]
        out["passkey"] = {
            "lengths": args.lengths,
            "depths": args.depths,
            "samples": args.samples,
            "accuracy": [[sum(c) / len(c) for c in row] for row in cells],
            "answers": [{k: r[k] for k in ANSWER_FIELDS} for r in answers],
        }
    return out


def print_tables(run: dict) -> None:
    """The perplexity buckets and the passkey grid, as the log's tables."""
    if "ppl" in run:
        ppl = run["ppl"]
        log.info(f"perplexity by position ({ppl['documents']} documents of {ppl['length']} tokens)")
        for row in ppl["buckets"]:
            log.info(f"  {row['start']:>7}-{row['end']:<7} {row['ppl']:9.3f}")
    if "passkey" in run:
        grid = run["passkey"]
        log.info("passkey accuracy (rows: length; columns: depth %)")
        log.info("  " + " " * 8 + "".join(f"{d:>7g}" for d in grid["depths"]))
        for n, row in zip(grid["lengths"], grid["accuracy"]):
            log.info(f"  {n:>8}" + "".join(f"{a:>7.2f}" for a in row))


def inputs(args, tokenizer, texts: list[str]) -> tuple[list[list[int]], Passkeys | None]:
    """The perplexity documents and the passkey prompts' builder, checked before any model is
    read: no document that long, or a length too short for a prompt, stops every rank alike."""
    documents = []
    if "ppl" in args.tasks:
        documents = long_documents(texts, tokenizer, args.lengths[-1], args.samples)
    passkeys = Passkeys(tokenizer, args.seed) if "passkey" in args.tasks else None
    if passkeys is not None:
        for length in args.lengths:
            passkeys.prompt(length, 0, passkeys.key(length, 0, 0))
    return documents, passkeys


def evaluate(args, mesh, model, tokenizer, documents, passkeys) -> list[dict]:
    """Every item's result on every rank: replica r of R runs items r, r + R, ... and one
    all-gather shares them."""
    items = work_items(args, documents, passkeys)
    replicas, replica = mesh["dp"].size(), mesh["dp"].get_local_rank()
    mine = [run_item(it, model, tokenizer, documents, passkeys) for it in items[replica::replicas]]
    shared = [None] * dist.get_world_size()
    dist.all_gather_object(shared, (replica, mine))
    by_replica = dict(shared)  # the ranks of one TSP group hold the same results
    return [by_replica[i % replicas][i // replicas] for i in range(len(items))]


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format="%(message)s",
        stream=sys.stdout,
    )
    timeout = timedelta(seconds=args.dist_timeout)
    owns_group = not dist.is_initialized()
    init_single_process(timeout)
    acc = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
    args.model_arg = args.model  # before a GGUF file becomes its converted directory
    resolve_model(args, acc)
    hf_config = model_config(args)
    check_positions(args, hf_config)
    args.tsp_size = args.tsp_size or acc.num_processes
    mesh = init_tsp_mesh(args.tsp_size, timeout=timeout)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    texts = load_texts(args.dataset, args.text_column) if "ppl" in args.tasks else []
    documents, passkeys = inputs(args, tokenizer, texts)
    model = load_pretrained(
        args.model, mesh, device=acc.device, hf_config=hf_config, dtype=DTYPES[args.dtype]
    ).eval()
    run = summary(args, hf_config)  # before the limit below moves
    if args.beyond_positions:  # its RoPE is built: the limit is only generate()'s check now
        limit = max(args.lengths[-1], hf_config.max_position_embeddings)
        model.config.max_position_embeddings = limit
    run.update(measured(args, evaluate(args, mesh, model, tokenizer, documents, passkeys)))
    if acc.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "eval_long.json"), "w") as f:
            json.dump(run, f, indent=1)
        if "ppl" in run:
            plot_ppl([run], os.path.join(args.output_dir, "ppl.png"))
        if "passkey" in run:
            plot_passkey(run, os.path.join(args.output_dir, "passkey.png"))
        print_tables(run)
        log.info(f"{run['seconds']:.0f} s of evaluation; results in {args.output_dir}")
    dist.barrier()
    if owns_group:  # a caller's own group outlives this run, as in the other recipes
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
