"""Vocab-sharded embedding and LM head at a real vocabulary size (V = 32K): bytes per rank.

Parity of the loss and every gradient with the unmodified model (tied and untied, ignored
labels, padding) is in test_apply_tsp; this file measures what sharding the vocabulary saves.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import lm_loss
from transformers import LlamaConfig, LlamaForCausalLM

from tsp_ext import TSPConfig, apply_tsp, full_grads, gather_sequence, init_tsp_mesh, shard_batch
from tsp_ext.memory import PeakAllocated, SavedTensorBytes
from tsp_ext.testing.launch import run_processes

pytestmark = pytest.mark.multiproc

VOCAB, HIDDEN, SEQ, CHUNK = 32768, 64, 2048, 128
F32 = 4


def llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


def loss_transient(head, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """Peak bytes allocated by the fused LM-head loss, forward + backward, and bytes it saves."""
    h = hidden.detach().requires_grad_()
    with PeakAllocated() as peak:
        with SavedTensorBytes(ignore=[head.weight, h]) as saved:
            loss = head(h, labels)
        loss.backward()
    return peak.nbytes, saved.nbytes


def vocab_worker(rank, world):
    mesh = init_tsp_mesh(world)
    out = {}
    for tied in (False, True):
        model = apply_tsp(llama(tied), mesh, config=TSPConfig(loss_chunk=CHUNK))
        tables = {id(p): p for p in (model.model.embed_tokens.weight, model.lm_head.weight)}
        out[f"table_bytes_tied={tied}"] = sum(p.nbytes for p in tables.values())
    head = model.lm_head
    g = torch.Generator().manual_seed(0)
    for seq in (SEQ, 2 * SEQ):
        tokens = seq // world
        hidden = torch.randn(1, tokens, HIDDEN, generator=g)
        labels = torch.randint(0, VOCAB, (1, tokens), generator=g)
        labels[0, ::5] = -100
        out[f"peak_seq={seq}"], out[f"saved_seq={seq}"] = loss_transient(head, hidden, labels)
    return out


def logits_path_worker(rank, world):
    """Logits returned on request carry gradients: a loss built from them trains identically."""
    mesh = init_tsp_mesh(world)
    model = apply_tsp(llama(tied=True), mesh, config=TSPConfig(loss_chunk=CHUNK))
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 64))
    local = shard_batch({"input_ids": ids, "labels": ids}, mesh)
    model(**local).loss.backward()
    fused = full_grads(model)
    model.zero_grad()
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    # every rank computes the same full loss; gather_sequence's backward sums the D copies
    (lm_loss(gather_sequence(logits, mesh, seq_len=64), ids) / world).backward()
    via_logits = full_grads(model)
    return max(((fused[n] - g).abs().max() / g.abs().max()).item() for n, g in via_logits.items())


@functools.cache
def measured(world):
    return run_processes(vocab_worker, world)


def reference_logits_bytes(tokens: int) -> int:
    """What a replicated LM head allocates at least: the float32 logits of the local tokens."""
    return tokens * VOCAB * F32


@pytest.mark.parametrize("world", [1, 2, 4])
def test_embedding_and_lm_head_bytes_scale_as_one_over_d(world):
    full = VOCAB * HIDDEN * F32
    for rank, m in enumerate(measured(world)):
        assert m["table_bytes_tied=False"] == 2 * full // world, (rank, m)
        assert m["table_bytes_tied=True"] == full // world, (rank, m)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_loss_transient_is_bounded_by_the_chunk_not_the_logits(world):
    rows = VOCAB // world
    for rank, m in enumerate(measured(world)):
        for seq in (SEQ, 2 * SEQ):
            tokens = seq // world
            # a few [chunk, V/D] blocks, the weight-sized gradient ring and ring buffers, and
            # per-token vectors ([N, h] dH; no [N, V/D] term)
            bound = F32 * (4 * CHUNK * rows + 8 * rows * HIDDEN + 3 * tokens * HIDDEN)
            assert m[f"peak_seq={seq}"] < bound, (rank, seq, m, bound)
            assert m[f"peak_seq={seq}"] < reference_logits_bytes(tokens) / 2, (rank, seq, m)
            # saved for backward: the labels and one log-sum-exp per token, nothing [N, V/D]
            assert m[f"saved_seq={seq}"] <= tokens * (8 + 8), (rank, seq, m)
        # twice the tokens adds per-token vectors only, never a [tokens, V/D] block
        growth = m[f"peak_seq={2 * SEQ}"] - m[f"peak_seq={SEQ}"]
        assert growth < F32 * 4 * (SEQ // world) * HIDDEN, (rank, growth, m)


@pytest.mark.parametrize("world", [2])
def test_requested_logits_have_exact_gradients(world):
    for rank, err in enumerate(run_processes(logits_path_worker, world)):
        assert err < 1e-5, (rank, err)
