"""The elements each MoE schedule moves, and the per-call choice between them (no torch: the
planner reads it too)."""

from __future__ import annotations

SCHEDULES = ("ring", "all_to_all")


def traffic(n: int, k: int, E: int, F: int, h: int, D: int) -> dict[str, float]:
    """Elements one rank receives in one training step of one MoE layer under each schedule
    (``n`` tokens a rank, top-``k`` of ``E`` experts of width ``F``, uniform routing): the ring
    forwards every other rank's experts once and sends weights and weight gradients in backward;
    the all-to-all moves the rows that leave the rank twice forward (dispatch, combine) and
    three times backward (X, dY out; dX back)."""
    remote = (D - 1) / D
    return {"ring": 3 * remote * 3 * E * F * h, "all_to_all": 5 * remote * n * k * h}


def schedule_for(option: str, n: int, k: int, E: int, F: int, h: int, D: int) -> str:
    """The schedule a call runs: ``option`` unless it is ``"auto"``, then the one that moves
    fewer elements (``traffic``); the same on every rank (n is)."""
    if option != "auto":
        return option
    moved = traffic(n, k, E, F, h=h, D=D)
    return "all_to_all" if moved["all_to_all"] < moved["ring"] else "ring"
