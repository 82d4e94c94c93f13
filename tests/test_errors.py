"""Bad input raises a clear error that says what to change."""

import functools

import pytest
import torch
import torch.distributed as dist
from checks import error_message
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding

from tsp_ext import AttentionSpec, TSPAttention, TSPConfig, TSPGatedMLP

pytestmark = pytest.mark.multiproc


def errors_worker(rank, world):
    group = dist.group.WORLD
    cfg = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1, vocab_size=32)
    ok = LlamaConfig(**cfg, num_attention_heads=4, num_key_value_heads=2)
    one_head = LlamaConfig(**cfg, num_attention_heads=1, num_key_value_heads=1)
    one_row = LlamaConfig(**{**cfg, "intermediate_size": 1}, num_attention_heads=4)
    relu = LlamaConfig(**cfg, num_attention_heads=4, hidden_act="relu")
    attn = TSPAttention.from_hf(LlamaAttention(ok, 0), group)
    mlp = TSPGatedMLP.from_hf(LlamaMLP(ok), group)
    rope = LlamaRotaryEmbedding(ok)
    x = torch.randn(1, 4, 24)
    pe = rope(x, torch.arange(4)[None])
    return {
        "heads": error_message(lambda: TSPAttention.from_hf(LlamaAttention(one_head, 0), group)),
        "ffn": error_message(lambda: TSPGatedMLP.from_hf(LlamaMLP(one_row), group)),
        "act": error_message(lambda: TSPGatedMLP.from_hf(LlamaMLP(relu), group)),
        "group": error_message(
            lambda: TSPAttention(AttentionSpec(24, 4, 2, 6, tsp_size=4, scaling=1.0), group)
        ),
        "hidden": error_message(lambda: attn(torch.randn(1, 4, 20), position_embeddings=pe)),
        "odd_local": error_message(lambda: attn(torch.randn(1, 3, 24), position_embeddings=pe)),
        "rope": error_message(lambda: attn(x, position_embeddings=rope(x, torch.arange(2)[None]))),
        "mask": error_message(
            lambda: attn(x, position_embeddings=pe, attention_mask=torch.ones(1, 4))
        ),
        "mlp_shape": error_message(lambda: mlp(torch.randn(4, 24))),
    }


@functools.cache
def messages(workers):
    return workers.run(errors_worker, 2)[0]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("heads", "tsp_size=2 but the model has n_heads=1: every TSP rank needs at least one"),
        ("heads", "the largest valid TSP size is 1"),
        ("ffn", "intermediate_size=1 cannot be split over tsp_size=2: use a smaller TSP size"),
        ("act", "hidden_act='relu': TSP's gated MLP supports ['gelu', 'gelu_pytorch_tanh',"),
        ("group", "process group has 2 ranks but the spec is for tsp_size=4"),
        ("hidden", "hidden_states must be [B, S/D, 24]"),
        ("odd_local", "local sequence length 3 must be even"),
        ("rope", "position_embeddings must be (cos, sin) of shape [B, 4, 6]"),
        ("mask", "takes no attention_mask"),
        ("mlp_shape", "x must be [B, S/D, 24]"),
    ],
)
def test_clear_errors(workers, case, expected):
    assert expected in messages(workers)[case]


def test_spec_and_config_validation():
    with pytest.raises(ValueError, match="the largest valid TSP size is 12"):
        AttentionSpec(48, 12, 6, 4, tsp_size=13, scaling=1.0)
    with pytest.raises(ValueError, match="not a multiple of n_kv_heads"):
        AttentionSpec(48, 6, 4, 8, tsp_size=2, scaling=1.0)
    with pytest.raises(ValueError, match="tsp_size must be >= 1"):
        TSPConfig(tsp_size=0)
    with pytest.raises(ValueError, match="floating dtype"):
        TSPConfig(accum_dtype=torch.int32)
    with pytest.raises(ValueError, match="head_bucket must be >= 1 KV head or None, got 0"):
        TSPConfig(head_bucket=0)
    with pytest.raises(ValueError, match="set checkpoint_layers=True too"):
        TSPConfig(offload_checkpoints=True)
    with pytest.raises(ValueError, match="checkpoint_every=2: an interval .* needs checkpoint_"):
        TSPConfig(checkpoint_every=2)
    with pytest.raises(ValueError, match="checkpoint_every=0: an interval of layers"):
        TSPConfig(checkpoint_layers=True, checkpoint_every=0)
    with pytest.raises(ValueError, match="checkpoint_device_bytes=64: .* needs offload_check"):
        TSPConfig(checkpoint_layers=True, checkpoint_device_bytes=64)
