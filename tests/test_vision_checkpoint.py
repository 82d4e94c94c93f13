"""Checkpoints of TSP vision-language models (Qwen2.5-VL, Qwen3-VL, LLaVA) at D = 2: the
exported Hugging Face checkpoint loads in one process with the original's logits, loss and
config; shard-on-read loading of Hugging Face's own checkpoint equals ``apply_tsp`` of the model
loaded whole (weights, loss, every gradient); a training checkpoint round trip."""

from __future__ import annotations

import copy
import functools
import json
import os

import pytest
import torch
import torch.distributed as dist
from checks import rel_err
from models import lm_loss
from safetensors import safe_open
from vlm_models import VLMS, build_vlm, vlm_batch

from tsp_ext import (
    apply_tsp,
    checkpoint,
    full_grads,
    full_state_dict,
    init_tsp_mesh,
    load_pretrained,
    save_pretrained,
    shard_batch,
)

pytestmark = pytest.mark.multiproc
# Hugging Face's Qwen3-VL RMSNorms round to float32 even for float64 inputs (test_vision.py)
TOL = {"qwen2_5_vl": 1e-10, "qwen3_vl": 1e-6, "llava": 1e-10}


def _ref(model, data) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and logits (real tokens) of the unmodified model."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in data.items() if k != "labels"}).logits
    return lm_loss(logits, data["labels"]), logits[data["attention_mask"].bool()]


def _tsp_step(model, mesh, data) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    out = model(**shard_batch(data, mesh, model=model))
    out.loss.backward()
    return out.loss.detach(), full_grads(model)


def export_case(mesh, name: str, tmp: str) -> dict:
    """``save_pretrained`` of a TSP VLM, read back by ``from_pretrained`` in one process."""
    model = build_vlm(name)
    original = copy.deepcopy(model)
    data = vlm_batch(name)
    loss, logits = _ref(original, data)
    path = os.path.join(tmp, f"export-{name}")
    save_pretrained(apply_tsp(model, mesh), path)
    plain = type(original).from_pretrained(path, dtype=torch.float64)
    plain_loss, plain_logits = _ref(plain, data)
    with open(os.path.join(path, "config.json")) as f:
        written = f.read()
    text = json.loads(written)["text_config"]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        stored = list(f.keys())
    state = original.state_dict()
    return {
        "loss": rel_err(plain_loss, loss),
        "logits": rel_err(plain_logits, logits),
        "weights_equal": all(torch.equal(t, state[n]) for n, t in plain.state_dict().items()),
        "tsp_in_config": "tsp" in written,
        "use_cache": text["use_cache"] == original.config.get_text_config().use_cache,
        "attn": plain.config.get_text_config()._attn_implementation,
        "stored": sorted(stored) == sorted(state),  # each tensor once, vision tower included
    }


def load_case(mesh, name: str, tmp: str) -> dict:
    """Shard-on-read of Hugging Face's own checkpoint (its stored names: ``model.layers.*``,
    ``visual.*``, ``language_model.model.*``) against ``apply_tsp`` of the model loaded whole."""
    original = build_vlm(name, seed=5)
    path = os.path.join(tmp, f"hf-{name}")
    if dist.get_rank() == 0:
        original.save_pretrained(path)
    dist.barrier()
    data = vlm_batch(name)
    loss, _ = _ref(original, data)
    loaded = load_pretrained(path, mesh, dtype=torch.float64)
    whole = apply_tsp(type(original).from_pretrained(path, dtype=torch.float64), mesh)
    mine, theirs = dict(loaded.named_parameters()), dict(whole.named_parameters())
    buffers = dict(whole.named_buffers())
    a_loss, a_grads = _tsp_step(loaded, mesh, data)
    b_loss, b_grads = _tsp_step(whole, mesh, data)
    local = sum(p.numel() for p in mine.values())
    return {
        "class": type(loaded) is type(original),
        "same_names": sorted(mine) == sorted(theirs),
        "params_equal": all(torch.equal(p, theirs[n]) for n, p in mine.items()),
        "buffers_equal": all(torch.equal(b, buffers[n]) for n, b in loaded.named_buffers()),
        "sharded": local < sum(p.numel() for p in original.parameters()),
        "loss_equal": torch.equal(a_loss, b_loss),
        "grads_equal": a_grads.keys() == b_grads.keys()
        and all(torch.equal(g, b_grads[n]) for n, g in a_grads.items()),
        "vision_grads": sum(1 for n in a_grads if "visual" in n or "vision" in n),
        "loss_vs_hf": rel_err(a_loss, loss),
    }


def training_case(mesh, tmp: str) -> dict:
    """``checkpoint.save`` after a step, ``load`` into another model: the same weights, optimizer
    state and next step."""
    name = "qwen2_5_vl"
    data = vlm_batch(name)
    model = apply_tsp(build_vlm(name), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _tsp_step(model, mesh, data)
    opt.step()
    path = os.path.join(tmp, "dcp")
    checkpoint.save(path, model, opt, extra_state={"step": 1})
    other = apply_tsp(build_vlm(name, seed=7), mesh)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    extra = checkpoint.load(path, other, other_opt)
    mine, theirs = full_state_dict(model), full_state_dict(other)
    params = dict(other.named_parameters())
    same_opt = all(
        torch.equal(v, other_opt.state[params[n]][k])
        for n, p in model.named_parameters()
        for k, v in opt.state[p].items()
    )
    steps = []
    for m, o in ((model, opt), (other, other_opt)):
        _tsp_step(m, mesh, data)
        o.step()
        steps.append(_tsp_step(m, mesh, data)[0])
    return {
        "extra": extra,
        "weights_equal": all(torch.equal(t, theirs[n]) for n, t in mine.items()),
        "opt_equal": same_opt,
        "next_loss_equal": torch.equal(steps[0], steps[1]),
    }


def worker(rank, world, tmp):
    mesh = init_tsp_mesh(world)
    return {
        "export": {name: export_case(mesh, name, tmp) for name in VLMS},
        "load": {name: load_case(mesh, name, tmp) for name in VLMS},
        "training": training_case(mesh, tmp),
    }


@functools.cache
def results(workers, tmp):
    return workers.run(worker, 2, tmp, timeout=300)


def test_export_loads_in_one_process_with_the_originals_logits_and_config(workers, tmp):
    for per_rank in results(workers, tmp):
        for name, res in per_rank["export"].items():
            assert res["loss"] < TOL[name] and res["logits"] < TOL[name], (name, res)
            assert res["weights_equal"] and res["stored"], (name, res)
            assert not res["tsp_in_config"] and res["use_cache"], (name, res)
            assert res["attn"] != "tsp", (name, res)


def test_shard_on_read_equals_apply_tsp_of_the_whole_model(workers, tmp):
    for per_rank in results(workers, tmp):
        for name, res in per_rank["load"].items():
            assert res.pop("loss_vs_hf") < TOL[name], (name, res)
            assert res.pop("vision_grads") > 0, (name, res)
            assert all(res.values()), (name, res)


def test_training_checkpoint_round_trip(workers, tmp):
    for res in results(workers, tmp):
        assert res["training"] == {
            "extra": {"step": 1},
            "weights_equal": True,
            "opt_equal": True,
            "next_loss_equal": True,
        }
