"""Contiguous, balanced splits of n items (heads, MLP rows, vocabulary rows) over D ranks.

Rank p gets ``⌊n/D⌋`` or ``⌈n/D⌉`` consecutive items: the first ``n mod D`` ranks one more. Every
rank can compute every rank's share, so no sizes are ever exchanged.
"""

from __future__ import annotations


def split_sizes(n: int, D: int) -> list[int]:
    """Items per rank, ``[D]``: ``n // D + (p < n % D)``."""
    return [n // D + (p < n % D) for p in range(D)]


def split_range(n: int, D: int, p: int) -> slice:
    """Items ``[start, stop)`` of rank ``p``."""
    base, extra = divmod(n, D)
    start = p * base + min(p, extra)
    return slice(start, start + base + (p < extra))


def split_offsets(n: int, D: int) -> list[int]:
    """First item of every rank, plus ``n`` at the end: ``[D + 1]``."""
    return [split_range(n, D, p).start for p in range(D)] + [n]


def check_split(n: int, D: int, what: str, hint: str) -> None:
    """Raise ``ValueError`` if some rank would get no ``what`` (``D > n``); ``hint`` says what
    to change."""
    if D > n:
        raise ValueError(f"{what}={n} cannot be split over tsp_size={D}: {hint}")
