"""Mixture-of-experts models under TSP (Qwen3-MoE, Mixtral, Qwen2-MoE): logits, loss, the
auxiliary loss and every gradient against Hugging Face under both schedules (experts on the ring,
tokens by all-to-all); generate; export and shard-on-read loading; E/D experts and 1/D of the
saved bytes per rank; clear errors."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.distributed as dist
from checks import error_message, rel_err, trained_errors
from models import MOE_FAMILIES, batch, build, lm_loss
from test_generate import greedy_case
from transformers import AutoModelForCausalLM

from benchmarks.moe import hf_block
from tsp_ext import (
    TSPConfig,
    ZigzagLayout,
    apply_tsp,
    gather_sequence,
    init_tsp_mesh,
    load_pretrained,
    save_pretrained,
    shard_batch,
)
from tsp_ext.engine.feed_forward.moe_traffic import SCHEDULES
from tsp_ext.hf.families import QWEN_MOE
from tsp_ext.hf.moe import TSPSparseMoe
from tsp_ext.memory import SavedTensorBytes

pytestmark = pytest.mark.multiproc

S = 24
# Hugging Face runs Qwen3's q/k norms in float32 (test_apply_tsp's rule); it computes the aux
# loss in float32 too, summed in another order here (per rank, then over the group)
TOL = {"qwen3_moe": 1e-6, "mixtral": 1e-10, "qwen2_moe": 1e-10, "gpt_oss": 1e-10}
AUX_TOL = 1e-6


def parity_case(mesh, family, schedule, dtype=torch.float64):
    """Errors of a vocab-sharded TSP model against Hugging Face on one batch with the auxiliary
    loss on (``output_router_logits``): loss, aux loss, logits, every gradient, eval logits."""
    model = build(family, dtype)
    ref = copy.deepcopy(model)
    data = batch(model.config.vocab_size, 2, S)
    out = ref(input_ids=data["input_ids"], output_router_logits=True)
    ref_loss = lm_loss(out.logits, data["labels"]) + ref.router_aux_loss_coef * out.aux_loss
    ref_loss.backward()
    apply_tsp(model, mesh, config=TSPConfig(loss_chunk=5, moe_schedule=schedule))
    got = model(**shard_batch(data, mesh), return_logits=True, output_router_logits=True)
    got.loss.backward()
    errs = trained_errors(model, ref, mesh, data["input_ids"], got, out, ref_loss)
    aux = rel_err(got.aux_loss.detach(), out.aux_loss.detach())
    n_logits = len(got.router_logits)
    return errs, aux, n_logits, tuple(got.router_logits[0].shape)


def expert_bytes(model) -> int:
    return sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)


def memory_case(rank, world):
    """Saved bytes of one Qwen3-MoE block (8 experts, top-3) on 240 tokens: Hugging Face's
    block in one process, TSP's on this rank's S/D tokens; and the shapes TSP saved."""
    hf = hf_block(
        dict(hidden_size=48, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40)
    )
    x = torch.randn(1, 240, 48)
    out = {}
    if world == 1:
        with SavedTensorBytes(hf.parameters()) as rec:
            hf(x.clone().requires_grad_())
        out["hf"] = rec.nbytes
    tsp = TSPSparseMoe.from_hf(hf, dist.group.WORLD, TSPConfig(), QWEN_MOE)
    xl = ZigzagLayout(240, world).shard(x, rank).requires_grad_()
    with SavedTensorBytes(tsp.parameters()) as rec:
        tsp(xl)
    out["tsp"], out["shapes"] = rec.nbytes, rec.shapes
    out["experts"] = expert_bytes(tsp)
    out["hf_experts"] = expert_bytes(hf)
    return out


def checkpoint_case(rank, mesh, path):
    """Export a TSP Qwen3-MoE (a dense and a MoE layer) and load it back two ways: the logits
    of one plain Hugging Face process and of shard-on-read loading, against the original's."""
    model = build("qwen3_moe")
    ref = copy.deepcopy(model).eval()
    ids = batch(model.config.vocab_size, 1, S)["input_ids"]
    apply_tsp(model, mesh)
    save_pretrained(model, path)
    dist.barrier()
    out = {}
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, experts_implementation="eager"
        ).eval()
        with torch.no_grad():
            out["plain"] = rel_err(plain(input_ids=ids).logits, ref(input_ids=ids).logits)
    loaded = load_pretrained(path, mesh, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = loaded(**shard_batch({"input_ids": ids}, mesh)).logits
    out["loaded"] = rel_err(gather_sequence(logits, mesh, seq_len=S), ref(input_ids=ids).logits)
    return out


def error_cases(mesh):
    def wrong_experts():
        model = build("mixtral")
        experts = model.model.layers[1].mlp.experts
        experts.down_proj = torch.nn.Parameter(experts.down_proj[:3].clone())
        apply_tsp(model, mesh)

    def lora_on_shared_expert():
        from peft import LoraConfig, get_peft_model

        peft = get_peft_model(build("qwen2_moe"), LoraConfig(r=2, target_modules=["gate_proj"]))
        apply_tsp(peft, mesh)

    return {
        "top_k": error_message(lambda: apply_tsp(build("mixtral", num_experts_per_tok=5), mesh)),
        "jitter": error_message(lambda: apply_tsp(build("mixtral", router_jitter_noise=0.1), mesh)),
        "experts": error_message(wrong_experts),
        "lora": error_message(lora_on_shared_expert),
    }


def schedules(world: int) -> dict[str, str]:
    """Each family's schedule at D = world, alternating with the family and D so that at
    D = 2 and 4 each schedule runs Mixtral or Qwen2-MoE (float64-exact) and Qwen3-MoE."""
    return {f: SCHEDULES[(i + world // 2) % 2] for i, f in enumerate(MOE_FAMILIES)}


def parities(mesh, world: int, families=MOE_FAMILIES):
    return {f: parity_case(mesh, f, s) for f, s in schedules(world).items() if f in families}


def worker(rank, world, path):
    mesh = init_tsp_mesh(world)
    out = parities(mesh, world)
    out["memory"] = memory_case(rank, world)
    if world == 2:  # decode, export and errors do not depend on D beyond D > 1
        ring = {"mixtral": {"moe_schedule": "ring"}}  # else "auto": all-to-all at 13 tokens
        out["generate"] = {
            f: greedy_case(rank, mesh, f, torch.float64, 2, 13, 3, ring.get(f, {}))
            for f in MOE_FAMILIES
        }
        out["checkpoint"] = checkpoint_case(rank, mesh, os.path.join(path, "qwen3_moe"))
        out["float32"] = {  # the grouped GEMMs (torch._grouped_mm on CPU; float64 loops)
            (f, s): parity_case(mesh, f, s, torch.float32) for f, s in FLOAT32.items()
        }
        out["errors"] = error_cases(mesh)
    return out


@functools.cache
def results(workers, world, path):
    return workers.run(worker, world, path, timeout=300)


def check_parity(world, runs, families=MOE_FAMILIES):
    for rank, run in enumerate(runs):
        for family in families:
            schedule = schedules(world)[family]
            errs, aux, n_logits, shape = run[family]
            bad = {k: v for k, v in errs.items() if not v < TOL[family]}
            assert not bad, f"D={world} rank={rank} {family} {schedule}: {bad}"
            assert aux < AUX_TOL, (world, rank, family, schedule, aux)
            moe_layers = 1 if family == "qwen3_moe" else 2  # Qwen3-MoE's layer 0 is dense
            assert n_logits == moe_layers and shape == (2 * S // world, 4), (family, shape)


def test_both_schedules_run_exact_cases():
    for world in (2, 4):
        exact = {s for f, s in schedules(world).items() if TOL[f] == 1e-10}
        assert exact == set(SCHEDULES), world


@pytest.mark.parametrize("world", [1, 2, 4])
def test_loss_aux_loss_logits_and_grads_match_hf(workers, world, tmp):
    check_parity(world, results(workers, world, tmp))


# at D = 3: the ring and the all-to-all, float64-exact (gpt-oss: sinks on uneven head groups)
UNEVEN = ("mixtral", "qwen2_moe", "gpt_oss")


def uneven_worker(rank, world):
    return parities(init_tsp_mesh(world), world, UNEVEN)


def test_uneven_experts_per_rank(workers):
    """4 experts on 3 ranks (2, 1, 1), 4 query heads (2, 1, 1)."""
    assert {schedules(3)[f] for f in UNEVEN} == set(SCHEDULES)  # both schedules among them
    check_parity(3, workers.run(uneven_worker, 3), UNEVEN)


FLOAT32 = {"mixtral": "ring", "qwen2_moe": "all_to_all"}


def test_float32_grouped_gemms_match_hf(workers, tmp):
    """float32 runs the experts as grouped GEMMs (``torch._grouped_mm``) where float64 loops:
    both schedules against Hugging Face's per-expert loop, to float32 rounding."""
    for rank, run in enumerate(results(workers, 2, tmp)):
        for case, (errs, aux, _, _) in run["float32"].items():
            bad = {k: v for k, v in errs.items() if not v < 1e-5}
            assert not bad and aux < AUX_TOL, (rank, case, bad, aux)


def test_generate_matches_hf_token_for_token(workers, tmp):
    runs = results(workers, 2, tmp)
    for family in MOE_FAMILIES:
        ref = runs[0]["generate"][family]["ref"]
        for rank, run in enumerate(runs):
            assert torch.equal(run["generate"][family]["tokens"], ref), (rank, family)


def test_experts_and_saved_bytes_are_one_dth(workers, tmp):
    one = results(workers, 1, tmp)[0]["memory"]
    assert one["experts"] == one["hf_experts"]
    assert one["tsp"] <= one["hf"], one  # no more than Hugging Face's block saves
    for world in (2, 4):
        for rank, run in enumerate(results(workers, world, tmp)):
            mem = run["memory"]
            assert mem["experts"] == one["experts"] // world, (world, rank)  # 8 experts
            assert 0.9 <= mem["tsp"] * world / one["tsp"] <= 1.1, (world, rank, mem["tsp"])
            for shape in mem["shapes"]:  # no full-sequence tensor
                assert 240 not in shape, shape


def test_export_and_shard_on_read_loading(workers, tmp):
    for run in results(workers, 2, tmp):
        ckpt = run["checkpoint"]
        assert all(v < 1e-6 for v in ckpt.values()), ckpt  # Qwen3's float32 q/k norms


def test_errors(workers, tmp):
    errors = results(workers, 2, tmp)[0]["errors"]
    assert (
        "num_experts_per_tok=5 must be between 1 and the number of experts (4)" in (errors["top_k"])
    )
    assert "router_jitter_noise=0.1 is not supported" in errors["jitter"]
    assert "experts.down_proj is (3, 32, 20), the config says (4, 32, 20)" in errors["experts"]
    assert "LoRA on" in errors["lora"] and "shared_expert.gate_proj" in errors["lora"]
