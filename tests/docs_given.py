"""The names a documentation fragment uses without defining them (``model``, ``ids``, ``path``,
...), at test size: what ``<!-- docs-test: given=model,ids -->`` before a block in README.md or
docs/*.md binds. ``model=tsp`` binds ``model`` to the tiny Llama with TSP applied over ``mesh``.

Every value is the same on every rank (fixed seeds), as a launcher's ranks would build it."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

VOCAB, SEQ = 128, 64


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )


def _model(ctx: dict):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def _tsp_model(ctx: dict):
    from tsp_ext import apply_tsp

    return apply_tsp(_model(ctx), value(ctx, "mesh"))


def _mesh(ctx: dict):
    from tsp_ext import init_tsp_mesh

    return init_tsp_mesh(ctx["world"])


def _ids(ctx: dict) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _path(ctx: dict) -> str:
    """A local Hugging Face checkpoint of the tiny Llama (written by rank 0)."""
    path = os.path.join(ctx["workdir"], "tiny-llama")
    if ctx["rank"] == 0 and not os.path.isdir(path):
        _model(ctx).save_pretrained(path)
    dist.barrier()
    return path


def _loader(ctx: dict) -> list[dict]:
    ids = _ids(ctx)
    return [{"input_ids": row[None], "labels": row[None]} for row in ids]


def _optimizer(ctx: dict):
    return torch.optim.AdamW(value(ctx, "model=tsp").parameters(), lr=1e-3)


def _scheduler(ctx: dict):
    return torch.optim.lr_scheduler.LambdaLR(value(ctx, "optimizer"), lambda step: 1.0)


def _examples(ctx: dict) -> list[dict]:
    """Three documents of 40, 16 and 8 tokens (packed to 64, a multiple of 2 x TSP size)."""
    ids = _ids(ctx)[0].tolist()
    return [{"input_ids": ids[:40]}, {"input_ids": ids[40:56]}, {"input_ids": ids[56:]}]


def _tokenizer(ctx: dict):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def _ds(ctx: dict):
    from datasets import Dataset

    rows = _ids(ctx)
    return Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})


def _sft_config(ctx: dict):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=os.path.join(ctx["workdir"], "sft"),
        max_steps=1,
        report_to=[],
        use_cpu=True,
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=None,
    )


GIVEN: dict[str, Callable[[dict], object]] = {
    "model": _model,
    "model=tsp": _tsp_model,
    "mesh": _mesh,
    "ids": _ids,
    "input_ids": _ids,
    "labels": _ids,
    "mask": lambda ctx: torch.ones_like(_ids(ctx)),
    "path": _path,
    "loader": _loader,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "examples": _examples,
    "seq_len": lambda ctx: SEQ,
    "x": lambda ctx: torch.randn(1, SEQ, 64, generator=torch.Generator().manual_seed(2)),
    "hf_layer": lambda ctx: value(ctx, "model").model.layers[0],
    "rotary": lambda ctx: value(ctx, "model").model.rotary_emb,
    "tokenizer": _tokenizer,
    "ds": _ds,
    "sft_config": _sft_config,
}


def value(ctx: dict, key: str):
    """``GIVEN[key]``, built once per block (``ctx`` caches it)."""
    cache = ctx.setdefault("built", {})
    if key not in cache:
        cache[key] = GIVEN[key](ctx)
    return cache[key]


def namespace(keys: list[str], rank: int, world: int, workdir: str) -> dict:
    """The globals a block runs in: each given key bound under its name (``model=tsp`` as
    ``model``)."""
    ctx = {"rank": rank, "world": world, "workdir": workdir}
    return {key.split("=")[0]: value(ctx, key) for key in keys}
