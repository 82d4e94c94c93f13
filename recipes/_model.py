"""The model and tokenizer a recipe trains: ``--model`` (a preset built from a config, a Hugging
Face checkpoint directory or hub id, or a GGUF file converted once) and ``--tokenizer``."""

from __future__ import annotations

import json
import logging
import os
import time

import torch
from _data import train_tokenizer
from _gguf import cached_checkpoint, convert, gguf_file
from _presets import PRESETS
from accelerate import Accelerator
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tsp_ext import TSPConfig, load_pretrained

log = logging.getLogger("recipes")


def resolve_model(args, acc: Accelerator) -> None:
    """Make a GGUF ``--model`` the checkpoint directory it converts to: the main process of each
    machine converts it into ``--cache-dir`` unless it is there already; every process then
    uses it."""
    path = gguf_file(args.model)
    if path is None:
        return
    out = cached_checkpoint(path, args.cache_dir)
    if acc.is_local_main_process and not os.path.isdir(out):
        t0 = time.perf_counter()
        convert(path, out)
        log.info(f"converted {path} to {out} in {time.perf_counter() - t0:.0f} s")
    acc.wait_for_everyone()
    args.model = out


def check_context(seq_len: int, hf_config, name: str) -> None:
    """Refuse a ``--seq-len`` beyond the positions the model was trained (or scaled) for."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        rope = {
            "rope_type": "yarn",
            "factor": float(-(-seq_len // limit)),
            "original_max_position_embeddings": limit,
        }
        raise SystemExit(
            f"--seq-len {seq_len} is beyond {name}'s max_position_embeddings={limit}: positions "
            f"past it were never trained. Use --seq-len <= {limit}, or extend the context with "
            'RoPE scaling in the model\'s config.json (e.g. "rope_parameters": '
            f"{json.dumps(rope)}, keeping its rope_theta) and max_position_embeddings >= {seq_len}"
        )


def build_tokenizer(args, texts: list[str], acc: Accelerator):
    """``--tokenizer``; else the checkpoint's own (a hub id's, or a directory's that has one);
    else a BPE of ``--vocab-size`` trained on ``texts`` by the main process and saved in
    ``<output-dir>/tokenizer``."""
    own = args.model not in PRESETS and (
        not os.path.isdir(args.model)
        or os.path.isfile(os.path.join(args.model, "tokenizer_config.json"))
    )
    if args.tokenizer or own:
        return AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    path = os.path.join(args.output_dir, "tokenizer")
    if acc.is_main_process and not os.path.isdir(path):
        train_tokenizer(texts, args.vocab_size).save_pretrained(path)
    acc.wait_for_everyone()
    return AutoTokenizer.from_pretrained(path)


def preset_model(args, vocab: int) -> LlamaForCausalLM:
    """A randomly initialised ``--model`` preset, the same weights on every rank (``--seed``)."""
    cfg = LlamaConfig(
        **PRESETS[args.model], vocab_size=vocab, max_position_embeddings=max(args.seq_len, 4096)
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg).to(torch.bfloat16 if args.bf16 else torch.float32)


def pretrained_model(args, vocab: int, mesh, config: TSPConfig, device=None):
    """The ``--model`` checkpoint as a TSP model, each rank reading only its slices
    (``tsp_ext.load_pretrained``): no rank ever holds the full model."""
    hf_config = AutoConfig.from_pretrained(args.model)
    if vocab > hf_config.vocab_size:
        raise SystemExit(
            f"the tokenizer has {vocab} tokens but {args.model} only {hf_config.vocab_size} "
            "embeddings: pass the model's own tokenizer with --tokenizer"
        )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return load_pretrained(args.model, mesh, config, device=device, dtype=dtype)
