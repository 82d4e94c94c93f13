"""Training under apply_tsp: optimizer steps, bf16, gradient checkpointing (Hugging Face's and
``TSPConfig(checkpoint_layers, offload_checkpoints)``), parameter bytes."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from checks import error_message, rel_err
from models import batch, build, causal_lm_loss

from tsp_ext import TSPConfig, apply_tsp, full_grads, full_state_dict, init_tsp_mesh, shard_batch
from tsp_ext.memory import SavedTensorBytes

pytestmark = pytest.mark.multiproc


def adamw_steps(mesh, steps=3):
    """3 AdamW steps on the TSP model and on the unmodified one: parameters and losses."""
    model = build("llama", torch.float64)
    ref = copy.deepcopy(model)
    apply_tsp(model, mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref)]
    losses = []
    for step in range(steps):
        data = batch(model.config.vocab_size, 2, 21, seed=step)
        loss, ref_loss = model(**shard_batch(data, mesh)).loss, causal_lm_loss(ref, data)
        for value, opt in zip((loss, ref_loss), opts):
            opt.zero_grad()
            value.backward()
            opt.step()
        losses.append((loss.item(), ref_loss.item()))
    full = full_state_dict(model)
    errs = {n: rel_err(full[n], p) for n, p in ref.state_dict().items()}
    return {"params": max(errs.values()), "losses": losses}


def bf16_loss(mesh):
    """bf16 TSP model (float32 accumulation) vs the float32 unmodified model."""
    model = build("llama", torch.float32, num_hidden_layers=2)
    ref = copy.deepcopy(model)
    apply_tsp(model.to(torch.bfloat16), mesh)
    data = batch(model.config.vocab_size, 2, 64)
    with torch.no_grad():
        return model(**shard_batch(data, mesh)).loss.item(), ref(**data).loss.item()


def checkpointing_grads(mesh):
    """Gradient checkpointing enabled on the TSP model: gradients still exact."""
    model = build("qwen2", torch.float64)
    ref = copy.deepcopy(model)
    apply_tsp(model, mesh)
    model.gradient_checkpointing_enable()
    model.train()
    data = batch(model.config.vocab_size, 2, 24)
    model(**shard_batch(data, mesh)).loss.backward()
    causal_lm_loss(ref, data).backward()
    grads = full_grads(model)
    return max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters())


def layer_checkpointing(mesh, offload: bool, device_layers: int = 0, every: int = 1):
    """``TSPConfig(checkpoint_layers=True)`` (``every``: intervals of that many layers), and with
    ``offload`` the longest-context options (layer inputs offloaded, MLP tiles of 7 tokens, one
    head group at a time; the first ``device_layers`` inputs kept on the device): gradients
    against the unmodified model, and what the decoder layers keep for backward (device / host
    bytes)."""
    model = build("qwen2", torch.float64, num_hidden_layers=3)
    ref = copy.deepcopy(model)
    data = batch(model.config.vocab_size, 2, 24)
    inputs = dict(shard_batch(data, mesh))
    layer_input = inputs["input_ids"].numel() * model.config.hidden_size * 8  # [B, S/D, h]
    config = TSPConfig(checkpoint_layers=True, checkpoint_every=every)
    if offload:
        config = TSPConfig(
            checkpoint_layers=True,
            checkpoint_every=every,
            offload_checkpoints=True,
            checkpoint_device_bytes=device_layers * layer_input,
            mlp_tile=7,
            overlap=False,
        )
    apply_tsp(model, mesh, config=config).train()
    with SavedTensorBytes(ignore=model.parameters()) as saved:
        loss = model(**inputs).loss
    store = model.tsp.host_store
    held, device_held = (store.held, store.device_held) if offload else (0, 0)
    loss.backward()
    ref_loss = causal_lm_loss(ref, data)
    ref_loss.backward()
    grads = full_grads(model)
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grads": max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters()),
        "saved": saved.nbytes,
        "held": held,
        "device_held": device_held,
        "held_after": store.held + store.device_held if offload else 0,
        "layer_input": layer_input,
    }


def hidden_states_with_intervals(mesh) -> str:
    """The error of ``output_hidden_states`` in training with intervals of layers."""
    model = build("qwen2", torch.float64, num_hidden_layers=3)
    apply_tsp(model, mesh, config=TSPConfig(checkpoint_layers=True, checkpoint_every=2)).train()
    inputs = shard_batch(batch(model.config.vocab_size, 2, 24), mesh)
    return error_message(lambda: model(**inputs, output_hidden_states=True))


def saved_without_layers(mesh) -> int:
    """Bytes the TSP model saves for backward with no decoder layer (embedding, head, loss)."""
    model = apply_tsp(build("qwen2", torch.float64, num_hidden_layers=0), mesh).train()
    with SavedTensorBytes(ignore=model.parameters()) as saved:
        model(**shard_batch(batch(model.config.vocab_size, 2, 24), mesh))
    return saved.nbytes


def param_bytes(mesh):
    """Per-rank parameter bytes by kind, before and after apply_tsp."""

    def kind(name: str) -> str:
        if ".k_proj." in name or ".v_proj." in name:
            return "kv"
        if "_proj." in name or "embed_tokens." in name or "lm_head." in name:
            return "sharded"  # q/o, gate/up/down, embedding and LM head (vocabulary rows)
        return "replicated"  # norms

    def split(m):
        out = dict.fromkeys(("kv", "sharded", "replicated"), 0)
        for n, p in m.named_parameters():
            out[kind(n)] += p.numel() * p.element_size()
        return out

    model = build("llama", torch.float32)  # 8 query heads, 2 KV heads
    before = split(model)
    return before, split(apply_tsp(model, mesh))


def training_worker(rank, world):
    mesh = init_tsp_mesh(world)
    return {
        "adamw": adamw_steps(mesh),
        "bf16": bf16_loss(mesh),
        "checkpointing": checkpointing_grads(mesh),
        "layers": layer_checkpointing(mesh, offload=False),
        "offload": layer_checkpointing(mesh, offload=True),
        "tiers": layer_checkpointing(mesh, offload=True, device_layers=2),
        "every2": layer_checkpointing(mesh, offload=False, every=2),
        "every2_offload": layer_checkpointing(mesh, offload=True, every=2),
        "hidden_error": hidden_states_with_intervals(mesh),
        "no_layers": saved_without_layers(mesh),
        "bytes": param_bytes(mesh),
    }


@functools.cache
def results(workers, world):
    return workers.run(training_worker, world)


@pytest.mark.parametrize("world", [2, 4])
def test_three_adamw_steps_match(workers, world):
    for res in results(workers, world):
        assert res["adamw"]["params"] < 1e-9, res["adamw"]
        for tsp_loss, ref_loss in res["adamw"]["losses"]:
            assert abs(tsp_loss - ref_loss) < 1e-10 * abs(ref_loss)
    # out.loss is the same value on every TSP rank
    assert len({tuple(r["adamw"]["losses"]) for r in results(workers, world)}) == 1


def test_bf16_loss_close_to_float32_at_d4(workers):
    for tsp_loss, ref_loss in (r["bf16"] for r in results(workers, 4)):
        assert abs(tsp_loss - ref_loss) < 1e-2 * abs(ref_loss), (tsp_loss, ref_loss)


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_checkpointing_keeps_exact_grads(workers, world):
    for res in results(workers, world):
        assert res["checkpointing"] < 1e-10


@pytest.mark.parametrize("world", [1, 2, 4])
def test_checkpoint_layers_exact_and_keeps_one_input_per_layer(workers, world):
    for res in results(workers, world):
        plain, offload, tiers = res["layers"], res["offload"], res["tiers"]
        every2, every2_offload = res["every2"], res["every2_offload"]
        for r in (plain, offload, tiers, every2, every2_offload):
            assert r["loss"] < 1e-12 and r["grads"] < 1e-10, r
        # per decoder layer only its input [B, S/D, h] is kept, on the device or in host memory
        assert plain["saved"] == res["no_layers"] + 3 * plain["layer_input"], plain
        assert offload["saved"] == res["no_layers"], offload
        assert offload["held"] == 3 * offload["layer_input"] and offload["held_after"] == 0
        # device-then-host tiers: the first two layers' inputs on the device, the third on host
        n = tiers["layer_input"]
        assert (tiers["device_held"], tiers["held"], tiers["held_after"]) == (2 * n, n, 0), tiers
        assert tiers["saved"] == res["no_layers"], tiers
        # intervals of two layers: the inputs of layers 0 and 2 (layer 1 recomputed from 0's)
        assert every2["saved"] == res["no_layers"] + 2 * n, every2
        assert every2_offload["held"] == 2 * n and every2_offload["held_after"] == 0
        assert "output_hidden_states with checkpoint_every=2" in res["hidden_error"]


@pytest.mark.parametrize("world", [2, 4])
def test_layer_weights_are_one_over_d_per_rank(workers, world):
    for res in results(workers, world):
        before, after = res["bytes"]
        assert after["sharded"] * world == before["sharded"]
        assert after["kv"] * min(world, 2) == before["kv"]  # KV heads replicated when D > n_kv
        assert after["replicated"] == before["replicated"]  # norms only
