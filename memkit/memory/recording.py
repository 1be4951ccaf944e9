"""The tracking API: :func:`track` (a window, its Timeline) and what optimizations tell the trackers running now
(:func:`tag`, :func:`released`, :func:`phase`, :func:`tracking`, :func:`current_timeline`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .cuda import cuda_history_available, cuda_snapshot, record_cuda_history
from .events import PHASE_CODE, check_category
from .timeline import Timeline
from .tracker import Tracker, _active


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _owned_of(owned: Any) -> dict[str, list[torch.Tensor]]:
    """Category -> tensors, from a handle (anything with ``owned()``, e.g. ``memkit.Handle``) or a mapping."""
    if owned is None:
        return {}
    if hasattr(owned, "owned") and callable(owned.owned):
        owned = owned.owned()
    if not isinstance(owned, Mapping):
        raise TypeError(f"owned must be a memkit.Handle or a mapping category -> tensors, got {type(owned).__name__}")
    out = {}
    for category, tensors in owned.items():
        check_category(category)
        out[category] = _tensors_of(list(tensors) if not isinstance(tensors, torch.Tensor) else tensors)
    return out


@contextmanager
def track(
    model: torch.nn.Module | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    inputs: Any = None,
    owned: Any = None,
    host: Mapping[str, Iterable[torch.Tensor]] | None = None,
    record_stacks: bool = False,
    alloc_granularity: int | None = None,
    device: str | None = None,
    label: str | None = None,
    cuda_history: bool | None = None,
    max_entries: int = 100_000,
) -> Iterator[Timeline]:
    """Track every storage allocated and freed inside the block; yields a live :class:`Timeline`.

    Pass the objects that exist before the block (``model``, ``optimizer``, ``inputs``, and ``owned``: the
    handle of the applied optimizations, or a mapping category -> tensors, for memory they allocated in
    ``apply``, such as EMA shadows) so their memory is counted in the baseline with the right category.
    ``host`` (category -> tensors) is state that lives in host memory while the step computes on an accelerator
    (see :func:`host_state`): out of the timeline, in ``timeline.meta["host_state_bytes"]``.
    Modules that run inside the block are discovered by their forward hooks and optimizers by their step
    hooks, so a bare ``track()`` still categorizes parameters and optimizer state, but storages it never
    sees (inputs not passed, tensors that are never touched) are not counted.

    Costs ~10–20 µs per op in Python, whatever the tensor sizes: noticeable on a tiny model, lost in the
    noise on a real one (see ``bench/RESULTS.md``). ``record_stacks=True`` also interns the Python stack of
    each allocation (much slower). ``alloc_granularity=512`` rounds sizes like the CUDA caching allocator.
    Nested ``track()`` blocks are supported: each sees every op of its own window.

    On CUDA (``cuda_history=None`` means: when a CUDA device is available), the caching allocator's history
    is recorded too (the last ``max_entries`` actions, with Python stacks); after the block
    ``timeline.meta["cuda"]`` is that snapshot as its own Timeline (``reserved_bytes`` in its meta: the
    allocator's segments, which include fragmentation). ``cuda_history=True`` on a machine without CUDA
    raises :class:`~memkit.memory.cuda.CudaHistoryError` saying why.

    Example:
        >>> with memkit.track(model, inputs=inputs) as tl:
        ...     memkit.train_step(model, inputs)
        >>> print(tl.peak_bytes, tl.peak_by_category())
    """
    if alloc_granularity is not None and (not isinstance(alloc_granularity, int) or alloc_granularity < 1):
        raise ValueError(f"alloc_granularity must be a positive int or None, got {alloc_granularity!r}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    tracker = Tracker(record_stacks=record_stacks, alloc_granularity=alloc_granularity, device=device, label=label)
    history = None
    try:  # whatever fails below, stop() removes every hook already placed on the model
        for category, tensors in (host or {}).items():  # first: the model's and optimizer's may be among them
            tracker.register_host(_tensors_of(list(tensors)), category)
        if model is not None:
            tracker.register_module(model)
        if optimizer is not None:
            tracker.register_optimizer(optimizer)
        tracker.register(_tensors_of(inputs), "input")
        for category, tensors in _owned_of(owned).items():
            tracker.register(tensors, category)
        history = _start_cuda_history(cuda_history, max_entries)
        tracker.start()
        yield tracker.timeline
    finally:
        tracker.stop()
        if history is not None:
            try:
                tracker.timeline.meta["cuda"] = cuda_snapshot()
            finally:
                history.remove()


def _start_cuda_history(wanted: bool | None, max_entries: int):
    if wanted is False:
        return None
    if wanted is None and not cuda_history_available():
        return None
    return record_cuda_history(max_entries)


def tag(tensors: Iterable[torch.Tensor] | torch.Tensor, category: str, *, made: str | None = None) -> None:
    """Tell every active tracker that ``tensors`` belong to ``category`` (no-op when none is active).

    Optimizations call this for the memory they own (EMA shadows, offloaded weights). A storage a tracker has not
    seen counts as live since before the window, unless ``made`` says it was made just now outside torch's
    dispatch, where trackers see allocations (``made`` names how, for the timeline's op column: a file mapped into
    memory): then it is an allocation now, freed when the storage is.

    Example:
        >>> memkit.memory.tag(shadow_params, "ema")
        >>> mapped = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
        >>> memkit.memory.tag(mapped, "parameter", made="mmap")
    """
    check_category(category)
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for tracker in list(_active):
        if made is not None:
            for t in tensors:
                tracker._outside_dispatch(t, made)
        tracker.register(tensors, category)


def released(tensors: Iterable[torch.Tensor] | torch.Tensor) -> None:
    """Tell every active tracker that the memory of ``tensors`` was given back now although their storages live on
    (no-op when none is active): the pages of a file mapping dropped with ``madvise(MADV_DONTNEED)``, which the
    next touch maps again. Each is a free now; :func:`tag` with ``made`` records it allocated again.

    Example:
        >>> mapping.madvise(mmap.MADV_DONTNEED)
        >>> memkit.memory.released(mapped)
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for tracker in list(_active):
        for t in tensors:
            tracker._released(t)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the allocations inside the block with phase ``name`` in every active tracker.

    Example:
        >>> with memkit.memory.phase("ema"):
        ...     ema.update(model)
    """
    if name not in PHASE_CODE:
        raise ValueError(f"phase must be one of {list(PHASE_CODE)}, got {name!r}")
    trackers = list(_active)
    for t in trackers:
        t._explicit.append(PHASE_CODE[name])
    try:
        yield
    finally:
        for t in trackers:
            t._explicit.pop()


def tracking() -> bool:
    """True while a :func:`track` block is active.

    Example:
        >>> with memkit.track():
        ...     assert memkit.memory.tracking()
    """
    return bool(_active)


def current_timeline() -> Timeline | None:
    """The Timeline of the innermost :func:`track` block running now, or None outside one.

    It is live: it grows while the block runs (each read is a snapshot of the events so far), so a progress view
    can follow a step that ``compare`` or ``estimate`` tracks inside without changing them.

    Example:
        >>> with memkit.track():
        ...     live = memkit.memory.current_timeline()
        ...     y = torch.ones(1000)
        >>> live.peak_bytes
    """
    return _active[-1].timeline if _active else None
