"""The model and tokenizer a recipe trains: ``--model`` (a preset built from a config, a Hugging
Face checkpoint directory or hub id, or a GGUF file converted once) and ``--tokenizer``."""

from __future__ import annotations

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


def model_config(args, vocab: int | None = None, seq_len: int | None = None):
    """``--model``'s Hugging Face config, extended by ``--rope-*`` / ``--max-position``
    (``extend_context``): a preset's built (``vocab`` tokens; the type's default until the
    tokenizer is known), a checkpoint's read. ``seq_len`` given: refused if beyond its positions.
    The same on every rank (it reads only ``config.json``), so every rank stops alike."""
    if args.model in PRESETS:
        fields = dict(PRESETS[args.model])
        model_type = fields.pop("model_type", "llama")
        if vocab is not None:
            fields["vocab_size"] = vocab
        length = max(args.seq_len, 4096)
        cfg = AutoConfig.for_model(model_type, **fields, max_position_embeddings=length)
        name = f"the {args.model} preset"
    else:
        cfg, name = AutoConfig.from_pretrained(args.model), args.model
    extend_context(cfg, args, name)
    if seq_len is not None:
        check_context(seq_len, cfg, name, args)
    return cfg


def extend_context(hf_config, args, name: str) -> None:
    """Set ``hf_config``'s RoPE (``rope_parameters``) and ``max_position_embeddings`` from
    ``--rope-scaling`` / ``--rope-factor`` / ``--rope-theta`` / ``--max-position``, in place:
    what the model is built with, hence what its export's ``config.json`` says. Scaling starts
    from an unscaled model; ``original_max_position_embeddings`` is its
    ``max_position_embeddings``."""
    scaling, factor = args.rope_scaling, args.rope_factor
    theta, longest = args.rope_theta, args.max_position
    if scaling is None and factor is not None:
        raise SystemExit(
            f"--rope-factor {factor:g} scales RoPE: add --rope-scaling yarn (or llama3, linear)"
        )
    if scaling is None and theta is None:
        if longest is not None:
            raise SystemExit(
                f"--max-position {longest}: positions past {name}'s max_position_embeddings need "
                "a RoPE change: add --rope-scaling yarn --rope-factor F, or a larger base "
                "--rope-theta T"
            )
        return
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise SystemExit(
            f"{name} has one RoPE per layer type: the --rope-* arguments set a single one; "
            "edit the rope_parameters of its config.json instead"
        )
    if scaling and rope.get("rope_type", "default") != "default":
        raise SystemExit(
            f"{name} already scales RoPE ({rope['rope_type']}, factor {rope.get('factor')}): "
            "--rope-scaling starts from an unscaled model; train it as it is, or give only "
            "--rope-theta"
        )
    original = hf_config.max_position_embeddings
    if theta is not None:
        base = rope.get("rope_theta", getattr(hf_config, "default_theta", None))
        if base is not None and theta <= base:
            raise SystemExit(
                f"--rope-theta {theta:g} is not above {name}'s rope_theta {base:g}: ABF extends "
                "the context with a larger base"
            )
        rope["rope_theta"] = theta
    if scaling:
        factor, longest = scaled_length(factor, longest, original, name)
        rope.update(rope_type=scaling, factor=factor)
        if scaling != "linear":
            rope["original_max_position_embeddings"] = original
        if scaling == "llama3":  # Llama-3.1's
            rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    elif longest is not None and longest <= original:
        raise SystemExit(
            f"--max-position {longest} is not beyond {name}'s max_position_embeddings {original}"
        )
    hf_config.rope_parameters = rope
    hf_config.max_position_embeddings = longest or original


def scaled_length(factor: float | None, longest: int | None, original: int, name: str):
    """``(factor, new context)`` of ``--rope-factor`` / ``--max-position``, either given (the
    other follows from ``original``, the model's positions) or both (they must agree)."""
    if factor is None and longest is None:
        raise SystemExit(
            f"--rope-scaling needs --rope-factor F, or --max-position N (F = N / {original}, "
            f"{name}'s max_position_embeddings)"
        )
    given = factor is not None
    factor = factor if given else longest / original
    if factor <= 1:
        what = f"--rope-factor {factor:g}" if given else f"--max-position {longest}"
        raise SystemExit(
            f"{what}: the extended context must be longer than {name}'s "
            f"max_position_embeddings {original} (a factor above 1)"
        )
    if longest is None:
        longest = int(factor * original)
    elif given and longest != factor * original:
        raise SystemExit(
            f"--max-position {longest} is not --rope-factor {factor:g} x {name}'s "
            f"max_position_embeddings {original} = {factor * original:g}: give one of them, or "
            "make them agree"
        )
    return float(factor), longest


def check_context(seq_len: int, hf_config, name: str, args) -> None:
    """Refuse a ``--seq-len`` beyond the positions of ``hf_config`` (as extended), saying which
    argument extends them."""
    limit = hf_config.max_position_embeddings
    if seq_len <= limit:
        return
    if args.rope_scaling:
        fix = f"a larger --rope-factor (or --max-position {seq_len})"
    elif args.rope_theta:
        fix = f"--max-position {seq_len} (the context the larger base is trained for)"
    else:
        fix = f"--rope-scaling yarn --rope-factor {-(-seq_len // limit)} (or --rope-theta T)"
    raise SystemExit(
        f"--seq-len {seq_len} is beyond {name}'s max_position_embeddings={limit}: positions past "
        f"it were never trained. Use --seq-len <= {limit}, or extend the context: add {fix}"
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
    cfg = model_config(args, vocab)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return model.to(torch.bfloat16 if args.bf16 else torch.float32)


def pretrained_model(args, vocab: int, mesh, config: TSPConfig, device=None):
    """The ``--model`` checkpoint as a TSP model (its config extended by ``--rope-*``), each rank
    reading only its slices (``tsp_ext.load_pretrained``): no rank ever holds the full model."""
    hf_config = model_config(args)
    if vocab > hf_config.vocab_size:
        raise SystemExit(
            f"the tokenizer has {vocab} tokens but {args.model} only {hf_config.vocab_size} "
            "embeddings: pass the model's own tokenizer with --tokenizer"
        )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return load_pretrained(
        args.model, mesh, config, device=device, hf_config=hf_config, dtype=dtype
    )


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
