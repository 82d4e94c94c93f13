"""Single-process error messages that say what to change: recipe arguments, unsupported norms,
timeouts."""

from __future__ import annotations

import os
import sys

import pytest
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from tsp_ext import init_tsp_mesh
from tsp_ext.hf.apply import check_supported

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes"))

import finetune_long_llama as recipe  # noqa: E402
import generate  # noqa: E402
from _data import load_texts  # noqa: E402


def test_empty_dataset_glob_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"--dataset text:.*: no file matches '.*\*\.txt'"):
        load_texts(f"text:{tmp_path}/*.txt", "text")


def test_seq_len_beyond_max_positions_is_refused_with_the_rope_hint(tmp_path):
    LlamaConfig(hidden_size=16, num_attention_heads=2, max_position_embeddings=256).save_pretrained(
        tmp_path
    )
    args = recipe.parse_args(["--model", str(tmp_path), "--seq-len", "512", "--tsp-size", "2"])
    with pytest.raises(SystemExit, match="max_position_embeddings=256") as e:
        recipe.check_args(args, 2)
    assert "add --rope-scaling yarn --rope-factor 2" in str(e.value)
    args = recipe.parse_args(["--model", str(tmp_path), "--seq-len", "256", "--tsp-size", "2"])
    recipe.check_args(args, 2)  # within the trained positions: accepted


def test_dist_timeout_must_be_positive():
    with pytest.raises(SystemExit, match="--dist-timeout 0.0: give a positive number of seconds"):
        recipe.main(["--dist-timeout", "0"])
    with pytest.raises(ValueError, match="timeout must be positive"):
        init_tsp_mesh(1, timeout=-5)


def test_norms_of_another_kind_are_refused_naming_the_model_type():
    """A Llama-layout model with a Gemma (1 + w) norm: not the Llama family's RMSNorm."""
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
    )
    model = LlamaForCausalLM(cfg)
    model.model.layers[0].input_layernorm = GemmaRMSNorm(16)
    with pytest.raises(ValueError) as e:
        check_supported(model)
    message = str(e.value)
    assert (
        "LlamaForCausalLM (model_type='llama') layer 0: input_layernorm is a GemmaRMSNorm, not "
        "the Llama family's RMSNorm (x / rms(x) * weight, with variance_epsilon)" in message
    )
    assert "supported: LlamaForCausalLM, MistralForCausalLM" in message


def test_generate_refuses_a_missing_checkpoint_or_prompt_file(tmp_path):
    """docs/inference.md once named outputs/finetune/final: the error says what is missing (not
    a hub message from the tokenizer) and where make demo writes its checkpoint."""
    missing = str(tmp_path / "outputs" / "finetune" / "final")
    with pytest.raises(SystemExit, match="no such directory; give a Hugging Face checkpoint"):
        generate.parse_args(["--checkpoint", missing])
    with pytest.raises(SystemExit, match="has no config.json"):
        generate.parse_args(["--checkpoint", str(tmp_path)])
    with pytest.raises(SystemExit, match="--prompt-file .*play.md: no such file"):
        generate.parse_args(["--prompt-file", str(tmp_path / "play.md")])
