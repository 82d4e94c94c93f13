"""Vision-language models under TSP (Qwen2.5-VL, Qwen3-VL, LLaVA): logits, loss and every
gradient (the vision tower's and the merger's included) against the unmodified model on a batch
with images and a video; greedy ``generate`` with an image prompt; what each rank saves; the
errors."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from checks import error_message, rel_err
from models import lm_loss
from vlm_models import VIDEO, VLMS, build_vlm, first_row, left_padded, vlm_batch, vlm_prompt

from tsp_ext import TSPConfig, apply_tsp, full_grads, gather_sequence, init_tsp_mesh, shard_batch
from tsp_ext.engine.sharding.layout import ZigzagLayout
from tsp_ext.hf.vision import encode
from tsp_ext.hf.vision_plan import deal, exchange
from tsp_ext.memory import SavedTensorBytes

pytestmark = pytest.mark.multiproc

# (model, options, vision tower frozen, config overrides): the default engine; layers
# checkpointed (Qwen3-VL's deepstack features added between recomputed layers); a replicated LM
# head with the tower frozen; LLaVA's features of two layers with CLIP's class token kept
FULL = dict(vision_feature_layer=[-2, -1], vision_feature_select_strategy="full")
CASES = [
    ("qwen2_5_vl", TSPConfig(loss_chunk=5), False, {}),
    ("qwen3_vl", TSPConfig(checkpoint_layers=True), False, {}),
    ("llava", TSPConfig(shard_vocab=False), True, {}),
    ("llava_full", TSPConfig(), False, FULL),
]
# Hugging Face's Qwen3-VL RMSNorms (its q/k norms included) round to float32 even for float64
# inputs, as Qwen3's do (test_apply_tsp): the two sides agree to float32 rounding there
TOL = {"qwen2_5_vl": 1e-10, "qwen3_vl": 1e-6, "llava": 1e-10, "llava_full": 1e-10}


def frozen_tower(model) -> None:
    for name, p in model.named_parameters():
        if "vision_tower" in name:
            p.requires_grad_(False)


def reference(model, data):
    model.zero_grad()
    out = model(**{k: v for k, v in data.items() if k != "labels"})
    loss = lm_loss(out.logits, data["labels"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), out.logits.detach(), grads


def grad_error(name: str, got: torch.Tensor, ref: dict) -> float:
    """Relative error of a gradient; a key projection's bias gets none (softmax is invariant to
    one shift of every key), so both sides are rounding noise, measured against the query
    bias's gradient of the same layer."""
    if name.endswith("k_proj.bias"):
        scale = ref[name.replace("k_proj", "q_proj")].abs().max()
        return ((got - ref[name]).abs().max() / scale).item()
    return rel_err(got, ref[name])


def parity_case(mesh, case: str, config: TSPConfig, freeze: bool, overrides: dict) -> dict:
    name = case.removesuffix("_full")
    model = build_vlm(name, **overrides)
    if freeze:
        frozen_tower(model)
    ref = copy.deepcopy(model)
    data = vlm_batch(name, per_image=5 if overrides else 4)  # the class token: one more
    ref_loss, ref_logits, ref_grads = reference(ref, data)
    apply_tsp(model, mesh, config=config)
    # which rank encodes which images and where features go follow from the batch alone
    torch.manual_seed(1000 + torch.distributed.get_rank())
    out = model(**shard_batch(data, mesh, model=model), return_logits=True)
    out.loss.backward()
    logits = gather_sequence(out.logits.detach(), mesh, seq_len=data["input_ids"].shape[1])
    real = data["attention_mask"].bool()
    errs = {"loss": rel_err(out.loss.detach(), ref_loss)}
    errs["logits"] = rel_err(logits[real], ref_logits[real])
    grads = full_grads(model)
    errs["missing"] = sorted(set(ref_grads) - set(grads))
    # parameters Hugging Face leaves without a gradient (CLIP's last layer, unused by LLaVA)
    errs["extra"] = sorted(n for n in set(grads) - set(ref_grads) if grads[n].any())
    errs["vision_grads"] = sum(1 for n in ref_grads if "visual" in n or "vision" in n)
    for n in set(ref_grads) & set(grads):
        errs[n] = grad_error(n, grads[n], ref_grads)
    return errs


def generate_case(mesh, name: str) -> list[tuple[list, list]]:
    """Greedy tokens of HF and of TSP for one prompt, and for two left-padded prompts."""
    model = build_vlm(name, seed=3)
    prompts = (vlm_prompt(name), left_padded(vlm_batch(name)))
    refs = [model.generate(**p, max_new_tokens=6, do_sample=False) for p in prompts]
    apply_tsp(model, mesh)
    got = [model.generate(**p, max_new_tokens=6, do_sample=False) for p in prompts]
    return [(r.tolist(), g.tolist()) for r, g in zip(refs, got)]


def vision_worker(rank, world):
    mesh = init_tsp_mesh(world)
    parity = {c[0]: parity_case(mesh, *c) for c in CASES}
    generated = {name: generate_case(mesh, name) for name in VLMS}
    return parity, generated


@functools.cache
def results(workers, world):
    return workers.run(vision_worker, world, timeout=300)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_logits_loss_and_every_gradient_match_hf(workers, world):
    for rank, (parity, _) in enumerate(results(workers, world)):
        for name, errs in parity.items():
            assert errs.pop("missing") == [] and errs.pop("extra") == [], (name, errs)
            assert errs.pop("vision_grads") > 0 or name == "llava"
            bad = {k: v for k, v in errs.items() if not v < TOL[name]}
            assert not bad, f"D={world} rank={rank} {name}: {bad}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_greedy_generate_with_image_prompts_is_token_for_token(workers, world):
    for _, generated in results(workers, world):
        for name, cases in generated.items():
            for ref, got in cases:
                assert got == ref, (name, world)
            assert len(set(cases[0][0][0][-6:])) > 1, f"{name}: a degenerate reference"


def test_units_are_dealt_in_order_by_patches():
    assert deal([16, 32, 16, 16], 2) == [0, 0, 1, 1]
    assert deal([16, 32, 16, 16], 4) == [0, 1, 2, 3]
    assert deal([1, 1], 4) == [1, 3]  # fewer units than ranks: some ranks encode nothing
    assert deal([100, 1, 1, 1], 2) == [0, 1, 1, 1]


def test_exchange_sends_each_feature_to_its_tokens_rank():
    """Every feature reaches the rank holding its placeholder, at the row its index names."""
    B, S, D = 2, 16, 2
    lay = ZigzagLayout(S, D)
    slots = torch.tensor([1, 2, 9, 14, 16 + 3, 16 + 12])  # flat b * S + s
    encoder = torch.tensor([0, 0, 0, 1, 1, 1])
    plans = [exchange(slots, encoder, lay, B, p) for p in range(D)]
    sent = {p: torch.arange(6)[encoder == p][plans[p].order] for p in range(D)}
    for p in range(D):
        recv = plans[p].counts[1].tolist()
        got = torch.cat([sent[q].split(plans[q].counts[0].tolist())[p] for q in range(D)])
        assert len(got) == sum(recv)
        index = plans[p].index
        positions = lay.shard(torch.arange(B * S).view(B, S), p)
        for f, slot in enumerate(slots.tolist()):
            held = positions == slot
            if held.any():
                assert got[index[held]].item() == f
        assert (index >= 0).sum() == len(got)


SEQ = 120  # the memory batch's length: no other size of the tiny models


def memory_worker(rank, world):
    """Shapes of the tensors a training step saves, and the bytes the vision side saves for this
    rank's images (the unmodified tower on all of them, at D = 1)."""
    mesh = init_tsp_mesh(world)
    out = {}
    for name in ("qwen2_5_vl", "qwen3_vl"):
        model = build_vlm(name)
        data = first_row(name, vlm_batch(name, S=SEQ))  # one row: B·S/D is never S
        pixels = torch.cat([data["pixel_values"], data["pixel_values_videos"]])
        grids = torch.cat([data["image_grid_thw"], data["video_grid_thw"]])
        for key, n in (("one", 1), ("all", len(grids))):  # the first image alone; every unit
            rows = int(grids[:n].prod(-1).sum())
            with SavedTensorBytes(ignore=model.parameters()) as rec:
                model.model.visual(pixels[:rows], grid_thw=grids[:n])
            out[f"hf_{name}_{key}"] = (rec.nbytes, rows)
        out[f"hf_{name}_vision_shapes"] = rec.shapes  # every unit's
        with SavedTensorBytes() as rec:
            model(**{k: v for k, v in data.items() if k != "labels"})
        out[f"hf_{name}_shapes"] = rec.shapes
        apply_tsp(model, mesh)
        local = shard_batch(data, mesh, model=model)
        with SavedTensorBytes(ignore=model.parameters()) as rec:
            encode(model, local["pixel_values"], local["vision_grid_thw"])
        out[f"{name}_vision"] = (rec.nbytes, local["pixel_values"].shape[0], pixels.shape[0])
        out[f"{name}_vision_shapes"] = rec.shapes
        with SavedTensorBytes() as rec:
            model(**local).loss.backward()
        out[name] = rec.shapes
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_no_rank_saves_the_whole_sequence_or_every_images_activations(workers, world):
    per_rank = workers.run(memory_worker, world)
    for name in ("qwen2_5_vl", "qwen3_vl"):
        # the tower's activations grow with its patches
        (all_bytes, total), (one_bytes, one) = (
            per_rank[0][f"hf_{name}_{k}"] for k in ("all", "one")
        )
        per_patch = (all_bytes - one_bytes) / (total - one)
        fixed = all_bytes - per_patch * total
        patches = [r[f"{name}_vision"][1] for r in per_rank]
        assert total == per_rank[0][f"{name}_vision"][2]
        assert sum(patches) == total and max(patches) < total
        for res in per_rank:
            saved, mine, _ = res[f"{name}_vision"]
            # this rank's images only: the unmodified tower's bytes for as many patches
            assert saved <= 1.02 * (fixed + per_patch * mine), (name, saved, mine, fixed, per_patch)
            assert saved < all_bytes
            # the checks can see them: the unmodified model saves both sizes
            assert any(SEQ in s for s in res[f"hf_{name}_shapes"])
            assert any(total in s for s in res[f"hf_{name}_vision_shapes"])
            for s in res[name]:
                assert SEQ not in s, f"{name} saved a full-sequence tensor {s}"
            for s in res[f"{name}_vision_shapes"]:
                assert total not in s, f"{name} saved every image's activations {s}"


def errors_worker(rank, world):
    mesh = init_tsp_mesh(world)
    model = build_vlm("qwen2_5_vl")
    llava = build_vlm("llava")
    apply_tsp(model, mesh)
    apply_tsp(llava, mesh)
    data = vlm_batch("qwen2_5_vl")
    lost = dict(data, input_ids=data["input_ids"].masked_fill(data["input_ids"] == VIDEO, 7))
    cut = dict(data, pixel_values=data["pixel_values"][:-4])
    ldata = vlm_batch("llava")
    odd = dict(ldata, pixel_values=ldata["pixel_values"][:2])
    packed = dict(data, position_ids=torch.arange(64).remainder(32)[None].expand(2, -1))
    local = shard_batch(data, mesh, model=model)
    return {
        "video tokens": error_message(lambda: shard_batch(lost, mesh, model=model)),
        "patch rows": error_message(lambda: shard_batch(cut, mesh, model=model)),
        "llava images": error_message(lambda: shard_batch(odd, mesh, model=llava)),
        "no model": error_message(lambda: shard_batch(data, mesh)),
        "packed": error_message(lambda: shard_batch(packed, mesh, model=model)),
        "raw batch": error_message(
            lambda: model(**{**local, "image_grid_thw": data["image_grid_thw"]})
        ),
        "encoder outputs": error_message(lambda: model(**local, mm_encoder_outputs={})),
        "unsupported": error_message(lambda: apply_tsp(unsupported_vlm(), mesh)),
        "intervals": error_message(
            lambda: apply_tsp(
                build_vlm("qwen3_vl"),
                mesh,
                config=TSPConfig(checkpoint_layers=True, checkpoint_every=2),
            )
        ),
    }


def unsupported_vlm():
    """A tiny PaliGemma: its image-and-prompt prefix attends bidirectionally."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    cfg = PaliGemmaConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=64,
            model_type="gemma",
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        image_token_index=60,
    )
    return PaliGemmaForConditionalGeneration(cfg)


@pytest.mark.parametrize("world", [2])
def test_bad_input_raises_the_same_clear_error_on_every_rank(workers, world):
    per_rank = workers.run(errors_worker, world)
    assert all(r == per_rank[0] for r in per_rank)
    errs = per_rank[0]
    assert "0 video tokens in input_ids do not match the 8 video features" in errs["video tokens"]
    assert "pixel_values has 44 patch rows, its grid 48" in errs["patch rows"]
    assert (
        "12 image tokens in input_ids do not match 2 images in pixel_values (4 tokens each)"
        in (errs["llava images"])
    )
    assert "shard_batch(batch, mesh, model=model)" in errs["no model"]
    assert "packed documents (position_ids) with images" in errs["packed"]
    assert "takes the local inputs shard_batch makes" in errs["raw batch"]
    assert "(mm_encoder_outputs) hold every image on every rank" in errs["encoder outputs"]
    assert "PaliGemmaForConditionalGeneration is a vision-language model" in errs["unsupported"]
    assert "Qwen2_5_VLForConditionalGeneration" in errs["unsupported"]
    assert "checkpoint_every=2 with Qwen3-VL: its deepstack features" in errs["intervals"]


def data_parallel_worker(rank, world):
    """dp = 2 replicas of TSP = 2 on the same batch: FSDP2 (every gradient against the
    unmodified model), ZeRO-2 (loss and gradient norm), ZeRO-3 (refused)."""
    import tsp_ext.deepspeed as tds
    from tsp_ext.fsdp import shard_model

    data = vlm_batch("qwen2_5_vl")
    ref_loss, _, ref_grads = reference(build_vlm("qwen2_5_vl"), data)
    data32 = vlm_batch("qwen2_5_vl", torch.float32)
    loss32, _, grads32 = reference(build_vlm("qwen2_5_vl", torch.float32), data32)
    norm32 = torch.sqrt(sum((g.double() ** 2).sum() for g in grads32.values()))
    mesh = init_tsp_mesh(2)
    model = shard_model(apply_tsp(build_vlm("qwen2_5_vl"), mesh), mesh)
    out = model(**shard_batch(data, mesh, model=model))
    out.loss.backward()
    grads = full_grads(model)
    errs = {n: grad_error(n, grads[n], ref_grads) for n in ref_grads}
    errs["fsdp2 loss"] = rel_err(out.loss.detach(), ref_loss)

    def zero(stage: int, model):
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
        config["tsp"] = {"size": 2}
        return tds.initialize(model=model, config=config, optimizer=torch.optim.AdamW)[0]

    engine = zero(2, build_vlm("qwen2_5_vl", torch.float32))
    out = engine(**shard_batch(data32, mesh, model=engine.module))
    engine.backward(out.loss)
    engine.step()
    errs["zero2 loss"] = rel_err(out.loss.detach(), loss32)
    errs["zero2 norm"] = abs(float(engine.get_global_grad_norm()) / float(norm32) - 1)
    engine.destroy()
    refused = error_message(lambda: zero(3, build_vlm("qwen2_5_vl", torch.float32)))
    return errs, refused


def test_data_parallel_engines_with_a_vlm(workers):
    for errs, refused in workers.run(data_parallel_worker, 4, timeout=400):
        zero2 = {k: errs.pop(k) for k in ("zero2 loss", "zero2 norm")}
        assert all(v < 1e-10 for v in errs.values()), errs
        assert all(v < 1e-5 for v in zero2.values()), zero2  # float32
        assert "ZeRO-3 with a vision-language model (Qwen2_5_VLForConditionalGeneration)" in (
            refused
        )
