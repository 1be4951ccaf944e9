"""Small helpers the optimizations share: a warning said once per process, and "is this an estimate for CUDA?"."""

from __future__ import annotations

import warnings

from ..memory.placement import planned_device

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """``warnings.warn(message)`` the first time this message is said in the process (attributed to the caller's
    caller: the user code that applied the optimization)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def planned_cuda() -> bool:
    """True inside an estimate for ``"cuda"``, where the fake CPU tensors stand for device ones
    (:func:`memkit.memory.placement.planned_device`)."""
    return planned_device() == "cuda"
