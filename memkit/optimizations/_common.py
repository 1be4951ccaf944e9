"""Small helpers the optimizations share: a warning said once per process, "is this an estimate for CUDA?", and
who is told when a quantization has replaced a weight."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

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


_REPLACED: list[Callable[[list], None]] = []


def weights_replaced(old: list) -> None:
    """A quantization has made the new storage of these weights (``old``: the tensors it replaced, which memkit's
    handle keeps to put back): tell whoever listens (:func:`on_weights_replaced`)."""
    for listener in list(_REPLACED):
        listener(old)


@contextlib.contextmanager
def on_weights_replaced(listener: Callable[[list], None]) -> Iterator[None]:
    """Call ``listener(old_tensors)`` each time a quantization replaces weights inside the block (the load phase
    of :func:`memkit.estimate_job` counts each original freed there, as a script keeping no reference frees it)."""
    _REPLACED.append(listener)
    try:
        yield
    finally:
        _REPLACED.remove(listener)
