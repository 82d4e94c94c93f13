"""The recipes' ``--dataset`` rows as users hold them (``recipes/_data.py``): local files told
apart by their columns exactly as hub datasets, single process, on tiny files."""

from __future__ import annotations

import json
import os
import sys

import pytest
from datasets import Dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes"))

from _data import (  # noqa: E402
    documents,
    length_report,
    load_blocks,
    load_rows,
    load_texts,
    preference_rows,
    row_kind,
    tokenized,
    train_tokenizer,
)

CHAT = [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay."}]
ROWS = {
    "preference": [{"prompt": "Who is there? ", "chosen": "Nay, answer me.", "rejected": "Hi."}],
    "messages": [{"messages": CHAT}],
    "completion": [{"prompt": "Who is there? ", "completion": "Nay, answer me."}],
    "text": [{"text": "Who is there? Nay, answer me."}, {"text": ""}],
}


def jsonl(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return f"json:{path}"


@pytest.mark.parametrize("kind", list(ROWS))
def test_json_lines_kinds_and_their_texts(tmp_path, kind):
    source = jsonl(tmp_path / "data.jsonl", ROWS[kind])
    rows = load_rows(source)
    assert row_kind(rows.column_names, "text", source) == kind
    expected = {
        "preference": "Who is there? Nay, answer me.",
        "messages": "user: Who is there?\nassistant: Nay.",  # no tokenizer: role-prefixed lines
        "completion": "Who is there? Nay, answer me.",
        "text": "Who is there? Nay, answer me.",  # the empty document dropped
    }[kind]
    assert load_texts(source, "text") == [expected]
    pairs = preference_rows(rows, "text", source) if kind in ("preference", "text") else None
    if kind == "preference":
        assert pairs.column_names == ["prompt", "chosen", "rejected"] and pairs[0] == ROWS[kind][0]
    elif kind == "text":
        assert pairs is None  # DPO builds pairs from plain text
    else:
        with pytest.raises(ValueError, match=f"holds {kind} rows .* not preference pairs"):
            preference_rows(rows, "text", source)


def test_csv_parquet_and_hub_rows_are_detected_alike(tmp_path):
    """The same columns in CSV and Parquet files, and an in-memory (hub-like) dataset, give the
    same kind and texts."""
    data = Dataset.from_list(ROWS["completion"] * 2)
    data.to_csv(str(tmp_path / "d.csv"), index=False)
    data.to_parquet(str(tmp_path / "d.parquet"))
    for source in (f"csv:{tmp_path}/*.csv", f"parquet:{tmp_path}/*.parquet"):
        assert (
            load_texts(source, "text")
            == documents(data, "text", "hub")
            == ["Who is there? Nay, answer me."] * 2
        )


def test_chat_renders_with_the_tokenizers_template(tmp_path):
    source = jsonl(tmp_path / "chat.jsonl", ROWS["messages"])
    tok = train_tokenizer(["Who is there? Nay."], 300)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    )
    assert load_texts(source, "text", tokenizer=tok) == [
        "<|user|>Who is there?<|end|><|assistant|>Nay.<|end|>"
    ]


def test_unknown_columns_and_bad_messages_are_refused(tmp_path):
    source = jsonl(tmp_path / "body.jsonl", [{"body": "x", "title": "y"}])
    with pytest.raises(ValueError) as e:
        load_texts(source, "text")
    message = str(e.value)
    assert "has no column 'text'" in message and "['body', 'title']" in message
    assert "prompt / chosen / rejected" in message and "messages" in message
    assert "prompt / completion" in message
    assert load_texts(source, "body") == ["x"]  # --text-column names another text column
    bad = jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match="not a list of {role, content} dicts"):
        load_texts(bad, "text")


def test_conversational_pairs_render_as_one_chat(tmp_path):
    """TRL's conversational format: prompt and answer are lists of messages, joined into one
    conversation."""
    row = {
        "prompt": CHAT[:1],
        "chosen": CHAT[1:],
        "rejected": [{"role": "assistant", "content": "?"}],
    }
    source = jsonl(tmp_path / "conv.jsonl", [row])
    assert load_texts(source, "text") == ["user: Who is there?\nassistant: Nay."]
    assert preference_rows(load_rows(source), "text", source)[0] == row


def test_long_documents_become_windows_and_the_log_says_how_much_is_long(caplog):
    """A document longer than --seq-len is cut into consecutive windows (never dropped, both
    packings); the log reports the documents at least --seq-len long and their share of tokens."""
    tok = train_tokenizer(["a b c d e f g h i j"] * 4, 64)
    texts = [" ".join(["a"] * 40), "b c", " ".join(["d"] * 20)]
    total = sum(map(len, tokenized(texts, tok)))
    assert length_report([[0] * 41, [0] * 3, [0] * 21], 16) == (
        "data: 3 documents, 65 tokens; 2 of them at least --seq-len 16 tokens long, holding "
        "95.4% of the tokens"
    )
    with caplog.at_level("INFO", logger="data"):
        stream = load_blocks(texts, tok, 16, "stream")["input_ids"]
        rows = load_blocks(texts, tok, 16, "documents")
    assert "2 of them at least --seq-len 16" in caplog.text
    assert stream.numel() == total // 16 * 16  # whole blocks of the stream, the tail dropped
    assert int(rows["attention_mask"].sum()) == total  # every token of every window kept
    assert max(map(len, tokenized(texts, tok))) > 16  # a document longer than --seq-len
