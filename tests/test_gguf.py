"""The recipes' GGUF conversion: a tiny Llama written as a GGUF file (as llama.cpp writes one:
Q/K rows permuted, tied embeddings, a BPE tokenizer) comes back as the same Hugging Face model."""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

from _data import train_tokenizer  # noqa: E402
from _gguf import cached_checkpoint, convert  # noqa: E402

TEXT = ["Friends, Romans, countrymen, lend me your ears;", "To be, or not to be: that is it."]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf`` reordering of a Q or K projection's rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(model, tokenizer, path: str) -> None:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == tokenizer.eos_token else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_bos_token_id(tokenizer.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied: GGUF has no output.weight
            continue
        w = t.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_converts_to_the_same_model_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(TEXT * 20, 300)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    path = str(tmp_path / "tiny.gguf")
    write_gguf(model, tokenizer, path)

    out = cached_checkpoint(path, str(tmp_path / "cache"))
    convert(path, out, shard_bytes=100_000)  # several files and their index
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(files) > 1 and "model.safetensors.index.json" in os.listdir(out)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.tie_word_embeddings
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = tokenizer(TEXT[1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert (
        AutoTokenizer.from_pretrained(out)(TEXT[0])["input_ids"] == tokenizer(TEXT[0])["input_ids"]
    )
    config = json.load(open(os.path.join(out, "config.json")))  # as save_pretrained writes it
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    # the same conversion as a command, for one's own scripts
    from export_model import main as export_model

    export_model([path, str(tmp_path / "exported")])
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model(ids).logits)
    # the cache key follows the file: the same file, the same place; a rewritten one, another
    assert cached_checkpoint(path, str(tmp_path / "cache")) == out
    os.utime(path, ns=(0, 0))
    assert cached_checkpoint(path, str(tmp_path / "cache")) != out
