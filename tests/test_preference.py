"""Per-token log-probabilities and DPO under TSP against the unmodified Hugging Face model and
single-process TRL ``DPOTrainer`` on the same batch."""

from __future__ import annotations

import copy
import functools
import glob
import types

import pytest
import torch
from checks import error_message, rel_err
from models import LORA_TARGETS, batch, build
from test_trainer import ZERO2
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tsp_ext import TSPConfig, apply_tsp, full_grads, init_tsp_mesh, sequence_logps, shard_batch
from tsp_ext.hf.batch import gather_sequence

pytestmark = pytest.mark.multiproc

B, S, V = 2, 128, 1024  # S/D · V/D at D = 2: twice the LM-head shard, the largest other tensor
STATS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def reference_fields(model, data) -> dict[str, torch.Tensor]:
    """Per-token fields ``[B, S - 1]`` from the full fp64 logits of the unmodified model."""
    logits = model(input_ids=data["input_ids"]).logits[:, :-1].double()
    labels = data["labels"][:, 1:]
    if "attention_mask" in data:
        labels = labels.masked_fill(data["attention_mask"][:, 1:] == 0, -100)
    mask = labels != -100
    logp = logits.log_softmax(-1)
    target = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    p = logp.exp()
    fields = {
        "log_probs": target,
        "entropy": -(p * logp).sum(-1),
        "log_sum_sq_probs": (2 * logp).logsumexp(-1),
        "mean_logits": logits.mean(-1),
        "is_top1": logits.argmax(-1) == labels,
    }
    return {k: torch.where(mask, v, torch.zeros_like(v)) for k, v in fields.items()}


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def token_logps_worker(rank, world):
    """Sharded ``token_logps`` and the fused protocol's gathered fields vs the HF logits, their
    gradients, and the largest tensor of a step."""
    mesh = init_tsp_mesh(world)
    model = build("llama", torch.float64, vocab_size=V)
    ref = copy.deepcopy(model)
    data = batch(V, B, S - 3, pad_last=9)  # S - 3: shard_batch pads to a multiple of 2D
    data["labels"][:, :7] = -100  # a prompt
    weights = torch.randn(B, S - 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expect = reference_fields(ref, data)
    (expect["log_probs"] * weights).sum().backward()

    apply_tsp(model, mesh, config=TSPConfig(loss_chunk=8))
    sharded = shard_batch(data, mesh)
    out = model(**sharded, return_token_logps=True)
    local = gather_sequence(out.token_logps.detach(), mesh, S - 3)[:, :-1]
    seq = sequence_logps(out.token_logps, model)
    errs = {
        "token_logps": rel_err(local, expect["log_probs"]),
        "sequence_logps": rel_err(seq.detach(), expect["log_probs"].sum(1)),
    }
    largest = LargestTensor()
    with largest:
        fused = model(**data, fused_lm_head=True)
        (fused.log_probs * weights).sum().backward()
    errs.update({k: rel_err(getattr(fused, k), v) for k, v in expect.items()})
    grads = full_grads(model)
    errs["grads"] = max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters())
    T = sharded["input_ids"].shape[1]
    return errs, largest.numel, T * V // world


@pytest.mark.parametrize("world", [2, 3])  # D = 1 and 4: through DPO's log-probs below
def test_token_logps_match_log_softmax_of_hf_logits(workers, world):
    for errs, largest, local_logits in workers.run(token_logps_worker, world, timeout=120):
        assert max(errs.values()) < 1e-10, errs
        if world == 2:  # no [S/D, V/D] logits, let alone [S/D, V]
            assert largest < local_logits, (largest, local_logits)


def packed_pairs_worker(rank, world):
    """Packed pairs (two sequences per row, as padding-free DPO packs a chosen and a rejected
    one; position ids restarting at 0): the fused protocol's log-probs and their gradients vs
    each sequence run alone through the unmodified model."""
    from transformers import DataCollatorWithFlattening

    mesh = init_tsp_mesh(world)
    model = build("llama", torch.float64, vocab_size=V)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    docs = [[torch.randint(0, V, (n,), generator=g) for n in lens] for lens in ([9, 19], [23, 5])]
    rows = [DataCollatorWithFlattening()([{"input_ids": d} for d in row]) for row in docs]
    data = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    weights = torch.randn(2, data["input_ids"].shape[1] - 1, dtype=torch.float64, generator=g)

    expect = []
    for row in docs:  # each document alone: its own tokens' log-probs, then the next's first
        parts = []
        for d in row:
            logp = ref(input_ids=d[None]).logits[0, :-1].log_softmax(-1)
            parts += [logp.gather(-1, d[1:, None])[:, 0], logp.new_zeros(1)]
        expect.append(torch.cat(parts)[:-1])  # no label for the row's last token
    expect = torch.stack(expect)
    (expect * weights).sum().backward()

    apply_tsp(model, mesh)
    out = model(**data, fused_lm_head=True)
    (out.log_probs * weights).sum().backward()
    grads = full_grads(model)
    return {
        "log_probs": rel_err(out.log_probs.detach(), expect.detach()),
        "grads": max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters()),
    }


def test_packed_pairs_match_each_document_alone(workers):
    for errs in workers.run(packed_pairs_worker, 2, timeout=120):
        assert max(errs.values()) < 1e-10, errs


# --- DPO against TRL's DPOTrainer ---------------------------------------------------------


def word_tokenizer(vocab: int):
    """A whitespace word-level tokenizer: ``w0 .. w{vocab-2}`` and ``eos`` (no training)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)} | {"eos": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="eos", pad_token="eos")


def pairs(n: int, vocab: int, seed: int = 0):
    """``n`` preference pairs of random words (prompt 3-9 words, completions 2-12), a Dataset."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def words(lo, hi):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(f"w{int(i)}" for i in torch.randint(0, vocab - 1, (k,), generator=g))

    rows = [(words(3, 10), words(2, 13), words(2, 13)) for _ in range(n)]
    return Dataset.from_dict(
        {
            "prompt": [r[0] for r in rows],
            "chosen": [f" {r[1]} eos" for r in rows],
            "rejected": [f" {r[2]} eos" for r in rows],
        }
    )


def dpo_args(tmp, **kw):
    from trl import DPOConfig

    base = dict(
        output_dir=tmp, per_device_train_batch_size=4, use_cpu=True, report_to=[], beta=0.3,
        max_length=40, save_strategy="no", logging_steps=1, seed=7,
    )  # fmt: skip
    return DPOConfig(**{**base, **kw})


def exact_fused_head(model) -> None:
    """TRL's fused-LM-head protocol on ``model`` from its full fp64 logits (``reference_fields``):
    TRL's own kernel computes in float32, so a float64 reference replaces it (the loss code stays
    TRL's)."""
    from trl.trainer.utils import FusedCausalLMOutput

    def forward(self, input_ids=None, labels=None, fused_lm_head=False, **kwargs):
        if not fused_lm_head:
            return type(self).forward(self, input_ids=input_ids, labels=labels, **kwargs)
        data = {"input_ids": input_ids, "labels": labels}
        if kwargs.get("attention_mask") is not None:
            data["attention_mask"] = kwargs["attention_mask"]
        fields = reference_fields(self, data)
        mask = fields["log_probs"] != 0
        loss = -fields["log_probs"].sum() / mask.sum()
        return FusedCausalLMOutput(loss=loss, label_mask=mask, **fields)

    model.forward = types.MethodType(forward, model)


def dpo_grads(trainer, model, inputs):
    """``compute_loss`` on ``inputs`` and its backward: loss, metrics, trainable gradients."""
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    logged = trainer._metrics["train"].items()
    metrics = {k: v[-1] for k, v in logged if k.startswith(("rewards", "logps", "logits"))}
    return loss.detach(), metrics


def dpo_worker(rank, world, tmp, lora, loss_type):
    """One DPO step's loss, metrics and gradients: TSP (the trainer folds the reference) vs TRL.
    Full fine-tuning trains a perturbed copy of the reference (non-zero rewards) at D > 1 and
    the model itself at D = 1 (the trainer's own frozen copy); LoRA starts from zero B's."""
    from peft import LoraConfig, get_peft_model
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from tsp_ext import TSPDPOTrainer

    tok = word_tokenizer(V)
    data = pairs(8, V)
    model = build("llama", torch.float64, vocab_size=V)
    ref = None
    if lora:
        torch.manual_seed(3)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)
        model = get_peft_model(model, config)
    elif world > 1:
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    plain = copy.deepcopy(model)
    args = dpo_args(f"{tmp}/dpo{world}", loss_type=[loss_type])
    ref_kw = {} if lora else {"ref_model": copy.deepcopy(ref if ref is not None else model)}
    single = DPOTrainer(plain, args=args, train_dataset=data, processing_class=tok, **ref_kw)
    for m in (single.model, single.ref_model):
        if m is not None:
            exact_fused_head(m.get_base_model() if lora and m is single.model else m)
    examples = [single.train_dataset[i] for i in range(4)]
    inputs = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(examples)
    loss_ref, metrics_ref = dpo_grads(single, plain, inputs)
    ref_grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}

    trainer = TSPDPOTrainer(
        model, ref_model=ref, args=args, train_dataset=data, processing_class=tok, tsp=world,
        data_parallel="ddp",
    )  # fmt: skip
    loss, metrics = dpo_grads(trainer, trainer.model, inputs)
    grads = full_grads(trainer.model)
    errs = {"loss": rel_err(loss, loss_ref)}
    errs.update({k: abs(metrics[k] - v) / max(abs(v), 1.0) for k, v in metrics_ref.items()})
    # TRL's frozen "ref" copy of a PEFT adapter gets no gradient; TSP disables the adapter instead
    errs.update({n: rel_err(grads[n], g) for n, g in ref_grads.items()})
    missing = sorted(n for n in ref_grads if n not in grads)
    return errs, missing, metrics_ref["rewards/margins"]


@pytest.mark.parametrize(
    "world,lora,loss_type",
    [(1, False, "sigmoid"), (2, False, "sigmoid"), (2, True, "ipo"), (4, True, "sigmoid"),
     (3, False, "hinge")],
)  # fmt: skip
def test_dpo_matches_trl(workers, tmp, world, lora, loss_type):
    for errs, missing, margin in workers.run(dpo_worker, world, tmp, lora, loss_type, timeout=240):
        assert not missing
        assert max(errs.values()) < 1e-10, errs
        assert (margin != 0) == (world > 1 and not lora)  # a perturbed policy is compared


def errors_worker(rank, world, tmp):
    from peft import LoraConfig, get_peft_model
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from tsp_ext import TSPDPOTrainer

    tok, data = word_tokenizer(V), pairs(4, V)
    args = dpo_args(f"{tmp}/errors")
    msgs = {}

    def trainer(model, **kw):
        return TSPDPOTrainer(
            model, args=kw.pop("args", args), train_dataset=data, processing_class=tok,
            **{"tsp": world, **kw},
        )  # fmt: skip

    msgs["precompute"] = error_message(
        lambda: trainer(build("llama"), args=dpo_args(tmp, precompute_ref_log_probs=True))
    )
    peft = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        next(p for n, p in peft.named_parameters() if "lora_B" in n).fill_(1.0)
    msgs["trained"] = error_message(lambda: trainer(peft))
    folded = trainer(apply_tsp(build("llama", vocab_size=V), init_tsp_mesh(world)), tsp=None)
    policy, ref = (dict(m.named_parameters()) for m in (folded.model, folded.ref_model))
    msgs["copy"] = (  # the reference copied from the shards: 1/D, frozen, not shared
        policy.keys() == ref.keys()
        and all(
            ref[n].shape == p.shape and ref[n].data_ptr() != p.data_ptr() for n, p in policy.items()
        )
        and not any(p.requires_grad for p in ref.values())
    )
    other = apply_tsp(build("llama"), init_tsp_mesh(1)) if world > 1 else None
    if other is not None:
        msgs["ref"] = error_message(lambda: trainer(build("llama"), ref_model=other))
    good = trainer(build("llama", vocab_size=V))
    examples = [good.train_dataset[i] for i in range(2)]
    inputs = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(examples)
    if rank == world - 1:  # one rank's batch: all ranks raise
        inputs["completion_mask"][3] = 0
    msgs["empty"] = error_message(lambda: good.compute_loss(good.model, inputs))
    odd = {k: v[:3] if rank == 0 else v for k, v in inputs.items()}  # 2 chosen, 1 rejected
    msgs["odd"] = error_message(lambda: good.compute_loss(good.model, odd))
    ids = inputs["input_ids"].clone()
    ids[0, 0] = (ids[0, 0] + rank) % V  # another full batch on each rank
    msgs["different"] = error_message(
        lambda: good.model(input_ids=ids, labels=ids, fused_lm_head=True)
    )
    return msgs


def test_dpo_bad_input_is_refused_on_every_rank(workers, tmp):
    for msgs in workers.run(errors_worker, 2, tmp, timeout=180):
        assert "drop precompute_ref_log_probs" in msgs["precompute"]
        assert "adapters are untrained" in msgs["trained"]
        assert "policy's TSP group" in msgs["ref"]
        assert msgs["copy"] is True
        assert "rejected sequence of pair 1 has no completion tokens" in msgs["empty"]
        assert "TSP rank 0 of 2: the batch has 3 sequences" in msgs["odd"]  # rank 1 too
        assert "the TSP ranks got different full batches" in msgs["different"]


def dp_worker(rank, world, tmp, data_parallel, batch_size):
    """Three DPO steps of every weight (float32) with ``TSPDPOTrainer`` at tsp = 2, dp = world /
    2 with ``data_parallel`` (the reference copied from the folded shards), ``batch_size`` pairs
    per dp replica: the logged loss, gradient norm and reward margin per step."""
    from tsp_ext import TSPDPOTrainer

    settings = dict(
        per_device_train_batch_size=batch_size, max_steps=3, learning_rate=1e-3,
        lr_scheduler_type="constant", max_grad_norm=0.5, disable_tqdm=True,
    )  # fmt: skip
    if data_parallel == "zero2":
        settings["deepspeed"], data_parallel = ZERO2, None
    args = dpo_args(f"{tmp}/dp_{world}_{data_parallel}", **settings)
    model = build("llama", torch.float32, vocab_size=V)
    kw = dict(args=args, train_dataset=pairs(16, V), processing_class=word_tokenizer(V))
    trainer = TSPDPOTrainer(model, tsp=2, data_parallel=data_parallel, **kw)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [h[k] for h in logs] for k in ("loss", "grad_norm", "rewards/margins")}


def dp2_worker(rank, world, tmp):
    return {dp: dp_worker(rank, world, tmp, dp, 2) for dp in ("fsdp2", "zero2")}


@functools.cache
def dp_runs(workers, tmp: str) -> dict:
    return {
        "one_group": workers.run(dp_worker, 2, tmp, "ddp", 4, timeout=300)[0],
        **workers.run(dp2_worker, 4, tmp, timeout=300)[0],
    }


@pytest.mark.parametrize("data_parallel", ["fsdp2", "zero2"])
def test_dpo_with_dp2_matches_one_tsp_group(workers, tmp, data_parallel):
    """DPO at dp = 2 x tsp = 2 with FSDP2 / ZeRO-2 on the dp axis, 2 pairs per replica: the curve
    of one TSP group (DDP, dp = 1) on the same 4 pairs per step (whose step is TRL's exactly:
    test_dpo_matches_trl)."""
    ref, got = dp_runs(workers, tmp)["one_group"], dp_runs(workers, tmp)[data_parallel]
    assert len(got["loss"]) == 3 and got["rewards/margins"][-1] != 0
    for key, values in got.items():
        assert values == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


def test_dpo_recipe_trains_three_steps_and_exports(workers, tmp):
    """``recipes/dpo.py`` on 2 processes (D = 2, LoRA, offline pairs): three steps, the reward
    margin and accuracy logged, a Hugging Face checkpoint at the end."""
    import json
    import os

    from test_recipe import DATASET, run_on

    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes", "dpo.py")
    out = f"{tmp}/recipe"
    args = ["--seq-len", "256", "--completion-len", "16", "--vocab-size", "512", "--pairs", "16"]
    args += ["--max-steps", "3", "--eval-every", "3", "--warmup-steps", "1", "--tsp-size", "2"]
    args += ["--lora-r", "4", "--dataset", DATASET, "--output-dir", out]
    done = run_on(workers, *args, script=script)
    assert done.returncode == 0, done.stdout[-3000:]
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["rewards/accuracies"] <= 1.0 for r in rows)
    assert rows[-1]["rewards/margins"] != 0.0  # the adapter moved away from the reference
    assert "margin" in done.stdout and "accuracy" in done.stdout
    assert os.path.isfile(f"{out}/final/config.json")  # merged
    assert os.path.isfile(f"{out}/final-adapter/adapter_config.json")


def test_dpo_recipe_trains_on_a_local_preference_file(workers, tmp):
    """``recipes/dpo.py --dataset json:<file>`` of ``prompt`` / ``chosen`` / ``rejected`` rows
    (lines of a play, the next line chosen, a line from elsewhere rejected) on 2 processes:
    trains on those pairs (not on pairs built from text) and exports."""
    import json
    import os

    from test_recipe import PLAYS, run_on

    with open(sorted(glob.glob(f"{PLAYS}/roman/*.md"))[0], encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if len(line) > 20][:40]
    data = f"{tmp}/prefs.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            row = {"prompt": lines[i], "chosen": lines[i + 1], "rejected": lines[39 - i]}
            f.write(json.dumps(row) + "\n")
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes", "dpo.py")
    out = f"{tmp}/local-prefs"
    args = ["--seq-len", "64", "--vocab-size", "512", "--max-steps", "2", "--eval-every", "2"]
    args += ["--warmup-steps", "1", "--tsp-size", "2", "--lora-r", "4"]
    done = run_on(workers, *args, "--dataset", f"json:{data}", "--output-dir", out, script=script)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "14 preference pairs" in done.stdout  # 16 rows, 2 held out
    with open(f"{out}/metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert os.path.isfile(f"{out}/final/config.json")
