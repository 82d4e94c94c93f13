"""TSP x DeepSpeed ZeRO-1/2/3 on a (dp, tsp) mesh vs a single-process reference."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from checks import error_message
from dp_reference import CLIP, STEPS, adamw, param_errors, reference, replica_batches
from models import LORA_TARGETS, build, build_lora, causal_lm_loss

from tsp_ext import TSPConfig, apply_tsp, init_tsp_mesh

pytestmark = pytest.mark.multiproc


def zero_run(
    tsp: int,
    stage: int,
    dtype: torch.dtype,
    model_kw=None,
    offload: bool = False,
    lora: bool = False,
    family: str = "llama",
    **tsp_options,
):
    """``offload``: the optimizer state on the CPU (``adamw`` becomes DeepSpeed's CPU Adam);
    ``tsp_options``: more fields of the config's ``"tsp"`` block."""
    import tsp_ext.deepspeed as tds
    from tsp_ext import shard_batch

    model = build(family, dtype, **(model_kw or {}))
    if lora:  # a PEFT LoRA model on all seven projections (base frozen)
        model = build_lora("llama", dtype, LORA_TARGETS)
    ref_model = copy.deepcopy(model)
    ref_losses, ref_norms, ref_params = reference(
        ref_model if dtype == torch.float64 else ref_model.float(), 4 // tsp
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "tsp": {"size": tsp, **tsp_options},
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = tds.initialize(model=model, config=config, optimizer=adamw)
    stepped_by = type(engine.optimizer.optimizer).__name__
    mesh = engine.tsp_mesh
    replica = mesh["dp"].get_local_rank()
    losses, norms = [], []
    for step in range(STEPS):
        data = replica_batches(mesh["dp"].size(), step, model.config.vocab_size)[replica]
        out = engine(**shard_batch(data, mesh))
        engine.backward(out.loss)
        engine.step()
        losses.append(abs(out.loss.item() - ref_losses[step][replica]) / ref_losses[step][replica])
        norm = float(engine.get_global_grad_norm())
        norms.append(abs(norm - ref_norms[step]) / ref_norms[step])
    full = tds.full_state_dict(engine)
    max_rel, norm_rel = param_errors(full, ref_params)
    engine.destroy()
    return {
        "loss": max(losses),
        "norm": max(norms),
        "norm0": norms[0],
        "params": max_rel,
        "params_l2": norm_rel,
        "batch": engine.train_batch_size(),
        "stepped_by": stepped_by,
    }


def zero_worker(rank, world, tsp, runs):
    return {(stage, str(dt)): zero_run(tsp, stage, dt) for stage, dt in runs}


# DeepSpeed's ZeRO-3 partitions fp32/bf16/fp16 parameters only: stage 3 runs in float32
RUNS = ((1, torch.float64), (2, torch.float64), (3, torch.float32), (2, torch.bfloat16))


@functools.cache
def results(workers, tsp: int):
    return workers.run(zero_worker, 4, tsp, RUNS, timeout=600)


@pytest.mark.parametrize("tsp", [2, 4, 1])
def test_zero_stages_match_reference(workers, tsp):
    for rank, per_run in enumerate(results(workers, tsp)):
        for (stage, dtype), res in per_run.items():
            # TSP itself is float64-exact, but DeepSpeed reduces gradient norms (and so the clip
            # coefficient) in float32; Adam turns that into ~1e-5 on entries whose |grad| ~ eps
            tols = {"loss": 1e-7, "norm": 1e-6, "params": 1e-4, "params_l2": 1e-6}
            if "float32" in dtype:
                # float32 vs a float32 reference: the first gradient norm agrees to rounding;
                # Adam amplifies float32 rounding on the later steps' norms and parameters
                tols = {"loss": 1e-5, "norm0": 1e-6, "norm": 1e-4, "params_l2": 1e-4}
            if "bfloat16" in dtype:
                # bf16 weights vs the float32 reference: the first gradient norm is close; later
                # steps drift apart as Adam amplifies bf16 rounding, so compare losses and the
                # relative L2 distance of all parameters
                tols = {"loss": 1e-2, "norm0": 1e-3, "params_l2": 3e-2}
            for key, tol in tols.items():
                assert res[key] < tol, (tsp, rank, stage, dtype, key, res)
            assert res["batch"] == 2 * (4 // tsp)  # micro batch x GAS x dp, not x world


def offload_worker(rank, world):
    """ZeRO-2 with the optimizer state offloaded to CPU (a client AdamW, no compiled op)."""
    import tsp_ext.deepspeed as tds
    from tsp_ext import shard_batch

    model = build("llama", torch.float64)
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": CLIP,
        "tsp": {"size": 2},
    }
    engine, *_ = tds.initialize(model=model, config=config, optimizer=adamw)
    mesh = engine.tsp_mesh
    data = replica_batches(2, 0, model.config.vocab_size)
    out = engine(**shard_batch(data[mesh["dp"].get_local_rank()], mesh))
    engine.backward(out.loss)
    engine.step()
    opt = adamw(ref.parameters())
    (sum(causal_lm_loss(ref, b) for b in data) / 2).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    opt.step()
    full = tds.full_state_dict(engine)
    engine.destroy()
    return param_errors(full, dict(ref.named_parameters()))[1]


def cpu_adam_worker(rank, world):
    layers = {"checkpoint_layers": True, "offload_checkpoints": True}
    return zero_run(2, 3, torch.float32, offload=True, **layers)


def test_cpu_adam_offload_matches_reference(workers):
    """The long-context configuration: ZeRO-3 with the optimizer state offloaded to the CPU (the
    torch AdamW factory's optimizer becomes DeepSpeed's compiled CPU Adam with the same groups)
    and every decoder layer checkpointed, its input offloaded to host memory; dp=2 x tsp=2,
    float32: the float32 reference's curve (torch AdamW) within the float32 tolerances of the
    plain ZeRO runs."""
    for rank, res in enumerate(workers.run(cpu_adam_worker, 4, timeout=600)):
        assert res["stepped_by"] == "DeepSpeedCPUAdam", res
        tols = {"loss": 1e-5, "norm0": 1e-6, "norm": 1e-4, "params_l2": 1e-4}
        for key, tol in tols.items():
            assert res[key] < tol, (rank, key, res)


def test_cpu_optimizer_offload(workers):
    # relative L2 distance of all parameters after one step (see zero_run's tolerances)
    assert max(workers.run(offload_worker, 4, timeout=600)) < 1e-6


def config_errors_worker(rank, world):
    import tsp_ext.deepspeed as tds

    def init(cfg, **kw):
        base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
        return tds.initialize(model=build("llama"), config={**base, **cfg}, **kw)

    stale = build("llama")
    applied = apply_tsp(build("llama"), init_tsp_mesh(2))
    disagree = {"train_micro_batch_size_per_gpu": 1, "tsp": {"size": 2, "recompute_mlp": False}}
    return {
        "zero3_float64": error_message(
            lambda: init({"tsp": {"size": 2}, "zero_optimization": {"stage": 3}}, optimizer=adamw)
        ),
        "disagree": error_message(
            lambda: tds.initialize(model=applied, config=disagree, optimizer=adamw)
        ),
        "size3": error_message(lambda: init({"tsp": {"size": 3}}, optimizer=adamw)),
        "unknown": error_message(lambda: init({"tsp": {"size": 2, "sise": 1}}, optimizer=adamw)),
        "no_block": error_message(lambda: init({}, optimizer=adamw)),
        "seq_parallel": error_message(
            lambda: init({"tsp": {"size": 2}, "sequence_parallel_size": 2}, optimizer=adamw)
        ),
        "mpu": error_message(lambda: init({"tsp": {"size": 2}}, optimizer=adamw, mpu=object())),
        "mixed_kv_clipping": error_message(  # 9 / 3 heads at tsp=2: rank 1's K/V = kv 1 (copy), 2
            lambda: tds.initialize(
                model=build("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72),
                config={
                    "train_micro_batch_size_per_gpu": 1,
                    "gradient_clipping": 1.0,
                    "tsp": {"size": 2},
                },
                optimizer=adamw,
            )
        ),  # fmt: skip
        "stale": error_message(
            lambda: tds.initialize(
                model=stale,
                config={"train_micro_batch_size_per_gpu": 1, "tsp": {"size": 2}},
                optimizer=adamw(stale.parameters()),
            )
        ),
    }


@pytest.mark.parametrize(
    "case, expected",
    [
        ("size3", "tsp_size=3 does not divide the world size 4"),
        ("unknown", "unknown keys in the \"tsp\" block: ['sise']"),
        ("no_block", 'needs a "tsp" block with a "size"'),
        ("seq_parallel", "'sequence_parallel_size' would build groups across the TSP axis"),
        ("mpu", "do not pass mpu"),
        ("stale", "pass an optimizer factory"),
        ("disagree", "recompute_mlp=False (model: True)"),
        ("zero3_float64", "ZeRO-3 partitions float32, bfloat16 and float16 parameters only"),
        ("mixed_kv_clipping", "would count twice; use a tsp size in [1, 3, 8, 9]"),
    ],
)
def test_config_errors(workers, case, expected):
    assert expected in config_messages(workers)[case]


def test_tsp_block_takes_every_config_field():
    from tsp_ext.deepspeed import tsp_config_from_ds

    block = {
        "size": 4,
        "accum_dtype": "float64",
        "overlap": False,
        "attn_backend": "blockwise",
        "attn_block": 64,
        "head_bucket": 2,
        "window_exchange": False,
        "recompute_mlp": False,
        "shard_vocab": False,
        "loss_chunk": 7,
        "mlp_tile": 5,
        "checkpoint_layers": True,
        "checkpoint_every": 2,
        "offload_checkpoints": True,
        "checkpoint_device_bytes": 1024,
        "quantize_base": "nf4",
        "moe_schedule": "ring",
        "self_check": False,
    }
    expected = TSPConfig(
        tsp_size=4,
        accum_dtype=torch.float64,
        overlap=False,
        attn_backend="blockwise",
        attn_block=64,
        head_bucket=2,
        window_exchange=False,
        recompute_mlp=False,
        shard_vocab=False,
        loss_chunk=7,
        mlp_tile=5,
        checkpoint_layers=True,
        checkpoint_every=2,
        offload_checkpoints=True,
        checkpoint_device_bytes=1024,
        quantize_base="nf4",
        moe_schedule="ring",
        self_check=False,
    )
    assert tsp_config_from_ds({"tsp": block}) == expected
    assert {f.name for f in dataclasses.fields(TSPConfig)} == set(block) - {"size"} | {"tsp_size"}


@functools.cache
def config_messages(workers):
    return workers.run(config_errors_worker, 4)[0]


# any TSP size: 6 query / 3 KV heads at D = 4 (groups of 2, 2, 1, 1 query heads; KV head 2 on
# ranks 2 and 3, rank 3's K/V a copy), F = 53 and V = 97 split unevenly; dp = 1
UNEVEN = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
UNEVEN.update(intermediate_size=53, vocab_size=97)


def uneven_worker(rank, world):
    return zero_run(4, 2, torch.float64, UNEVEN)


def test_zero2_uneven_layout_matches_reference(workers):
    for rank, res in enumerate(workers.run(uneven_worker, 4, timeout=400)):
        tols = {"loss": 1e-7, "norm": 1e-6, "params": 1e-4, "params_l2": 1e-6}
        for key, tol in tols.items():
            assert res[key] < tol, (rank, key, res)


def plain_initialize_worker(rank, world, tmp):
    """What HF Trainer --deepspeed / Accelerate's plugin do: plain deepspeed.initialize."""
    import json

    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "tsp": {"size": 1}}
    path = f"{tmp}/ds.json"
    with open(path, "w") as f:
        json.dump(config, f)
    plain = {"train_micro_batch_size_per_gpu": 1}
    tsp_model = apply_tsp(build("llama", torch.float32), init_tsp_mesh(1))

    def init(model, **kw):
        return deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), **kw)

    engine, *_ = init(build("llama", torch.float32), config=plain)  # no TSP at all: untouched
    engine.destroy()
    return {
        "dict": error_message(lambda: init(build("llama", torch.float32), config=config)),
        "path": error_message(lambda: init(build("llama", torch.float32), config_params=path)),
        "tsp_model": error_message(lambda: init(tsp_model, config=plain)),
        "positional": error_message(
            lambda: deepspeed.initialize(
                None, tsp_model, adamw(tsp_model.parameters()), config=plain
            )
        ),
    }


def test_plain_deepspeed_initialize_refuses_tsp(workers, tmp_path):
    got = workers.run(plain_initialize_worker, 1, str(tmp_path), timeout=300)[0]
    ignored = "got a DeepSpeed config with a \"tsp\" block ({'size': 1}), which plain DeepSpeed"
    assert ignored in got["dict"] and ignored in got["path"]
    assert "call tsp_ext.deepspeed.initialize instead" in got["dict"]
    for case in ("tsp_model", "positional"):
        assert "got a TSP model without tsp_ext's data-parallel groups" in got[case]


def test_guard_installed_when_deepspeed_is_imported_after_tsp_ext():
    import subprocess
    import sys

    code = "import tsp_ext, deepspeed; print(deepspeed.initialize.__tsp_checked__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("True")


def moe_worker(rank, world):
    runs = (((2, torch.float64), "ring"), ((3, torch.float32), "all_to_all"))
    return {
        (stage, str(dt), schedule): zero_run(2, stage, dt, family="mixtral", moe_schedule=schedule)
        for (stage, dt), schedule in runs
    }


def test_moe_zero2_and_zero3_match_reference(workers):
    """Mixtral (4 experts, E/D = 2 a rank) on tsp 2 x dp 2: ZeRO-2 with the experts on the ring,
    ZeRO-3 (which gathers each expert shard per use) with the tokens sent by all-to-all."""
    for rank, per_run in enumerate(workers.run(moe_worker, 4, timeout=600)):
        for (stage, dtype, schedule), res in per_run.items():
            tols = {"loss": 1e-7, "norm": 1e-6, "params": 1e-4, "params_l2": 1e-6}
            if "float32" in dtype:  # as test_zero_stages_match_reference
                tols = {"loss": 1e-5, "norm0": 1e-6, "norm": 1e-4, "params_l2": 1e-4}
            for key, tol in tols.items():
                assert res[key] < tol, (rank, stage, dtype, schedule, key, res)
