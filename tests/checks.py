"""Helpers the tests use to compare tensors, capture error messages and read the docs' tables."""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of the reference ``b``."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def error_message(fn) -> str:
    """The message of the ``ValueError`` that ``fn()`` raises (for error tests inside workers)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "<no error>"


def table(doc: str, header: str) -> list[list[str]]:
    """The cells of the markdown table in ``doc`` whose header row starts with ``header``."""
    lines = (ROOT / doc).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def gemma_norm_tol(family: str, name: str, tol: float) -> float:
    """Gemma's RMSNorm computes ``x̂ · (1 + w)`` in float32 whatever the model's dtype, so Hugging
    Face sums its weight gradient in float32: ours (a float32 sum too, over other partial sums
    at D > 1) agrees to float32 rounding, not to float64's."""
    gemma = family.startswith("gemma")
    return max(tol, 1e-5) if gemma and name.endswith("norm.weight") else tol


def hf_mask(pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The additive ``[B, 1, S, S]`` mask of causal (windowed) attention within the documents of
    the per-document positions ``pos [B, S]``."""
    S = pos.shape[1]
    i, j = torch.arange(S)[:, None], torch.arange(S)
    doc = (pos == 0).cumsum(-1)
    hidden = (j > i) | (doc[:, :, None] != doc[:, None, :])
    if window is not None:
        hidden = hidden | (j <= i - window)
    return torch.zeros(hidden.shape, dtype=torch.float64).masked_fill(hidden, -torch.inf)[:, None]


def doc_positions(docs: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Per-document positions ``[B, S]`` of rows packed with documents of lengths ``docs[b]``."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])


def trained_errors(model, ref, mesh, input_ids, got, ref_out, ref_loss) -> dict:
    """Errors of a TSP model against its reference after one training step on ``input_ids``
    (``got`` / ``ref_out``: their outputs, logits included; both losses backpropagated): loss,
    logits, every gradient, then the eval-mode logits of the same ids."""
    from tsp_ext import full_grads, gather_sequence, shard_batch

    S = input_ids.shape[1]
    errs = {
        "loss": rel_err(got.loss.detach(), ref_loss.detach()),
        "logits": rel_err(gather_sequence(got.logits.detach(), mesh, seq_len=S), ref_out.logits),
    }
    grads = full_grads(model)
    for name, p in ref.named_parameters():
        errs[name] = rel_err(grads[name], p.grad)
    model.eval()
    with torch.no_grad():
        ids = {"input_ids": input_ids}
        logits = gather_sequence(model(**shard_batch(ids, mesh)).logits, mesh, seq_len=S)
        errs["eval_logits"] = rel_err(logits, ref.eval()(**ids).logits)
    return errs
