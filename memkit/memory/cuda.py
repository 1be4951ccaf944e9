"""Recording the CUDA caching allocator's history, behind one check that explains itself elsewhere.

``torch.cuda.memory._record_memory_history`` and ``_snapshot`` are private and exist only on CUDA builds; on a
CPU machine every function here raises :class:`CudaHistoryError` with the reason, never torch's
AttributeError. :func:`memkit.track` uses them on CUDA to add reserved memory and segments to its Timeline.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch_compat as _compat
from .snapshot import read_snapshot
from .timeline import Timeline

__all__ = ["CudaHistory", "CudaHistoryError", "cuda_history_available", "cuda_snapshot", "record_cuda_history"]


class CudaHistoryError(RuntimeError):
    """CUDA allocator history cannot be recorded here (no GPU, a CPU build of torch, or an old torch).

    Example:
        >>> try: memkit.memory.record_cuda_history()
        ... except memkit.memory.CudaHistoryError as e: print(e)   # says why, e.g. a CPU-only build
    """


class CudaHistory:
    """Stops the recording that :func:`record_cuda_history` started: ``remove()`` (idempotent), or use it as a
    context manager. (The measurement layer keeps its own small handle rather than the optimizations' one.)

    Example:
        >>> with memkit.memory.record_cuda_history() as history:
        ...     memkit.train_step(model, inputs)
    """

    def __init__(self) -> None:
        self.active = True

    def remove(self) -> None:
        """Stop recording (a second call does nothing)."""
        if self.active:
            self.active = False
            _compat.record_memory_history(enabled=None)

    def __enter__(self) -> CudaHistory:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CudaHistory(active={self.active})"


def _cuda_history_problem() -> str | None:
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        return f"CUDA allocator history needs a CUDA device; this torch {torch.__version__} has {build}"
    missing = _compat.cuda_history_missing()
    if missing == "torch._C._cuda_record_memory_history":
        return f"this torch {torch.__version__} was built without the CUDA allocator's history"
    if missing is not None:
        return f"this torch {torch.__version__} has no {missing}"
    return None


def cuda_history_available() -> bool:
    """True when :func:`record_cuda_history` can run here (a CUDA device and torch's private history API).

    Example:
        >>> if memkit.memory.cuda_history_available():
        ...     handle = memkit.memory.record_cuda_history()
    """
    return _cuda_history_problem() is None


def record_cuda_history(max_entries: int = 100_000, *, stacks: str = "python") -> CudaHistory:
    """Start recording the CUDA caching allocator's history (every alloc and free, with Python stacks).

    Costs a few µs per allocation and several KB per kept entry; only the last ``max_entries`` are kept. The
    returned handle stops recording. Raises :class:`CudaHistoryError` with the reason where it can't run
    (no GPU, CPU build); :func:`memkit.track` measures exact storages on any device instead.

    Example:
        >>> with record_cuda_history(max_entries=200_000):
        ...     memkit.train_step(model, inputs); tl = cuda_snapshot()
        >>> tl.peak_bytes
    """
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
        raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
    if stacks not in ("python", "all"):
        raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
    problem = _cuda_history_problem()
    if problem:
        raise CudaHistoryError(f"{problem}. Use memkit.track(), which measures exact storages on any device.")
    _compat.record_memory_history(enabled="all", context="all", stacks=stacks, max_entries=max_entries)
    return CudaHistory()


def cuda_snapshot(**read_kwargs: Any) -> Timeline:
    """The CUDA allocator's current snapshot (``torch.cuda.memory._snapshot()``) as a Timeline.

    Takes :func:`read_snapshot`'s keyword arguments. Raises :class:`CudaHistoryError` where CUDA is missing.

    Example:
        >>> handle = record_cuda_history()
        >>> memkit.train_step(model, inputs)
        >>> tl = cuda_snapshot(); handle.remove()
    """
    problem = _cuda_history_problem()
    if problem:
        raise CudaHistoryError(f"{problem}. Use memkit.track(), which measures exact storages on any device.")
    return read_snapshot(_compat.memory_snapshot(), **read_kwargs)
