"""DPO under TSP against single-process TRL: per-rank memory and step time of one DPO step.

    python -m benchmarks.preference --devices 2 4 --seq-len 1024 2048 \\
        --json docs/benchmarks/preference_cpu.json

Each row trains the same model on the same preference pair (prompt: the first half of the sequence,
chosen / rejected completions: the second half) with TRL's ``DPOTrainer``: ``trl`` in one process
as long-context users run it (TRL's own chunked fused LM head, full weights, gradient checkpointing
of every layer), ``trl_no_ckpt`` the same without checkpointing, ``tsp`` with ``TSPDPOTrainer`` at
D ranks (policy and frozen reference folded). Per rank: the bytes autograd saves in the step's
forward (policy, and the reference under ``no_grad``), the peak of tensor bytes allocated during
the step (profiler allocation events, the resident weights and optimizer state excluded), the
parameters' bytes (policy + reference) and the step time (median of ``--steps``, after one warm-up
step; forward + backward of ``compute_loss``). Times are ratios of the ``trl`` row's at the same S,
measured in one run. DPO on the ALST path (Ulysses + ZeRO-3) and the longest S under one budget:
``python -m benchmarks.maxlen --layouts dpo_tsp_long dpo_alst`` (``dpo_layouts``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

from tsp_ext.memory import PeakAllocated, SavedTensorBytes
from tsp_ext.testing.launch import run_processes

MODEL = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=8192,
)  # fmt: skip


NAMES = {
    "trl": "TRL DPOTrainer, checkpointing",
    "trl_no_ckpt": "TRL DPOTrainer, no checkpointing",
    "tsp": "TSPDPOTrainer",
}


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)} | {"eos": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="eos", pad_token="eos")


def _inputs(seq_len: int, vocab: int) -> dict[str, torch.Tensor]:
    """One pair as ``DataCollatorForPreference`` makes it: ``[chosen; rejected]`` rows."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (2, seq_len), generator=g)
    ids[1, : seq_len // 2] = ids[0, : seq_len // 2]  # the shared prompt
    completion = torch.zeros(2, seq_len, dtype=torch.long)
    completion[:, seq_len // 2 :] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}


def _rank(rank: int, world: int, spec: dict) -> dict:
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from tsp_ext import TSPDPOTrainer

    S = spec["seq_len"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, max_position_embeddings=S))
    data = Dataset.from_dict({"prompt": ["w1 w2"], "chosen": [" w3 eos"], "rejected": [" w4 eos"]})
    args = DPOConfig(
        output_dir=spec["out"], per_device_train_batch_size=1, use_cpu=True, report_to=[],
        max_length=S, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    kw = dict(args=args, train_dataset=data, processing_class=_tokenizer(MODEL["vocab_size"]))
    if spec["layout"] == "tsp":
        trainer = TSPDPOTrainer(model, tsp=world, data_parallel="ddp", **kw)
    else:
        trainer = DPOTrainer(model, ref_model=copy.deepcopy(model), **kw)
    policy, ref = trainer.model, trainer.ref_model
    policy.train()
    if spec["layout"] == "trl":
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = _inputs(S, MODEL["vocab_size"])
    params = sum(p.numel() * p.element_size() for m in (policy, ref) for p in m.parameters())

    def step():
        policy.zero_grad(set_to_none=True)
        trainer.compute_loss(policy, inputs).backward()

    step()
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    policy.zero_grad(set_to_none=True)
    weights = [p for m in (policy, ref) for p in m.parameters()]
    with PeakAllocated() as peak:
        with SavedTensorBytes(ignore=weights) as saved:
            loss = trainer.compute_loss(policy, inputs)
        loss.backward()
    return {
        "params": params,
        "saved": saved.nbytes,
        "peak": peak.nbytes,
        "step_seconds": statistics.median(times),
        "loss": float(loss.detach()),
    }


def measure(layout: str, devices: int, seq_len: int, steps: int, out: str) -> dict:
    spec = dict(layout=layout, seq_len=seq_len, steps=steps, out=out)
    ranks = run_processes(_rank, devices, spec, timeout=1800)
    row = {k: max(r[k] for r in ranks) for k in ("params", "saved", "peak", "step_seconds")}
    row.update(layout=layout, devices=devices, seq_len=seq_len, loss=ranks[0]["loss"])
    return row


def compare(devices: list[int], seq_lens: list[int], steps: int, out: str) -> dict:
    rows = []
    for S in seq_lens:
        base = measure("trl", 1, S, steps, out)
        rows.append({**base, "step_ratio": 1.0})
        plain = measure("trl_no_ckpt", 1, S, steps, out)
        rows.append({**plain, "step_ratio": plain["step_seconds"] / base["step_seconds"]})
        for D in devices:
            row = measure("tsp", D, S, steps, out)
            rows.append({**row, "step_ratio": row["step_seconds"] / base["step_seconds"]})
    return {"model": MODEL, "rows": rows}


def markdown(result: dict) -> str:
    mib = 2**20
    lines = [
        "| S | layout | D | weights MiB | saved MiB | step peak MiB | step s | / TRL ckpt |",
        "|---" * 8 + "|",
    ]
    for r in result["rows"]:
        name = NAMES[r["layout"]]
        lines.append(
            f"| {r['seq_len']} | {name} | {r['devices']} | {r['params'] / mib:.2f} | "
            f"{r['saved'] / mib:.2f} | {r['peak'] / mib:.2f} | {r['step_seconds']:.3f} | "
            f"{r['step_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.preference", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="TSP sizes")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="/tmp/tsp_preference_bench", help="trainer output dir")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    result = compare(args.devices, args.seq_len, args.steps, args.out)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
