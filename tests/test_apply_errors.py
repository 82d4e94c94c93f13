"""apply_tsp and the TSP model reject what they cannot run, with messages saying what to change."""

from __future__ import annotations

import functools

import pytest
import torch
from checks import error_message
from models import batch, build
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
)

from tsp_ext import ZigzagLayout, apply_tsp, gather_sequence, init_tsp_mesh, shard_batch

pytestmark = pytest.mark.multiproc


def errors_worker(rank, world):
    mesh = init_tsp_mesh(world)
    tiny = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, vocab_size=32)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, bos_token_id=0, eos_token_id=0)
    )
    glm4_moe = Glm4MoeForCausalLM(  # grouped top-k routing, shared experts: not built
        Glm4MoeConfig(
            **tiny,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            first_k_dense_replace=0,
        )
    )
    no_norm = build("llama")
    del no_norm.model.layers[0].input_layernorm
    model = apply_tsp(build("llama"), mesh)
    data = batch(model.config.vocab_size, 2, 8)
    local = shard_batch(data, mesh)
    no_shift = {k: v for k, v in local.items() if k != "shift_labels"}
    left_pad = {**data, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]] * 2)}
    head_bias = build("llama")
    head_bias.lm_head = torch.nn.Linear(32, 96, bias=True, dtype=torch.float64)
    bad_label = {**local, "labels": local["labels"].clone()}
    bad_label["shift_labels"] = bad_label["labels"]
    bad_label["labels"][0, 0] = 96
    return {
        "gpt2": error_message(lambda: apply_tsp(gpt2, mesh)),
        "moe": error_message(lambda: apply_tsp(glm4_moe, mesh)),
        "no_norm": error_message(lambda: apply_tsp(no_norm, mesh)),
        "partial_rope": error_message(
            lambda: apply_tsp(build("phi3", partial_rotary_factor=0.5), mesh)
        ),
        "window_1": error_message(lambda: apply_tsp(build("mistral", sliding_window=1), mesh)),
        "layer_types": error_message(
            lambda: apply_tsp(
                build("qwen2", layer_types=["full_attention", "chunked_attention"]), mesh
            )
        ),
        "relu": error_message(lambda: apply_tsp(build("llama", hidden_act="relu"), mesh)),
        "heads": error_message(
            lambda: apply_tsp(
                build("llama", hidden_size=48, num_attention_heads=1, num_key_value_heads=1), mesh
            )
        ),
        "world": error_message(lambda: init_tsp_mesh(3)),
        "size_mismatch": error_message(lambda: apply_tsp(build("llama"), mesh, tsp_size=4)),
        "twice": error_message(lambda: apply_tsp(model, mesh)),
        "no_positions": error_message(lambda: model(input_ids=local["input_ids"])),
        "mask": error_message(
            lambda: model(**local, attention_mask=torch.ones_like(local["input_ids"]))
        ),
        "no_shift": error_message(lambda: model(**no_shift)),
        "wrong_positions": error_message(
            lambda: model(**{**local, "position_ids": torch.arange(4)[None].expand(2, -1)})
        ),
        "left_pad": error_message(lambda: shard_batch(left_pad, mesh)),
        "doc_positions": error_message(
            lambda: shard_batch(
                {**data, "position_ids": torch.tensor([[0, 1, 2, 4, 5, 0, 1, 2]])}, mesh
            )
        ),
        "local_doc_positions": error_message(
            lambda: model(**{**local, "position_ids": local["position_ids"] + 100})
        ),
        "vocab": error_message(lambda: apply_tsp(build("llama", vocab_size=97), mesh)),
        "head_bias": error_message(lambda: apply_tsp(head_bias, mesh)),
        "label_range": error_message(lambda: model(**bad_label)),
        "id_range": error_message(
            lambda: model(**{**local, "input_ids": local["input_ids"].clamp(min=96)})
        ),
        "logits_to_keep": error_message(lambda: model(**local, logits_to_keep=1)),
        "unknown_key": error_message(
            lambda: shard_batch({**data, "token_type_ids": data["labels"]}, mesh)
        ),
        "images_text_model": error_message(
            lambda: shard_batch({**data, "pixel_values": data["labels"]}, mesh, model=model)
        ),
        "gather_none": error_message(lambda: gather_sequence(model(**local).logits, mesh)),
        "odd_length": error_message(lambda: ZigzagLayout(6, 2)),
    }


@functools.cache
def messages(workers):
    return workers.run(errors_worker, 2)[0]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("gpt2", "GPT2LMHeadModel is not a Hugging Face decoder-only causal LM"),
        ("moe", "Glm4MoeForCausalLM layer 0: its mixture-of-experts MLP is not supported; TSP"),
        ("no_norm", "LlamaForCausalLM layer 0: no input_layernorm, which the Llama family's"),
        ("partial_rope", "Phi3ForCausalLM: partial_rotary_factor=0.5 (RoPE on part of each"),
        ("window_1", "layer 0: sliding_window=1; TSP supports windows of 2 or more tokens"),
        ("layer_types", "layer types ['chunked_attention'] are not supported"),
        ("relu", "hidden_act='relu': TSP's gated MLP supports ['gelu', 'gelu_pytorch_tanh'"),
        ("heads", "the largest valid TSP size is 1"),
        ("world", "tsp_size=3 does not divide the world size 2"),
        ("size_mismatch", "tsp_size=4 but the mesh's 'tsp' dimension has 2 ranks"),
        ("twice", "already applied"),
        ("no_positions", "needs the global position_ids"),
        ("mask", "takes no attention_mask"),
        ("no_shift", "labels shifted before sharding"),
        ("wrong_positions", "position_ids of the TSP ranks do not fit together"),
        ("left_pad", "right padding only"),
        ("doc_positions", "row 0 has 4 at token 3; position_ids must count up by one"),
        ("local_doc_positions", "row 0 has 100 at global position 0"),
        ("vocab", "<no error>"),  # any vocabulary is sharded (rows 49 + 48)
        ("head_bias", "use TSPConfig(shard_vocab=False) for models with an LM-head bias"),
        ("label_range", "labels must be in [0, 96) or -100"),
        ("id_range", "input_ids must be in [0, 96)"),
        ("logits_to_keep", "logits_to_keep is not supported"),
        ("unknown_key", "does not know how to shard ['token_type_ids']"),
        (
            "images_text_model",
            "has ['pixel_values'], but LlamaForCausalLM is not a vision-language",
        ),
        ("gather_none", "gather_sequence needs a local [B, S/D, ...] tensor, got NoneType"),
        ("odd_length", "shard the batch with tsp_ext.shard_batch"),
    ],
)
def test_clear_errors(workers, case, expected):
    assert expected in messages(workers)[case]
