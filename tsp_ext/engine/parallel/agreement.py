"""Checks that every rank of a group passes or fails together.

A check of one rank's tokens (id ranges, labels, position ids) can fail on that rank alone. If
that rank raised on its own, its peers would wait in the step's first collective until the
process-group timeout, and a caller that caught the error would start its next step out of step
with them. ``agree`` runs before the first collective: one all-gather of a small fixed-size record
per rank (an error flag and a few integers the caller compares, e.g. shapes), and, only when some
rank failed, a second one of the first failing rank's message, so that every rank raises the same
``ValueError``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm

MESSAGE_BYTES = 1024  # longer messages are cut (UTF-8 bytes)


def checksum(t: torch.Tensor) -> int:
    """An order-sensitive integer checksum of an integer tensor: a fact that tells two ranks'
    batches apart."""
    flat = t.reshape(-1).long()
    weights = torch.arange(flat.numel(), device=flat.device) % 1009 + 1
    return int((flat * weights).sum())


def agree(error: str | None, facts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``facts`` as ``[D, len(facts)]`` int64 (CPU), once no rank has an error.

    Args:
        error: why this rank's input is invalid, or None.
        facts: integers to compare across ranks (same count on every rank).
        group: the ranks that must agree.

    Raises:
        ValueError: on every rank of ``group`` alike when any rank passed an ``error``:
            ``"TSP rank r of D: <error>"`` for the lowest such rank r.
    """
    D, _ = comm.size_and_rank(group)
    device = comm.group_device(group)
    mine = torch.tensor([error is not None, *facts], dtype=torch.int64, device=device)
    table = comm.all_gather_seq(mine, group)[0].cpu()
    failed = table[:, 0].nonzero().flatten().tolist()
    if not failed:
        return table[:, 1:]
    text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    raw = (error or "").encode()[:MESSAGE_BYTES]
    text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else text[:0]
    texts = comm.all_gather_seq(text.to(device), group)[0].cpu()
    r = failed[0]
    message = bytes(texts[r].tolist()).rstrip(b"\0").decode(errors="replace")
    raise ValueError(f"TSP rank {r} of {D}: {message}")
