"""What a ``finetune_long_llama.py`` run reports at its end, logged and written to its
``--output-dir`` (the docs quote both files): eval loss and greedy samples before and after
fine-tuning (``fine_tuning.json``), per-rank memory next to one process's (``memory.json``)."""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist
from _metrics import peak_memory_bytes
from _model import adapter_parameters

log = logging.getLogger(__name__)


def report_fine_tuning(args, before: tuple, after: tuple) -> None:
    """Eval loss and greedy sample, ``(loss, text)`` each, before and after fine-tuning: logged,
    and written to ``<output-dir>/fine_tuning.json`` (the docs quote it)."""
    log.info(f"eval loss: {before[0]:.4f} before fine-tuning, {after[0]:.4f} after")
    if args.sample_tokens:
        log.info(
            f"greedy continuation ({args.sample_tokens} tokens) of {args.sample_prompt!r}\n"
            f"  before: {before[1]!r}\n  after:  {after[1]!r}"
        )
    if dist.get_rank() == 0:
        report = {
            "eval_loss_before": before[0],
            "eval_loss_after": after[0],
            "sample_prompt": args.sample_prompt if args.sample_tokens else None,
            "sample_before": before[1],
            "sample_after": after[1],
        }
        with open(os.path.join(args.output_dir, "fine_tuning.json"), "w") as f:
            json.dump(report, f, indent=1)


def report_memory(model, full_params: int, activation_bytes: int, args, device) -> None:
    """Per-rank memory (the largest rank's) next to what one process would need for the same
    batch: logged, and written to ``<output-dir>/memory.json`` (bytes; the docs quote it)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    largest = [sum(p.numel() for p in model.parameters()), activation_bytes, peak_memory_bytes()]
    largest = torch.tensor([*largest, trainable], dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    local, activation_bytes, peak, trainable = (int(n) for n in largest.tolist())
    full_trainable = adapter_parameters(model.config, args) if args.lora_r else full_params
    per_param = 2 if args.bf16 else 4

    def state(n: int, train: int) -> int:  # weights; grads and two fp32 Adam moments if trained
        return n * per_param + train * (per_param + 8)

    mb = 2**20
    log.info(
        f"per rank: model state {state(local, trainable) / mb:.1f} MB ({local / 1e6:.2f}M "
        f"parameters, {trainable / 1e6:.2f}M trained), saved "
        f"activations {activation_bytes / mb:.1f} MB (measured), peak process memory "
        f"{peak / mb:.0f} MB\none process would need: model state "
        f"{state(full_params, full_trainable) / mb:.1f} MB, saved activations "
        f"~{activation_bytes * args.tsp_size / mb:.1f} MB (tsp x the per-rank bytes)"
    )
    if dist.get_rank() == 0:
        report = {
            "processes": dist.get_world_size(),
            "tsp_size": args.tsp_size,
            "parameters": full_params,
            "parameters_per_rank": local,
            "trainable_parameters_per_rank": trainable,
            "model_state_bytes_per_rank": state(local, trainable),
            "saved_activation_bytes_per_rank": activation_bytes,
            "peak_process_bytes": peak,
        }
        with open(os.path.join(args.output_dir, "memory.json"), "w") as f:
            json.dump(report, f, indent=1)
