"""Weight sync for an external generator: ``stream_weights`` into a vLLM-like receiver (a plain
Hugging Face model with ``load_weights``) against the one-process model, tensor for tensor."""

from __future__ import annotations

import copy
import functools
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
from models import LORA_TARGETS, build, build_lora

from tsp_ext import init_tsp_mesh, iter_weights, stream_weights, weight_metadata
from tsp_ext.hf.full_state import full_tensor

pytestmark = pytest.mark.multiproc


class Receiver:
    """What vLLM's model offers: ``load_weights([(name, tensor)])`` copies each tensor into a
    plain Hugging Face model; only (name, dtype, shape) and a weak reference are kept."""

    def __init__(self, model) -> None:
        self.model = model
        self.params = model.state_dict()
        self.got: list[tuple[str, torch.dtype, torch.Size]] = []
        self.refs: list[tuple[str, weakref.ref]] = []

    def load_weights(self, weights) -> None:
        for name, t in weights:
            self.got.append((name, t.dtype, t.shape))
            self.params[name].copy_(t)
            self.refs.append((name, weakref.ref(t)))


class FailingReceiver:
    """Raises on the third tensor."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, weights) -> None:
        self.n += 1
        if self.n == 3:
            raise OSError("connection to the vLLM server lost (simulated)")


def stream(model, plain, dst: int) -> dict:
    """Stream ``model`` into ``plain`` on rank ``dst``: what arrived (in order), the metadata,
    and the tensors handed over that were still alive when a later gather began."""
    receiver = Receiver(plain) if dist.get_rank() == dst else None
    alive = []

    def profile(frame, event, arg):  # each full_tensor call starts a gather
        if event == "call" and frame.f_code is full_tensor.__code__ and receiver is not None:
            alive.extend(n for n, r in receiver.refs if r() is not None)

    sys.setprofile(profile)
    try:
        stream_weights(model, receiver, dst=dst)
    finally:
        sys.setprofile(None)
    out = {"metadata": weight_metadata(model), "alive": alive}
    if receiver is not None:
        out.update(got=receiver.got, state=plain.state_dict())
    return out


def case(name: str, dtype: torch.dtype):
    """(the model to make TSP, the one-process Hugging Face state dict it must stream as, a
    plain model of that architecture with other weights to receive it)."""
    if name == "lora":  # non-zero B's: the merged weights differ from the base
        peft = build_lora("llama", dtype, LORA_TARGETS)
        ref = copy.deepcopy(peft).merge_and_unload().state_dict()
        return peft, ref, build("llama", dtype, seed=1)
    model = build(name, dtype)
    return model, copy.deepcopy(model.state_dict()), build(name, dtype, seed=1)


def tsp_model(model, tsp: int, engine: str):
    """``model`` made a TSP model of size ``tsp``, sharded over dp by ``engine``; (the TSP
    model, the DeepSpeed engine or None)."""
    from tsp_ext import apply_tsp

    if engine == "fsdp2":  # the TSP model's shards sharded again over dp
        import tsp_ext.fsdp as tfs

        mesh = init_tsp_mesh(tsp)
        tfs.shard_model(apply_tsp(model, mesh), mesh)
        return model, None
    if engine == "zero3":  # each TSP shard partitioned over dp
        import tsp_ext.deepspeed as tds

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        ds, *_ = tds.initialize(
            model=model,
            config={**config, "tsp": {"size": tsp}},
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        )
        return ds.module, ds
    return apply_tsp(model, init_tsp_mesh(tsp)), None


def sync_worker(rank, world, runs, tsp):
    res = {}
    for name, engine in runs:
        dtype = torch.float32 if engine == "zero3" else torch.float64  # ZeRO-3: no float64
        model, ref, plain = case(name, dtype)
        model, ds = tsp_model(model, tsp, engine)
        res[name, engine] = {"ref": ref if rank == 0 else None, **stream(model, plain, 0)}
        if name == "llama" and tsp == world == 2:
            res["dst1"] = stream(model, build("llama", dtype, seed=1), 1)
            res["dst1"]["ref"] = ref if rank == 1 else None
            res["iter"] = [n for n, _ in iter_weights(model)]  # rank 0 only
            try:
                stream_weights(model, FailingReceiver() if rank == 0 else None)
                res["failed"] = None
            except (OSError, RuntimeError) as e:
                res["failed"] = f"{type(e).__name__}: {e}"
        if ds is not None:
            ds.destroy()
    return res


def check(name: tuple[str, str], per_rank: list[dict], dst: int = 0) -> None:
    """On ``dst``: every Hugging Face name (but a tied head) arrived once, in the metadata's
    order, with its dtype and full shape, and equals the one-process tensor exactly; each was
    freed before the next gather; the metadata is the same on every rank."""
    res = per_rank[dst]
    ref = res["ref"]
    tied = name[0] == "llama_tied"
    # each once (not in HF's order: Phi-3's qkv_proj, stacked when its parts came, follows o_proj)
    names = sorted(m[0] for m in res["got"])
    assert names == sorted(n for n in ref if not (tied and n == "lm_head.weight")), name
    assert res["got"] == res["metadata"], name
    assert all(r["metadata"] == res["metadata"] for r in per_rank), name
    assert [n for n, t in ref.items() if not torch.equal(res["state"][n], t)] == [], name
    assert all(not r["alive"] for r in per_rank), (name, [r["alive"] for r in per_rank])
    assert all("got" not in r for i, r in enumerate(per_rank) if i != dst), name


@functools.cache
def synced(workers, world: int, tsp: int):
    if world == tsp == 2:
        runs = [(name, "ddp") for name in ("llama", "llama_tied", "phi3", "lora")]
    else:
        runs = [("llama", "ddp")] if world == tsp else [("llama", "fsdp2"), ("llama", "zero3")]
    return workers.run(sync_worker, world, runs, tsp, timeout=300)


@pytest.mark.parametrize("world,tsp", [(2, 2), (3, 3), (4, 2)])
def test_stream_weights_equal_the_hf_state_dict(workers, world, tsp):
    """At D = 2 (Llama with GQA, a tied one, Phi-3's fused projections, a PEFT model with its
    LoRA merged: equal to ``merge_and_unload``), D = 3 (uneven heads and MLP rows) and
    tsp = 2 x dp = 2 under FSDP2 and DeepSpeed ZeRO-3: every tensor arrives under Hugging Face's
    name, exactly the one-process value, one at a time."""
    results = synced(workers, world, tsp)
    for key in results[0]:
        if isinstance(key, tuple):
            check(key, [r[key] for r in results])
    if world == 2:  # to rank 1; the iterator; a receiver that fails on rank 0
        check(("llama", "ddp"), [r["dst1"] for r in results], dst=1)
        assert results[0]["iter"] == [m[0] for m in results[0]["llama", "ddp"]["metadata"]]
        assert results[1]["iter"] == []
        assert results[0]["failed"].startswith("OSError: connection"), results[0]["failed"]
        failed = "RuntimeError: stream_weights failed on rank 0; see its error"
        assert results[1]["failed"] == failed
