"""Per-token log-probabilities of TRL's rollouts on a TSP model: what GRPO / RLOO score.

TRL's online trainers score ``[left-padded prompt | right-padded completion]`` rows through the
fused-LM-head protocol and keep the last C positions. A TSP model shards sequences with right
padding only (each sequence's tokens must start at position 0 of the zigzag layout), so each
row is first rolled left by its pad count (``[prompt | completion | padding]``), scored, and its
completion's C log-probabilities picked out at their new place. RoPE is relative: the rolled
row's log-probabilities are the left-padded row's, up to rounding.

Sampling temperature T: TRL scores ``logits / T``; a TSP model's vocab-sharded head never builds
the logits, so the final hidden state is scaled by 1/T instead (the same numbers, as the head is
linear: no bias, no soft-capping).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.sharding.layout import IGNORE_INDEX
from ..hf.lora import peft_base


def tsp_base(model: nn.Module) -> nn.Module:
    """The TSP causal LM inside ``model`` (a data-parallel wrapper's module, a PEFT base)."""
    inner = getattr(model, "module", model)
    return peft_base(inner) or inner


def check_temperature(model: nn.Module, temperature: float) -> None:
    """Refuse a sampling temperature the hidden-state scaling cannot reproduce exactly."""
    config = tsp_base(model).config
    capped = getattr(config, "final_logit_softcapping", None)
    if temperature != 1.0 and capped:
        raise ValueError(
            f"temperature={temperature} with {config.model_type}'s final logit soft-capping: TSP "
            "scores logits / T by scaling the final hidden state, which soft-capping does not "
            "commute with; use temperature=1.0"
        )


@contextlib.contextmanager
def tempered(model: nn.Module, temperature: float):
    """Within: ``model``'s logits are divided by ``temperature`` (its final norm's output is)."""
    if temperature == 1.0:
        yield
        return
    norm = getattr(tsp_base(model).model, "norm", None)
    if norm is None:
        raise ValueError(f"{type(tsp_base(model)).__name__} has no final norm to scale by 1/T")
    handle = norm.register_forward_hook(lambda module, args, out: out / temperature)
    try:
        yield
    finally:
        handle.remove()


def completion_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_len: int,
    entropy: bool = False,
    router_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log p of each completion token, ``[B, C]`` (0 where masked), from TSP ``model``.

    Args:
        input_ids, attention_mask: ``[B, S]``, the prompt left-padded and the last
            ``completion_len`` columns the completion, right-padded (TRL's rows).
        entropy: also return each of those positions' next-token entropy, ``[B, C]``.
        router_logits: also return a mixture-of-experts model's load-balancing loss.
    """
    S, C = input_ids.shape[1], completion_len
    pads = (attention_mask.cumsum(dim=1) == 0).sum(dim=1)  # left padding of each row
    source = (torch.arange(S, device=input_ids.device) + pads[:, None]) % S  # rolled left
    ids, mask = input_ids.gather(1, source), attention_mask.gather(1, source)
    length = int(mask.sum(dim=1).max())  # the trailing padding every row has is not run
    ids, mask, source = ids[:, :length], mask[:, :length], source[:, :length]
    labels = ids.masked_fill((mask == 0) | (source < S - C), IGNORE_INDEX)
    kwargs = {"output_router_logits": True} if router_logits else {}
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **kwargs)
    # the label at rolled position j + 1 is token j + 1 + pad of the row; completion token
    # S - C + c is predicted at rolled position S - C + c - 1 - pad
    at = (S - C - 1 - pads)[:, None] + torch.arange(C, device=ids.device)

    def pick(field: torch.Tensor) -> torch.Tensor:
        return F.pad(field, (0, S - 1 - field.shape[1])).gather(1, at)

    return (
        pick(out.log_probs),
        pick(out.entropy) if entropy else None,
        out.aux_loss if router_logits else None,
    )
