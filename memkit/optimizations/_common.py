"""Small helpers the optimizations share: a warning said once per process, and "is this an estimate for CUDA?"."""

from __future__ import annotations

import sys
import warnings

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """``warnings.warn(message)`` the first time this message is said in the process (attributed to the caller's
    caller: the user code that applied the optimization)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def planned_cuda() -> bool:
    """True inside an estimate for ``"cuda"``, where the fake CPU tensors stand for device ones
    (``memkit.estimation.planned_device``; read through ``sys.modules``: importing memkit.estimation here would pull
    in diffusers)."""
    estimation = sys.modules.get("memkit.estimation")
    return estimation is not None and estimation.planned_device() == "cuda"
