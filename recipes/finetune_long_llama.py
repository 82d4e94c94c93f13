"""Fine-tune a long-context Llama-family model with TSP (+ DDP, DeepSpeed ZeRO or FSDP2).

    accelerate launch --config_file recipes/configs/cpu_2proc.yaml recipes/finetune_long_llama.py \
        --model smollm2-135m --tsp-size 2 --seq-len 2048 --max-steps 6 --lr 3e-5
    python recipes/finetune_long_llama.py --max-steps 4    # no launcher: one process, TSP = 1

Every rank holds 1/tsp of each layer's weights and 1/tsp of every sequence's tokens; the remaining
processes (world / tsp) are data-parallel replicas. See docs/recipes.md for every argument.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _args import add_data_parallel_arg, add_shared_args
from _checkpoints import check_resume, save_checkpoint
from _data import documents, load_blocks, load_rows
from _faults import maybe_kill, maybe_poison
from _finish import finish
from _metrics import open_metrics, peak_memory_bytes
from _model import (
    add_lora,
    build_tokenizer,
    lora_config,
    model_config,
    preset_model,
    pretrained_model,
    resolve_model,
)
from _presets import PRESETS
from _reports import report_fine_tuning, report_memory
from _sample import greedy_sample
from _single_process import init_single_process
from _training import TrainingRun, tsp_config
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from tsp_ext import init_tsp_mesh, shard_batch
from tsp_ext.dp.guard import accelerate_deepspeed_config
from tsp_ext.memory import SavedTensorBytes

log = logging.getLogger("finetune_long_llama")
DEFAULT_DS_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "ds_zero2.json")
SAMPLE_PROMPT = "**ROMEO**  \nBut soft, what light through yonder window breaks?\n\n**JULIET**  \n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_args(p)
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="seconds a collective waits for a stopped or hung peer before failing",
    )
    add_data_parallel_arg(p, old_name="--dp-engine")
    p.add_argument(
        "--ds-config",
        default=None,
        help="default: the accelerate launch config's deepspeed_config_file, else "
        "configs/ds_zero2.json",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer in backward, keeping only its input "
        "(TSPConfig checkpoint_layers)",
    )
    p.add_argument(
        "--offload-checkpoints",
        action="store_true",
        help="with --gradient-checkpointing: those inputs wait for backward in host memory",
    )
    p.add_argument(
        "--sample-tokens",
        type=int,
        default=0,
        help="greedy tokens generated from --sample-prompt before and after fine-tuning (ddp)",
    )
    p.add_argument("--sample-prompt", default=SAMPLE_PROMPT)
    p.add_argument(
        "--save-every", type=int, default=0, help="training-state checkpoints (0: end only)"
    )
    p.add_argument(
        "--keep-last", type=int, default=0, help="keep the N newest checkpoints (0: all)"
    )
    p.add_argument("--output-dir", default="outputs/finetune")
    p.add_argument(
        "--resume-from",
        default=None,
        help="a checkpoint-<step> directory, or auto: the newest complete one in --output-dir "
        "(a fresh start when there is none)",
    )
    p.add_argument(
        "--on-nonfinite",
        choices=("stop", "skip"),
        default="stop",
        help="a non-finite loss or gradient norm: stop with the step number, or skip the step "
        "(no update, the schedule does not advance)",
    )
    return p.parse_args(argv)


def resolve_ds_config(args) -> None:
    """``--ds-config``: given, else the ``accelerate launch`` config's DeepSpeed file, else
    ``configs/ds_zero2.json``; a size in its ``"tsp"`` block is the default ``--tsp-size`` and
    must agree with one given."""
    launched_with = accelerate_deepspeed_config()
    if launched_with is not None and args.data_parallel != "deepspeed":
        raise SystemExit(
            f"accelerate launch has a DeepSpeed config ({launched_with or 'plugin settings'}) but "
            f"--data-parallel is {args.data_parallel}: pass --data-parallel deepspeed (its "
            'deepspeed_config_file is then the --ds-config, "tsp" block included), or launch '
            "without DeepSpeed"
        )
    args.ds_config = args.ds_config or launched_with or DEFAULT_DS_CONFIG
    if args.data_parallel != "deepspeed":
        return
    if not os.path.isfile(args.ds_config):
        raise SystemExit(f"--ds-config {args.ds_config} does not exist")
    with open(args.ds_config) as f:
        size = (json.load(f).get("tsp") or {}).get("size")
    if size is not None and args.tsp_size is not None and size != args.tsp_size:
        raise SystemExit(
            f'--tsp-size {args.tsp_size} disagrees with the "tsp" block of {args.ds_config} '
            f"(size {size}): make them agree, or drop --tsp-size"
        )
    args.tsp_size = args.tsp_size or size


def check_args(args, world: int) -> None:
    """Fail before any work with a message saying what to change."""
    resolve_ds_config(args)
    args.tsp_size = args.tsp_size or world
    if args.tsp_size < 1 or world % args.tsp_size:
        raise SystemExit(f"--tsp-size {args.tsp_size} does not divide the {world} processes")
    if args.seq_len < 2 * args.tsp_size:
        raise SystemExit(
            f"--seq-len {args.seq_len} is shorter than 2 x tsp size = {2 * args.tsp_size}"
        )
    model_config(args, seq_len=args.seq_len)  # --rope-* and the context length
    lora_config(args)  # --qlora without --lora-r stops here
    if args.offload_checkpoints and not args.gradient_checkpointing:
        raise SystemExit(
            "--offload-checkpoints offloads layer checkpoints: add --gradient-checkpointing"
        )
    if args.keep_last < 0:
        raise SystemExit(f"--keep-last {args.keep_last}: give 0 (keep all) or a positive count")
    if args.sample_tokens and args.data_parallel != "ddp":
        raise SystemExit(
            f"--sample-tokens generates with the TSP model, which {args.data_parallel} shards "
            "further: use --data-parallel ddp, or generate from <output-dir>/final with "
            "recipes/generate.py"
        )
    check_resume(args)


def warn_restarts(args) -> None:
    """Under an elastic launcher with restarts (``--max_restarts``), say what a restart needs."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    if args.resume_from != "auto":
        log.warning("restarts without --resume-from auto begin again at step 1")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        log.warning(
            "a restart reuses the launcher's store, where the process group of the failed "
            "attempt left its addresses: the new one may fail to come up ('Connection refused'). "
            "Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the c10d rendezvous "
            "(docs/faults.md)"
        )


def build_model(args, vocab: int, mesh, device: torch.device):
    """``(model, full parameter count)``: a preset is built whole on every rank
    (``TrainingRun`` makes it a TSP model); a checkpoint is loaded shard-on-read, already a TSP
    model, each rank reading only its slices (``tsp_ext.load_pretrained``), so no rank ever holds
    the full model."""
    if args.model in PRESETS:
        model = preset_model(args, vocab).to(device)
        return model, sum(p.numel() for p in model.parameters())
    hf_config = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):  # the full size, counted without allocating it
        shape_only = AutoModelForCausalLM.from_config(hf_config)
    full_params = sum(p.numel() for p in shape_only.parameters())
    return pretrained_model(args, vocab, mesh, tsp_config(args), device), full_params


def block_ids(step: int, micro: int, args, dp: int, dp_rank: int, n: int) -> list[int]:
    """Training blocks of one micro batch: a fixed permutation per epoch, so resume is exact."""
    first = (step * args.gradient_accumulation_steps + micro) * dp * args.micro_batch_size
    first += dp_rank * args.micro_batch_size
    out = []
    for i in range(first, first + args.micro_batch_size):
        epoch, j = divmod(i, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))
        out.append(int(perm[j]))
    return out


def nonfinite(args, step: int, loss: float, norm: float, updated: bool) -> None:
    """A non-finite loss or gradient norm at ``step`` (1-based): the same values on every rank,
    so every rank stops (``--on-nonfinite stop``) or skips the step together (``updated``: the
    engine updated the weights all the same)."""
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    msg = f"rank {dist.get_rank()}: non-finite {what} at step {step} (loss {loss}, norm {norm})"
    if args.on_nonfinite == "stop":
        raise SystemExit(
            f"{msg}: stopped, no checkpoint of this step; lower --lr, check the data, or pass "
            "--on-nonfinite skip"
        )
    if updated:  # DeepSpeed, finite gradients of a non-finite loss
        log.warning(f"{msg}: DeepSpeed updated the weights (finite gradients)")
    else:
        log.warning(f"{msg}: skipped (no update, the schedule does not advance)")


def local_batch(blocks: dict[str, torch.Tensor], index, mesh, device: torch.device) -> dict:
    """This rank's TSP inputs for the blocks at ``index``; the targets are the inputs
    (``shard_batch`` ignores padding and, between documents, the next document's first token)."""
    batch = {k: v[index].to(device) for k, v in blocks.items()}
    return shard_batch({**batch, "labels": batch["input_ids"]}, mesh)


@torch.no_grad()
def evaluate(run: TrainingRun, eval_blocks: dict, mesh, device: torch.device) -> float:
    """Mean loss over the held-out blocks (split over dp replicas, tokens over TSP ranks)."""
    model = run.forward_model
    model.eval()
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(dp_rank, len(eval_blocks["input_ids"]), dp):
        total[0] += model(**local_batch(eval_blocks, slice(i, i + 1), mesh, device)).loss.double()
        total[1] += 1
    dist.all_reduce(total, group=mesh["dp"].get_group())
    model.train()
    return (total[0] / total[1]).item()


def train_step(
    run: TrainingRun, model, args, step: int, train_blocks: dict, mesh, device: torch.device
) -> tuple[float, float, int]:
    """Optimizer step ``step`` (0-based) over ``--gradient-accumulation-steps`` micro batches of
    ``train_blocks``: ``(loss, gradient norm, saved activation bytes of the last micro batch)``,
    the loss the mean over dp, the same on every rank; a non-finite one stops or skips the step
    (``--on-nonfinite``) on every rank together."""
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    losses = []
    for micro in range(args.gradient_accumulation_steps):
        index = block_ids(step, micro, args, dp, dp_rank, len(train_blocks["input_ids"]))
        batch = local_batch(train_blocks, index, mesh, device)
        with SavedTensorBytes(ignore=model.parameters()) as saved:
            out = run.forward_model(**batch)
        micro_loss = maybe_poison(out.loss, step + 1)
        run.backward(micro_loss)
        losses.append(micro_loss.detach())
        if micro < args.gradient_accumulation_steps - 1:
            run.step(last_micro=False)
    # the mean over dp (TSP ranks hold the same loss), on every rank before the update
    loss = torch.stack(losses).mean().double().reshape(1)
    dist.all_reduce(loss)
    loss = loss.item() / dist.get_world_size()
    norm = run.step(last_micro=True, skip=not math.isfinite(loss))
    if not (math.isfinite(loss) and math.isfinite(norm)):
        nonfinite(args, step + 1, loss, norm, run.updated)
    return loss, norm, saved.nbytes


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dist_timeout <= 0:
        raise SystemExit(f"--dist-timeout {args.dist_timeout}: give a positive number of seconds")
    timeout = timedelta(seconds=args.dist_timeout)
    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format="%(message)s",
        stream=sys.stdout,
    )
    warn_restarts(args)
    owns_group = not dist.is_initialized()
    init_single_process(timeout)
    acc = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
    resolve_model(args, acc)
    check_args(args, acc.num_processes)
    set_seed(args.seed)
    rows = load_rows(args.dataset)  # a BPE trains on chats as role-prefixed lines
    tokenizer = build_tokenizer(args, documents(rows, args.text_column, args.dataset), acc)
    texts = documents(rows, args.text_column, args.dataset, tokenizer)
    blocks = load_blocks(texts, tokenizer, args.seq_len, args.packing)
    n_blocks = len(blocks["input_ids"])
    n_eval = min(args.eval_blocks, n_blocks - 1)
    train_blocks = {k: v[:-n_eval] for k, v in blocks.items()}
    eval_blocks = {k: v[-n_eval:] for k, v in blocks.items()}

    mesh = init_tsp_mesh(args.tsp_size, timeout=timeout)
    dp = mesh["dp"].size()
    model, full_params = build_model(args, len(tokenizer), mesh, acc.device)
    model = add_lora(model, args, tsp_config(args))
    run = TrainingRun(args.data_parallel, model, mesh, args)
    start = run.load(args.resume_from) if args.resume_from else 0
    log.info(
        f"{args.model}: {full_params / 1e6:.2f}M parameters, {n_blocks - n_eval} training blocks "
        f"of {args.seq_len} tokens ({args.packing} packing); dp={dp} x tsp={args.tsp_size} "
        f"with {args.data_parallel}"
    )
    before = None
    if start == 0:  # what fine-tuning starts from
        before = evaluate(run, eval_blocks, mesh, acc.device), sample(run, tokenizer, args)
        log.info(f"eval loss before fine-tuning {before[0]:.4f}")

    os.makedirs(args.output_dir, exist_ok=True)
    metrics_file = os.path.join(args.output_dir, "metrics.jsonl")
    metrics = open_metrics(metrics_file, start) if acc.is_main_process else None
    bar = tqdm(range(start, args.max_steps), disable=not acc.is_main_process, desc="train")
    tokens_per_step = args.gradient_accumulation_steps * dp * args.micro_batch_size * args.seq_len
    eval_loss, activation_bytes = None, 0
    for step in bar:
        maybe_kill(step + 1)
        t0 = time.perf_counter()
        loss, norm, activation_bytes = train_step(
            run, model, args, step, train_blocks, mesh, acc.device
        )
        finite = math.isfinite(loss) and math.isfinite(norm)
        tps = tokens_per_step / (time.perf_counter() - t0)
        row = {
            "step": step + 1,
            "loss": loss if finite else None,
            "grad_norm": norm if finite else None,
            "tokens_per_s": tps,
            "lr": run.scheduler.get_last_lr()[0],
            "peak_mem_bytes": peak_memory_bytes(),
        }
        if not run.updated:
            row["skipped"] = True
        if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
            row["eval_loss"] = eval_loss = evaluate(run, eval_blocks, mesh, acc.device)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.max_steps:
            save_checkpoint(run, args, step + 1)
        bar.set_postfix(
            loss=f"{loss:.3f}", tok_s=f"{tps:.0f}", mem=f"{row['peak_mem_bytes'] / 2**20:.0f}MB"
        )
        if metrics:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    if eval_loss is None:  # resumed at --max-steps: convert the checkpoint, no step taken
        eval_loss = evaluate(run, eval_blocks, mesh, acc.device)
    final = os.path.join(args.output_dir, "final")
    save_checkpoint(run, args, args.max_steps)
    run.export(final, tokenizer)
    if activation_bytes:
        report_memory(model, full_params, activation_bytes, args, acc.device)
    if before is not None:
        report_fine_tuning(args, before, (eval_loss, sample(run, tokenizer, args)))
    log.info(f"final eval loss {eval_loss:.4f}; Hugging Face checkpoint: {final}")
    if metrics:
        metrics.close()
    finish(acc, args.output_dir, eval_loss, final, owns_group)


def sample(run: TrainingRun, tokenizer, args) -> str | None:
    """``--sample-tokens`` greedy tokens from ``--sample-prompt`` (None without them)."""
    if not args.sample_tokens:
        return None
    return greedy_sample(run.model, tokenizer, args.sample_prompt, args.sample_tokens)


if __name__ == "__main__":
    main()
