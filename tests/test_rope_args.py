"""The recipes' context extension (``--rope-scaling``, ``--rope-factor``, ``--rope-theta``,
``--max-position``, ``recipes/_model.py``'s ``model_config``): the config each writes, and every
refusal, before any model is built (one process; the whole run: ``tests/test_recipe.py``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes"))

import dpo  # noqa: E402
import finetune_long_llama as recipe  # noqa: E402
import grpo  # noqa: E402
import sft_trainer  # noqa: E402
from _model import model_config  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A checkpoint's ``config.json``: 2048 positions, RoPE base 10000, no scaling."""
    path = str(tmp_path_factory.mktemp("ckpt"))
    cfg = LlamaConfig(hidden_size=16, num_attention_heads=2, max_position_embeddings=2048)
    cfg.save_pretrained(path)
    return path


def config(checkpoint: str, *argv: str, seq_len: int | None = None):
    return model_config(recipe.parse_args(["--model", checkpoint, *argv]), seq_len=seq_len)


@pytest.mark.parametrize(
    "argv, rope, positions",
    [
        (
            ["--rope-scaling", "yarn", "--rope-factor", "2"],
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
            4096,
        ),
        (  # the factor from the new context
            ["--rope-scaling", "llama3", "--max-position", "16384"],
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 2048,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            16384,
        ),
        (
            ["--rope-scaling", "linear", "--rope-factor", "1.5", "--max-position", "3072"],
            {"rope_type": "linear", "factor": 1.5},
            3072,
        ),
        (["--rope-theta", "5e5", "--max-position", "8192"], {"rope_type": "default"}, 8192),
        (
            ["--rope-theta", "5e5", "--rope-scaling", "yarn", "--rope-factor", "4"],
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
            8192,
        ),
    ],
)
def test_rope_arguments_extend_the_config(checkpoint, argv, rope, positions):
    cfg = config(checkpoint, *argv, seq_len=positions)
    theta = 5e5 if "--rope-theta" in argv else 10000.0
    assert cfg.rope_parameters == {**rope, "rope_theta": theta}
    assert cfg.max_position_embeddings == positions
    # the config saves and loads as Hugging Face reads it: the same rotary frequencies
    rotary = LlamaRotaryEmbedding(cfg)
    again = LlamaRotaryEmbedding(LlamaConfig.from_dict(cfg.to_dict()))
    assert torch.equal(rotary.inv_freq, again.inv_freq)
    plain = LlamaRotaryEmbedding(config(checkpoint))
    assert not torch.equal(rotary.inv_freq, plain.inv_freq) or rotary.attention_scaling != 1.0


def test_without_rope_arguments_the_config_is_the_checkpoints(checkpoint):
    cfg = config(checkpoint, seq_len=2048)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg.max_position_embeddings == 2048


@pytest.mark.parametrize(
    "argv, seq_len, expected",
    [
        (["--rope-scaling", "yarn", "--rope-factor", "1"], None, "--rope-factor 1: the extended"),
        (["--rope-scaling", "yarn", "--max-position", "1024"], None, "--max-position 1024: the"),
        (
            ["--rope-scaling", "yarn", "--rope-factor", "2", "--max-position", "5000"],
            None,
            "--max-position 5000 is not --rope-factor 2 x",
        ),
        (["--rope-scaling", "linear"], None, "--rope-scaling needs --rope-factor F"),
        (["--rope-factor", "2"], None, "--rope-factor 2 scales RoPE: add --rope-scaling yarn"),
        (["--max-position", "4096"], None, "need a RoPE change: add --rope-scaling yarn"),
        (["--rope-theta", "1000"], None, "--rope-theta 1000 is not above"),
        (
            ["--rope-theta", "5e5", "--max-position", "1024"],
            None,
            "--max-position 1024 is not beyond",
        ),
        ([], 5000, "add --rope-scaling yarn --rope-factor 3 (or --rope-theta T)"),
        (["--rope-scaling", "yarn", "--rope-factor", "2"], 5000, "add a larger --rope-factor"),
        (["--rope-theta", "5e5"], 5000, "add --max-position 5000"),
    ],
)
def test_bad_rope_arguments_are_refused(checkpoint, argv, seq_len, expected):
    with pytest.raises(SystemExit) as e:
        config(checkpoint, *argv, seq_len=seq_len)
    assert expected in str(e.value)
    if seq_len:
        assert "max_position_embeddings=" in str(e.value)


def test_a_rope_type_tsp_refuses_or_a_scaled_model_is_refused(checkpoint, tmp_path, capsys):
    for kind in ("dynamic", "longrope"):
        with pytest.raises(SystemExit):
            recipe.parse_args(["--rope-scaling", kind])
        assert f"'{kind}': TSP runs yarn, llama3, linear RoPE scaling" in capsys.readouterr().err
    scaled = LlamaConfig(hidden_size=16, num_attention_heads=2, max_position_embeddings=4096)
    scaled.rope_parameters = {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 2048,
        "rope_theta": 10000.0,
    }
    scaled.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=r"already scales RoPE \(yarn, factor 2.0\)"):
        config(str(tmp_path), "--rope-scaling", "linear", "--rope-factor", "2")
    assert config(str(tmp_path), "--rope-theta", "2e4").rope_parameters["factor"] == 2.0


@pytest.mark.parametrize("script", [sft_trainer, dpo, grpo])
def test_trainer_recipes_refuse_before_any_work(script, tmp_path):
    argv = ["--rope-scaling", "yarn", "--rope-factor", "0.5", "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="--rope-factor 0.5: the extended context"):
        script.main(["--model", "tiny-llama", *argv])
    assert not os.listdir(tmp_path)
