"""The single-process reference for data-parallel tests: the same global batches, one model."""

from __future__ import annotations

import torch
from models import batch, causal_lm_loss

STEPS, SEQ, LR, CLIP = 3, 20, 1e-2, 0.5
# Adam's first updates are lr·g/(|g| + eps): entries with |g| near eps turn float32 summation-order
# noise (TSP and ZeRO add partial gradients in another order) into visible parameter differences.
# eps=1e-6 keeps that amplification below the tolerance without changing what is tested.
EPS = 1e-6


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


def replica_batches(dp: int, step: int, vocab: int):
    """The global batch of step ``step``: 2·dp sequences, two per data-parallel replica."""
    data = batch(vocab, 2 * dp, SEQ, seed=100 + step)
    return [{k: v[2 * r : 2 * r + 2] for k, v in data.items()} for r in range(dp)]


def reference(model, dp: int):
    """The unmodified model trained on the same global batches: losses, norms, parameters."""
    opt = adamw(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        per_replica = [
            causal_lm_loss(model, b) for b in replica_batches(dp, step, model.config.vocab_size)
        ]
        opt.zero_grad()
        (sum(per_replica) / dp).backward()  # DP averages the replicas' gradients
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append([loss.item() for loss in per_replica])
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def param_errors(full: dict, ref_params: dict) -> tuple[float, float]:
    """(max over tensors of max-abs error / max-abs value, relative L2 distance of all)."""
    diff = {n: full[n].double() - p.double() for n, p in ref_params.items()}
    max_rel = max((d.abs().max() / ref_params[n].abs().max()).item() for n, d in diff.items())
    l2 = sum(d.pow(2).sum() for d in diff.values())
    l2_ref = sum(p.double().pow(2).sum() for p in ref_params.values())
    return max_rel, (l2 / l2_ref).sqrt().item()
