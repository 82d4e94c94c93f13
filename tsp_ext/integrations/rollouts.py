"""Rollouts shared by a TSP group: checks that its ranks hold the same ones, rewards run once.

The D ranks of a TSP group train on the same rows, so they must generate, reward and score the
same prompts and completions. These helpers keep that true, and say clearly when it is not
(on every rank at once, before a collective could hang on mismatched shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..engine.parallel import comm
from ..engine.parallel.agreement import agree
from .scoring import tsp_base


def check_same_ids(rows: Sequence[Sequence[int]], what: str, group: dist.ProcessGroup) -> None:
    """Raise on every rank of ``group`` unless all hold the same token-id rows (one all-gather
    of a checksum: row count, token count, a position-weighted sum)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    flat = torch.cat([torch.as_tensor(r, dtype=torch.int64).flatten() for r in rows] or [lengths])
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64) % 1_000_003
    facts = [len(rows), int(lengths.sum()), int(((flat + 1) * weights).sum())]
    table = agree(None, facts, group)
    if not bool((table == table[0]).all()):
        counts = ", ".join(f"rank {r}: {int(n)} rows / {int(t)} tokens" for r, (n, t, _) in
                           enumerate(table.tolist()))  # fmt: skip
        raise ValueError(
            f"the ranks of a TSP group hold different {what}s ({counts}): they must read the "
            "same prompts (the trainer's sampler splits data over dp replicas only) and a "
            "rollout function must return the same rows on each of them"
        )


def check_within_positions(model: nn.Module, prompts: Sequence[Sequence[int]], new: int) -> None:
    """Refuse rollouts that could run past the model's positions (same prompts on every rank:
    every rank raises alike)."""
    limit = getattr(tsp_base(model).config, "max_position_embeddings", None)
    longest = max((len(p) for p in prompts), default=0)
    if limit is not None and longest + new > limit:
        raise ValueError(
            f"a prompt of {longest} tokens plus max_completion_length={new} is {longest + new} "
            f"positions, beyond the model's {limit} (max_position_embeddings): lower "
            "max_completion_length, shorten the prompts, or extend the context (RoPE scaling)"
        )


def rewards_once_per_group(
    compute: Callable[[], torch.Tensor], shape: tuple[int, int], mesh, device, module
) -> torch.Tensor:
    """The rewards ``[N·R, F]`` of the dp replicas' rows: ``compute()`` (TRL's reward pass over
    this replica's ``N`` rows, ``F`` reward functions) runs on the TSP group's first rank only
    and is broadcast to the group, then gathered over dp (``module.gather``, TRL's, which
    ``over_replicas`` points at the dp group). A reward function raising on one rank raises on
    every rank."""
    first = mesh["tsp"].get_local_rank() == 0
    local = error = cause = None
    if first:
        gather, module.gather = module.gather, lambda t: t  # this replica's rows first
        try:
            local = compute()
        except Exception as e:  # reported on every rank below, instead of a hang
            error, cause = f"a reward function raised {type(e).__name__}: {e}", e
        finally:
            module.gather = gather
    try:
        agree(error, [], dist.group.WORLD)
    except ValueError as failure:
        raise failure from cause
    if not first:
        local = torch.empty(shape, device=device)
    comm.broadcast(local, 0, mesh["tsp"].get_group())
    return module.gather(local)
