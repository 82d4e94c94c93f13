"""Training-state checkpoints (``tsp_ext.checkpoint.save`` / ``load``, DCP): exact resume,
resume at another TSP x dp layout, the same format for plain/DDP, FSDP2 and DeepSpeed ZeRO (one DCP
checkpoint per group of parameters), each rank's torch RNG restored, and refusal of incomplete,
damaged and other-model checkpoints."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from checks import error_message
from models import batch, build

from tsp_ext import (
    apply_tsp,
    checkpoint,
    full_state_dict,
    init_tsp_mesh,
    save_pretrained,
    shard_batch,
)

pytestmark = pytest.mark.multiproc

STEPS = 4  # straight; the checkpoint is taken after STEPS // 2
GROUP_BYTES = 16 * 2**10  # several groups of parameters in the tiny model (~100 KB)


class Trainer:
    """A tiny float32 Llama (8 heads, 2 KV heads: replicated KV at tsp=4) trained with AdamW on
    a fixed global batch of 2 sequences per step, split over the dp replicas."""

    def __init__(
        self, kind: str, tsp: int, seed: int = 0, family: str = "llama", **model_overrides
    ) -> None:
        self.kind = kind
        self.ds = None
        model = build(family, torch.float32, seed=seed, **model_overrides)
        factory = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
        schedule = lambda s: 1.0 / (1 + s)  # noqa: E731
        if kind.startswith("zero"):
            import tsp_ext.deepspeed as tds

            config = {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": int(kind[-1])},
                "tsp": {"size": tsp},
            }
            self.ds, self.optimizer, _, self.scheduler = tds.initialize(
                model=model,
                config=config,
                optimizer=factory,
                lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule),
            )
            self.mesh, self.model, self.forward = self.ds.tsp_mesh, model, self.ds
            return
        self.mesh = init_tsp_mesh(tsp)
        if kind == "fsdp2":
            import tsp_ext.fsdp as tfs

            self.model = self.forward = tfs.shard_model(model, self.mesh)
        else:
            self.model = apply_tsp(model, self.mesh)
            dp_group = self.mesh["dp"].get_group()
            self.forward = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
        self.optimizer = factory(self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def step(self, step: int) -> float:
        dp, replica = self.mesh["dp"].size(), self.mesh["dp"].get_local_rank()
        data = batch(self.model.config.vocab_size, 2, 24, seed=step)
        rows = {k: v.chunk(dp)[replica] for k, v in data.items()}
        loss = self.forward(**shard_batch(rows, self.mesh)).loss
        if self.ds is not None:
            self.ds.backward(loss)
            self.ds.step()
        else:
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total, group=self.mesh["dp"].get_group())
        return total.item() / dp

    def save(self, path: str, step: int, **kw):
        return checkpoint.save(path, self.model, self.optimizer, scheduler=self.scheduler,
                               extra_state={"step": step}, engine=self.ds, **kw)  # fmt: skip

    def load(self, path: str) -> int:
        extra = checkpoint.load(
            path, self.model, self.optimizer, scheduler=self.scheduler, engine=self.ds
        )
        return extra["step"]

    def params(self) -> dict[str, torch.Tensor]:
        if self.ds is not None:
            import tsp_ext.deepspeed as tds

            return tds.full_state_dict(self.ds)
        return full_state_dict(self.model)


def resume_worker(rank, world, kind, tmp):
    """Straight at tsp=4; 2 steps + save; resume at tsp=4 (fresh model) and at tsp=2 x dp=2."""
    half = STEPS // 2
    straight = Trainer(kind, 4)
    losses = [straight.step(s) for s in range(STEPS)]
    final = straight.params()
    export_equal = True
    if kind in ("fsdp2", "zero3"):  # streamed export from dp-sharded parameters
        from transformers import AutoModelForCausalLM

        exported = os.path.join(tmp, kind, "hf")
        save_pretrained(straight.model, exported, max_shard_size="20KB")
        hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
        export_equal = all(torch.equal(hf[k], v) for k, v in final.items())

    first = Trainer(kind, 4)
    for s in range(half):
        first.step(s)
    with torch.no_grad():  # an evaluation: FSDP2 leaves the root's parameters unsharded
        first.forward(**shard_batch(batch(first.model.config.vocab_size, 1, 24), first.mesh))
    ckpt = os.path.join(tmp, kind, f"checkpoint-{half}")
    torch.manual_seed(100 + rank)  # each rank's own generator state goes into the checkpoint
    first.save(ckpt, half, max_group_bytes=GROUP_BYTES)
    draws = torch.rand(4)
    out = {"straight": losses, "export_equal": export_equal}
    for name, tsp in (("exact", 4), ("reshard", 2)):
        again = Trainer(kind, tsp, seed=1)  # other weights (and RNG), overwritten by the load
        start = again.load(ckpt)
        out[name + "_rng"] = torch.equal(torch.rand(4), draws)
        out[name] = [again.step(s) for s in range(start, STEPS)]
        params = again.params()
        out[name + "_params"] = max((params[k] - final[k]).abs().max().item() for k in final)
    out["files"] = sorted(os.listdir(ckpt))
    out["groups"] = len(checkpoint.inspect(ckpt)["groups"])
    return out


@functools.cache
def resumed(workers, kind: str, tmp: str):
    return workers.run(resume_worker, 4, kind, tmp, timeout=400)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "zero2", "zero3"])
def test_exact_and_resharded_resume(workers, kind, tmp):
    for res in resumed(workers, kind, tmp):
        half = STEPS // 2
        assert res["exact"] == res["straight"][half:], res  # bit-identical, float32
        assert res["exact_params"] == 0.0, res
        for a, b in zip(res["reshard"], res["straight"][half:]):
            assert abs(a - b) < 1e-5 * b, res
        assert res["reshard_params"] < 1e-5, res
        assert res["exact_rng"] and res["reshard_rng"], res  # the same 4 ranks: RNG restored
        assert res["groups"] > 2, res  # several DCP checkpoints, each read on its own
        assert res["files"] == [f"group-{i:05d}" for i in range(res["groups"])] + [
            "rng",
            "trainer_state.json",
        ]
        assert res["export_equal"], res


# Uneven layouts (world of 4 ranks): tsp=4 against tsp=2 x dp=2, each way.
UNEVEN = {
    # 5 + 4 query heads at tsp=2 (KV head 1 on both ranks), 3+2+2+2 at tsp=4 (KV heads 1 and 2
    # each on two ranks); MLP width 53 and vocabulary 97 split unevenly at both sizes
    "9q_3kv": dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                   intermediate_size=53, vocab_size=97),
    # fully even at tsp=2; at tsp=4 2+2+1+1 query heads, KV head 0 on ranks 0-1, KV head 1 on
    # ranks 1-3 (rank 1 holds a copy and an own head in one slice)
    "6q_2kv": dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                   intermediate_size=52, vocab_size=96),
}  # fmt: skip


def uneven_resume_worker(rank, world, kind, model, tmp):
    """Straight runs at tsp=4 and at tsp=2 x dp=2; checkpoints taken by each after 2 steps,
    resumed at the same size (exact) and at the other one, against the run that was interrupted
    (fp32 AdamW makes the two straight runs differ by ~1e-4 in some weights)."""
    shape, half = UNEVEN[model], STEPS // 2
    out, final = {}, {}
    for tsp in (4, 2):
        straight = Trainer(kind, tsp, **shape)
        out[f"straight{tsp}"] = [straight.step(s) for s in range(STEPS)]
        final[tsp] = straight.params()
        first = Trainer(kind, tsp, **shape)
        for s in range(half):
            first.step(s)
        first.save(os.path.join(tmp, kind, model, f"at-{tsp}"), half)
    for saved_at, resumed_at in ((4, 4), (4, 2), (2, 4)):
        again = Trainer(kind, resumed_at, seed=1, **shape)  # other weights, overwritten by load
        start = again.load(os.path.join(tmp, kind, model, f"at-{saved_at}"))
        key = f"{saved_at}->{resumed_at}"
        out[key] = [again.step(s) for s in range(start, STEPS)]
        params, ref = again.params(), final[saved_at]
        out[key + "_params"] = max((params[k] - ref[k]).abs().max().item() for k in ref)
        out[key + "_over"] = sum(int(((params[k] - ref[k]).abs() > 1e-5).sum()) for k in ref)
    out["numel"] = sum(t.numel() for t in final[4].values())
    return out


# (ZeRO-2 runs AdamW on fp32 masters; on the 6/2 model its straight runs at tsp=4 and tsp=2 already
# differ by ~1e-4 in some weights after two steps, so the 9/3 model is the one checked. There,
# resuming the tsp=4 checkpoint at tsp=2 leaves one embedding element of 64,872 1.1e-4 from the
# straight run, every other one within 1.2e-7: the load is exact, but that element's first
# non-zero gradient, in the first resumed step, is -6.9e-8 — near AdamW's eps = 1e-8, where the
# step is ~lr·|g|/(|g| + 1.7e-8) and the summation order's rounding shows. A resharding error
# would move many elements, so a few are allowed.)
@pytest.mark.parametrize(
    "kind, model", [("ddp", "9q_3kv"), ("ddp", "6q_2kv"), ("fsdp2", "6q_2kv"), ("zero2", "9q_3kv")]
)
def test_uneven_layouts_resume_at_another_tsp_size(workers, kind, model, tmp):
    for res in workers.run(uneven_resume_worker, 4, kind, model, tmp, timeout=400):
        assert res["4->4"] == res["straight4"][STEPS // 2 :], res  # bit-identical
        assert res["4->4_params"] == 0.0, res
        for saved_at, resumed_at in ((4, 2), (2, 4)):
            key, rest = f"{saved_at}->{resumed_at}", res[f"straight{saved_at}"][STEPS // 2 :]
            assert all(abs(a - b) < 1e-5 * b for a, b in zip(res[key], rest)), (key, res)
            assert res[key + "_over"] <= res["numel"] // 10_000, (key, res)  # 6 of 64,872
            assert res[key + "_params"] < 1e-3, (key, res)


def _damage(ckpt: str, where: str, how: str) -> str:
    """A copy of ``ckpt`` at ``where``, damaged as ``how`` says (on rank 0; all ranks wait)."""
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, where)
        if how == "interrupted":  # what a save killed before its completion leaves
            os.remove(os.path.join(where, "trainer_state.json"))
        elif how == "truncated":
            data = max(  # the largest data file of any group
                (os.path.join(d, f) for d, _, fs in os.walk(where) for f in fs if "distcp" in f),
                key=os.path.getsize,
            )
            with open(data, "r+b") as f:
                f.truncate(os.path.getsize(data) // 2)
        elif how == "corrupt":
            with open(os.path.join(where, "trainer_state.json"), "w") as f:
                f.write('{"format": ')
    dist.barrier()
    return where


def safety_worker(rank, world, tmp):
    """Async save while training goes on; refusals leave the model untouched."""
    trainer = Trainer("ddp", 2)
    trainer.step(0)
    ckpt = os.path.join(tmp, "async")
    snapshot = trainer.params()
    pending = trainer.save(ckpt, 1, async_save=True, max_group_bytes=GROUP_BYTES)
    trainer.step(1)  # changes the parameters while the checkpoint is written
    pending.wait()
    fresh = Trainer("ddp", 2, seed=1)
    fresh.load(ckpt)
    loaded = fresh.params()
    out = {"async_equal": all(torch.equal(snapshot[k], loaded[k]) for k in snapshot)}
    out["no_leftovers"] = not [f for f in os.listdir(tmp) if f.startswith(".")]

    before = fresh.params()
    for how in ("interrupted", "truncated", "corrupt"):
        bad = _damage(ckpt, os.path.join(tmp, how), how)
        out[how] = error_message(lambda: fresh.load(bad))  # noqa: B023
    other = Trainer("ddp", 2, hidden_size=64)
    out["other_model"] = error_message(lambda: other.load(ckpt))
    out["missing"] = error_message(lambda: fresh.load(os.path.join(tmp, "nowhere")))
    after = fresh.params()
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    out["inspect"] = checkpoint.inspect(ckpt)["extra_state"]
    return out


@functools.cache
def safety(workers, tmp: str):
    return workers.run(safety_worker, 2, os.path.join(tmp, "safety"), timeout=300)


def test_async_save_and_refused_checkpoints(workers, tmp):
    os.makedirs(os.path.join(tmp, "safety"), exist_ok=True)
    for res in safety(workers, tmp):
        assert res["async_equal"] and res["no_leftovers"], res
        assert "is incomplete: it has no trainer_state.json" in res["interrupted"], res
        assert "is damaged:" in res["truncated"] and "truncated" in res["truncated"], res
        assert "trainer_state.json is truncated or corrupt" in res["corrupt"], res
        assert "holds another model" in res["other_model"], res
        assert "has shape" in res["other_model"], res
        assert "is not a checkpoint directory" in res["missing"], res
        assert res["untouched"] and res["inspect"] == {"step": 1}, res


def moe_resume_worker(rank, world, tmp):
    """Mixtral (4 experts: one a rank at tsp=4, two at tsp=2) with DDP: 2 steps at tsp=4 and a
    checkpoint, resumed at tsp=2 x dp=2, against the straight tsp=4 run."""
    half, path = STEPS // 2, os.path.join(tmp, "moe", "checkpoint")
    straight = Trainer("ddp", 4, family="mixtral")
    losses = [straight.step(s) for s in range(STEPS)]
    final = straight.params()
    first = Trainer("ddp", 4, family="mixtral")
    for s in range(half):
        first.step(s)
    first.save(path, half)
    again = Trainer("ddp", 2, seed=1, family="mixtral")  # other weights, overwritten by the load
    start = again.load(path)
    resumed = [again.step(s) for s in range(start, STEPS)]
    params = again.params()
    return losses[half:], resumed, max((params[k] - final[k]).abs().max().item() for k in final)


def test_moe_experts_reshard_from_tsp4_to_tsp2(workers, tmp):
    for straight, resumed, params in workers.run(moe_resume_worker, 4, tmp, timeout=400):
        assert all(abs(a - b) < 1e-5 * b for a, b in zip(resumed, straight)), (resumed, straight)
        assert params < 1e-4, params
