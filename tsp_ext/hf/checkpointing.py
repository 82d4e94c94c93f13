"""Decoder-layer checkpointing of a TSP model: backward keeps only each layer's input
``[B, S/D, h]`` and re-runs the layer's forward (its weight broadcasts, K/V gathers and ring
included) before the layer's backward (``TSPConfig(checkpoint_layers=True)``); with
``offload_checkpoints=True`` those inputs wait for backward in host memory (``HostStore``),
the first ``checkpoint_device_bytes`` of them on the device (device-then-host tiers); with
``checkpoint_every=k`` only every k-th layer's input is kept and backward recomputes the k layers
from it (``Interval``): stored bytes ÷ k, k - 1 more layer inputs on the device while an interval's
backward runs, and its first k - 1 layers' forwards run once more."""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .families import family_of


class _Kept:
    """One saved tensor the store keeps on the device (within its device budget), counted."""

    def __init__(self, t: torch.Tensor, store: HostStore) -> None:
        self.tensor = t
        self.nbytes = t.numel() * t.element_size()
        store.device_held += self.nbytes
        store.device_peak = max(store.device_peak, store.device_held)
        weakref.finalize(self, store.release_device, self.nbytes)

    def load(self) -> torch.Tensor:
        return self.tensor


class _Offloaded:
    """One saved tensor in host memory: a pinned tensor (CUDA) or a RAM-backed file (CPU); a
    tensor without data (meta, or a fake tensor: memory emulation) is only counted."""

    def __init__(self, t: torch.Tensor, store: HostStore) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.has_data = t.untyped_storage().device.type != "meta"
        try:
            if self.has_data and t.device.type == "cuda":
                self.host, self.copied = store.copy_to_host(t)
            elif self.has_data:
                self.file = tempfile.TemporaryFile(dir=store.cpu_dir)
                self.file.write(_bytes_view(t.detach().contiguous()).numpy())
        except (OSError, RuntimeError) as e:  # no space left / pinned allocation failed
            raise MemoryError(
                f"offload_checkpoints: host memory ran out at {store.held + self.nbytes:,} bytes "
                f"of offloaded layer inputs ({e}); give the job more host memory (pinned on "
                "CUDA; /dev/shm on CPU), keep fewer inputs (checkpoint_every=k), shorten the "
                "sequence, or set offload_checkpoints=False"
            ) from e
        store.held += self.nbytes
        store.peak = max(store.peak, store.held)
        weakref.finalize(self, store.release, self.nbytes, getattr(self, "file", None))

    def load(self) -> torch.Tensor:
        if not self.has_data:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            return self.host.to(self.device, non_blocking=True)
        out = torch.empty(self.shape, dtype=self.dtype)
        self.file.seek(0)
        self.file.readinto(_bytes_view(out).numpy())
        return out


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class HostStore:
    """Host memory for the layer inputs a checkpointed model keeps for backward, after the first
    ``device_budget`` bytes of them, which stay on the device (device-then-host tiers: a device
    with room left keeps what it can and the host takes the rest).

    On CUDA each input is copied into a pinned host tensor on a side stream that waits for the
    input's producer, so the copy overlaps the next layer's forward; backward copies it back
    (non-blocking) when the layer is recomputed. On CPU the "device" is host memory already: the
    input is written to a RAM-backed file (``/dev/shm`` where there is one), which keeps it out
    of the process's resident set as a GPU's host memory is outside its device memory — so peak
    RSS measurements on CPU see what a device would. ``held`` / ``peak``: bytes in host memory
    now / at most since ``reset_peak``; ``device_held`` / ``device_peak``: the same of the
    tensors kept on the device.
    """

    def __init__(self, device_budget: int = 0) -> None:
        self.device_budget = device_budget
        self.held = self.peak = 0
        self.device_held = self.device_peak = 0
        self.cpu_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def reset_peak(self) -> None:
        self.peak = self.held
        self.device_peak = self.device_held

    def release_device(self, nbytes: int) -> None:
        """Forget ``nbytes`` kept on the device that backward no longer needs."""
        self.device_held -= nbytes

    def _pack(self, t: torch.Tensor):
        """Where a saved tensor waits for backward: on the device while the budget lasts, else in
        host memory (an empty tensor as it is)."""
        if not t.numel():
            return t
        nbytes = t.numel() * t.element_size()
        if self.device_held + nbytes <= self.device_budget:
            return _Kept(t, self)
        if 0 < self.device_budget < nbytes:
            raise ValueError(
                f"checkpoint_device_bytes={self.device_budget:,} cannot hold one saved layer input "
                f"of {nbytes:,} bytes: raise it to at least {nbytes:,}, or set it to 0 (every "
                "input in host memory)"
            )
        return _Offloaded(t, self)

    def release(self, nbytes: int, file=None) -> None:
        """Forget ``nbytes`` of a tensor backward no longer needs (and close its file)."""
        self.held -= nbytes
        if file is not None:
            file.close()

    def copy_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned copy of CUDA tensor ``t``, made on a side stream, and the event it ends at."""
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        t.record_stream(stream)  # t's memory is not reused before the copy has read it
        return host, copied

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks that put every tensor saved inside them into this store."""
        return torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda h: h.load() if isinstance(h, _Kept | _Offloaded) else h
        )


def checkpoint_layer(store: HostStore | None) -> Callable[..., Any]:
    """The function a decoder layer checkpoints its forward with: non-reentrant
    ``torch.utils.checkpoint``; the input it saves goes to ``store`` when one is given."""

    def run(function: Callable[..., Any], *args: Any) -> Any:
        with store.hooks() if store is not None else nullcontext():
            return checkpoint(function, *args, use_reentrant=False)

    return run


class Interval:
    """``size`` consecutive decoder layers checkpointed as one: the first keeps its input, the
    ones before the last return their input unchanged and record their call, and the last runs
    every recorded call from that input under one checkpoint — backward recomputes the interval's
    layers from the one input, each but the last under a checkpoint of its own, so that the
    recompute keeps only their inputs (the Hugging Face loop calls the layers in order, so each
    layer's own arguments, e.g. its layer type's rotary table, are the ones recorded)."""

    def __init__(self, store: HostStore | None) -> None:
        self.store = store
        self.calls: list[tuple[Callable[..., Any], tuple]] = []
        self.first: torch.Tensor | None = None  # the interval's input, until its last layer

    def member(self, last: bool) -> Callable[..., Any]:
        """The checkpointing function of one layer of the interval (``last``: its last)."""

        def run(function: Callable[..., Any], x: torch.Tensor, *args: Any) -> Any:
            if not self.calls:
                self.first = x
            self.calls.append((function, args))
            if not last:
                return x
            calls, self.calls, x, self.first = self.calls, [], self.first, None

            def layers(h: torch.Tensor) -> torch.Tensor:
                # each layer but the last checkpointed inside the interval's checkpoint: its
                # recompute keeps their inputs only, and each one's saved tensors exist while
                # its own backward runs (one layer's at a time, not the interval's)
                for fn, rest in calls[:-1]:
                    h = checkpoint(fn, h, *rest, use_reentrant=False)
                fn, rest = calls[-1]
                return fn(h, *rest)

            return checkpoint_layer(self.store)(layers, x)

        return run


def enable_layer_checkpointing(
    model: nn.Module, offload: bool, device_budget: int = 0, every: int = 1
) -> HostStore | None:
    """Checkpoint the decoder layers of ``model`` (Hugging Face ``GradientCheckpointingLayer``s)
    in training, every layer or (``every`` = k > 1) intervals of k layers; returns the host store
    of the offloaded inputs (None without offload), which keeps the first ``device_budget``
    bytes of them on the device."""
    store = HostStore(device_budget) if offload else None
    layers = family_of(model).layers_of(model)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = True
        if every == 1:
            layer._gradient_checkpointing_func = checkpoint_layer(store)
            continue
        if i % every == 0:
            interval = Interval(store)
        last = i % every == every - 1 or i == len(layers) - 1
        layer._gradient_checkpointing_func = interval.member(last)
    return store
