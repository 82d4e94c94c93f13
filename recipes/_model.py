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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tsp_ext import TSPConfig, apply_tsp, load_pretrained

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


def preset_model(args, vocab: int):
    """A randomly initialised ``--model`` preset, the same weights on every rank (``--seed``)."""
    fields = dict(PRESETS[args.model])
    model_type = fields.pop("model_type", "llama")
    length = max(args.seq_len, 4096)
    cfg = AutoConfig.for_model(
        model_type, **fields, vocab_size=vocab, max_position_embeddings=length
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return model.to(torch.bfloat16 if args.bf16 else torch.float32)


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


def lora_config(args):
    """The ``LoraConfig`` of ``--lora-*`` (None without ``--lora-r``)."""
    if args.qlora and not args.lora_r:
        raise SystemExit("--qlora trains a LoRA adapter on a 4-bit base: add --lora-r")
    if not args.lora_r:
        return None
    from peft import LoraConfig

    targets = [t for t in args.lora_targets.split(",") if t]
    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r
    return LoraConfig(
        r=args.lora_r, lora_alpha=alpha, lora_dropout=args.lora_dropout, target_modules=targets
    )


def add_lora(model, args, tsp_config: TSPConfig):
    """``model`` with a LoRA adapter (``--lora-r``), the same on every rank (``--seed``); a model
    that is already a TSP model (``load_pretrained``) gets its adapters folded onto its shards
    (and, ``--qlora``, its base quantized: ``tsp_config``)."""
    config = lora_config(args)
    if config is None:
        return model
    from peft import get_peft_model

    torch.manual_seed(args.seed)
    peft = get_peft_model(model, config)
    if getattr(model, "tsp", None) is not None:
        apply_tsp(peft, config=tsp_config)
    return peft


def adapter_parameters(hf_config, args) -> int:
    """Parameters of the ``--lora-*`` adapter on the whole model: ``r x (in + out)`` of every
    adapted projection of every layer."""
    h, f = hf_config.hidden_size, hf_config.intermediate_size
    d = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * d, hf_config.num_key_value_heads * d
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    sizes.update(gate_proj=h + f, up_proj=h + f, down_proj=f + h)
    per_layer = sum(sizes[t] for t in args.lora_targets.split(",") if t)
    return args.lora_r * per_layer * hf_config.num_hidden_layers
