"""An export of a TSP model has the ``config.json`` that ``PreTrainedModel.save_pretrained`` of
the unmodified model writes (``architectures``, ``dtype``, ``transformers_version`` included), and
plain TRL, which picks the model class from ``architectures``, trains on it."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from models import build
from test_grpo import G, V, fixed_rollouts, grpo_args, prompts_dataset, score
from test_preference import word_tokenizer
from vlm_models import build_vlm

from tsp_ext import apply_tsp, init_tsp_mesh, save_pretrained

pytestmark = pytest.mark.multiproc


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def export_worker(rank, world, tmp):
    mesh = init_tsp_mesh(world)
    models = {
        "llama": build("llama", torch.float32, vocab_size=V),
        "qwen3_moe": build("qwen3_moe", torch.float32),
        "qwen2_5_vl": build_vlm("qwen2_5_vl", torch.float32),
    }
    out = {}
    for name, model in models.items():
        plain, folded = f"{tmp}/{name}-plain", f"{tmp}/{name}-tsp"
        if rank == 0:
            copy.deepcopy(model).save_pretrained(plain)
        save_pretrained(apply_tsp(model, mesh), folded)
        dist.barrier()
        out[name] = (_config(plain), _config(folded)) if rank == 0 else None
    return out


def trl_worker(rank, world, path):
    """Plain TRL with a reference model (beta > 0) on a TSP export, in one process."""
    from trl import GRPOTrainer

    args = grpo_args(f"{path}-trl", beta=0.04, max_steps=1, per_device_train_batch_size=G)
    trainer = GRPOTrainer(
        path,  # TRL builds the policy and its reference from config.json's architectures
        reward_funcs=[score],
        args=args,
        train_dataset=prompts_dataset(G),
        processing_class=word_tokenizer(V),
        rollout_func=fixed_rollouts,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return len(logs), logs[0]["kl"]


def test_exports_write_what_save_pretrained_writes_and_trl_loads_them(workers, tmp):
    out = workers.run(export_worker, 2, tmp, timeout=300)[0]
    for name in ("llama", "qwen3_moe", "qwen2_5_vl"):
        plain, folded = out[name]
        assert folded["architectures"] == plain["architectures"], name
        assert folded == plain, {
            k: (plain.get(k), folded.get(k))
            for k in plain.keys() | folded.keys()
            if plain.get(k) != folded.get(k)
        }
    steps, kl = workers.run(trl_worker, 1, f"{tmp}/llama-tsp", timeout=120)[0]
    assert steps == 1 and kl == 0.0  # the reference is the policy at the first step
