"""The one rank that writes a checkpoint's shared files, and how its failure reaches every rank."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import torch.distributed as dist

WRITER = 0  # the global rank that writes the files


def raise_everywhere(error: BaseException | None, what: str, *, src: int = WRITER) -> None:
    """Raise global rank ``src``'s ``error`` (the writer's by default) on every rank
    (collective): the error itself on ``src``, a ``RuntimeError`` naming ``what`` elsewhere;
    nothing when it is None."""
    failed = [error is not None]
    dist.broadcast_object_list(failed, src=src)
    if error is not None:
        raise error
    if failed[0]:
        raise RuntimeError(f"{what} failed on rank {src}; see its error")


def on_writer(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on the writer rank; its failure is raised on every rank (collective)."""
    error = None
    if dist.get_rank() == WRITER:
        try:
            fn()
        except BaseException as e:
            error = e
    raise_everywhere(error, what)


def replace_dir(new: str, path: str) -> None:
    """Move ``new`` to ``path``; an existing ``path`` is kept until the new one is in place."""
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
    os.rename(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
