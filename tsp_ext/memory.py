"""Measure what autograd keeps: bytes of the tensors saved for backward."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .storage import local_tensor


class SavedTensorBytes:
    """Context manager recording every tensor autograd saves for backward inside it.

    ``nbytes`` counts each underlying storage once (views and re-saves of one buffer are not
    double counted; a tensor subclass such as DTensor by the plain tensors inside it);
    ``shapes`` lists the saved tensors' shapes in order. Example::

        with SavedTensorBytes() as saved:
            loss = model(**batch).loss
        print(saved.nbytes)
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        """``ignore``: tensors (e.g. ``model.parameters()``) whose storage is not counted."""
        self._ignore = {local_tensor(t).untyped_storage().data_ptr() for t in ignore}
        self.storages: dict[int, int] = {}
        self.shapes: list[tuple[int, ...]] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if is_traceable_wrapper_subclass(t):  # DTensor, AsyncCollectiveTensor: no own storage
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._pack(inner)
            return t
        st = t.untyped_storage()
        if st.data_ptr() in self._ignore:
            return t
        self.storages[st.data_ptr()] = st.nbytes()
        self.shapes.append(tuple(t.shape))
        return t

    def __enter__(self) -> SavedTensorBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


class PeakAllocated:
    """Context manager measuring the peak of tensor bytes allocated inside it, above the level at
    entry: on CUDA from the caching allocator's statistics, on CPU from the allocation events
    of the PyTorch profiler (``profile_memory=True``). Example::

        with PeakAllocated() as peak:
            loss = model(**batch).loss
            loss.backward()
        print(peak.nbytes)
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.nbytes = 0

    def __enter__(self) -> PeakAllocated:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            self._prof = torch.profiler.profile(activities=activities, profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.nbytes = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        level = peak = 0
        for _, delta in deltas:
            level += delta
            peak = max(peak, level)
        self.nbytes = peak
