"""Vocab-sharded embedding and LM head at a real vocabulary size (V = 32K): bytes per rank.

Parity of the loss and every gradient with the unmodified model (tied and untied, ignored
labels, padding) is in test_apply_tsp; this file measures what sharding the vocabulary saves.
"""

from __future__ import annotations

import functools

import pytest
import torch
from checks import rel_err, table
from models import lm_loss
from transformers import LlamaConfig, LlamaForCausalLM

from tsp_ext import TSPConfig, apply_tsp, full_grads, gather_sequence, init_tsp_mesh, shard_batch
from tsp_ext.memory import PeakAllocated, SavedTensorBytes

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
def measured(workers, world):
    return workers.run(vocab_worker, world)


def reference_logits_bytes(tokens: int) -> int:
    """What a replicated LM head allocates at least: the float32 logits of the local tokens."""
    return tokens * VOCAB * F32


@pytest.mark.parametrize("world", [1, 2, 4])
def test_embedding_and_lm_head_bytes_scale_as_one_over_d(workers, world):
    full = VOCAB * HIDDEN * F32
    for rank, m in enumerate(measured(workers, world)):
        assert m["table_bytes_tied=False"] == 2 * full // world, (rank, m)
        assert m["table_bytes_tied=True"] == full // world, (rank, m)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_loss_transient_is_bounded_by_the_chunk_not_the_logits(workers, world):
    rows = VOCAB // world
    for rank, m in enumerate(measured(workers, world)):
        for seq in (SEQ, 2 * SEQ):
            tokens = seq // world
            # a few [chunk, V/D] blocks, the weight-sized gradient ring and ring buffers, and
            # per-token vectors ([N, h] dH; no [N, V/D] term)
            bound = F32 * (4 * CHUNK * rows + 8 * rows * HIDDEN + 3 * tokens * HIDDEN)
            assert m[f"peak_seq={seq}"] < bound, (rank, seq, m, bound)
            assert m[f"peak_seq={seq}"] < reference_logits_bytes(tokens) / 2, (rank, seq, m)
            # saved for backward: the labels and one log-sum-exp per token, and the last
            # shard's gradient shares dH [N, h] and dW [V/D, h]; nothing [N, V/D]
            shares = F32 * (tokens + rows) * HIDDEN
            assert m[f"saved_seq={seq}"] <= tokens * (8 + 8) + shares, (rank, seq, m)
        # twice the tokens adds per-token vectors only, never a [tokens, V/D] block
        growth = m[f"peak_seq={2 * SEQ}"] - m[f"peak_seq={SEQ}"]
        assert growth < F32 * 4 * (SEQ // world) * HIDDEN, (rank, growth, m)


@pytest.mark.parametrize("world", [2])
def test_requested_logits_have_exact_gradients(workers, world):
    for rank, err in enumerate(workers.run(logits_path_worker, world)):
        assert err < 1e-5, (rank, err)


def fused_loss_worker(rank, world):
    """``ring_cross_entropy`` against ``F.cross_entropy`` of the full logits (float64, V = 37
    split unevenly, 5-token blocks): the loss, and dH / dW for a backward scaled by 3.5, run
    twice on a retained graph; under no_grad the same loss."""
    from tsp_ext.engine.sharding.partition import split_offsets
    from tsp_ext.engine.vocab import VocabShards, ring_cross_entropy

    mesh = init_tsp_mesh(world)
    group = mesh["tsp"].get_group()
    V, H, N = 37, 6, 13
    g = torch.Generator().manual_seed(0)
    h_all = torch.randn(world, N, H, generator=g, dtype=torch.float64)
    labels_all = torch.randint(0, V, (world, N), generator=g)
    labels_all[:, ::4] = -100
    w_full = torch.randn(V, H, generator=g, dtype=torch.float64)
    offsets = split_offsets(V, world)
    rows = slice(offsets[rank], offsets[rank + 1])

    ref_h = h_all.clone().requires_grad_()
    ref_w = w_full.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(
        (ref_h @ ref_w.t()).flatten(0, 1), labels_all.flatten(), reduction="none"
    ).view(world, N)
    (ref.sum() * 3.5).backward()

    h = h_all[rank].clone().requires_grad_()
    w = w_full[rows].clone().requires_grad_()
    cfg = TSPConfig(loss_chunk=5)
    shards = VocabShards(offsets, group, cfg)
    loss = ring_cross_entropy(h, labels_all[rank], w, shards, ignore_index=-100)
    (loss * 3.5).backward(retain_graph=True)
    once = h.grad.clone(), w.grad.clone()
    (loss * 3.5).backward()
    with torch.no_grad():
        eval_loss = ring_cross_entropy(h, labels_all[rank], w, shards, ignore_index=-100)
    return {
        "loss": rel_err(loss.detach(), ref[rank].sum().detach()),
        "eval_loss": rel_err(eval_loss, ref[rank].sum().detach()),
        "dh": rel_err(once[0], ref_h.grad[rank]),
        "dw": rel_err(once[1], ref_w.grad[rows]),
        "dh_twice": rel_err(h.grad, 2 * ref_h.grad[rank]),
        "dw_twice": rel_err(w.grad, 2 * ref_w.grad[rows]),
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_loss_gradients_scale_and_retain(workers, world):
    for rank, errs in enumerate(workers.run(fused_loss_worker, world)):
        assert max(errs.values()) < 1e-12, (rank, errs)


def test_engine_docs_table_is_what_this_measures(workers):
    """docs/engine.md quotes this module's measurements (rank 0): they match exactly."""
    rows = {r[0]: r[1:] for r in table("docs/engine.md", "| | D=1 | D=2 | D=4 |")}
    got = {w: measured(workers, w)[0] for w in (1, 2, 4)}
    expected = {
        "embedding + LM head bytes per rank (untied)": "table_bytes_tied=False",
        "the same, tied": "table_bytes_tied=True",
        f"loss peak transient, S = {SEQ}": f"peak_seq={SEQ}",
        f"loss peak transient, S = {2 * SEQ}": f"peak_seq={2 * SEQ}",
        f"saved for backward, S = {SEQ}": f"saved_seq={SEQ}",
    }
    for name, key in expected.items():
        assert rows[name] == [f"{got[w][key]:,}" for w in (1, 2, 4)], name
    logits = rows[f"float32 logits of the local tokens alone, S = {SEQ}"]
    assert logits == [f"{reference_logits_bytes(SEQ // w):,}" for w in (1, 2, 4)]
