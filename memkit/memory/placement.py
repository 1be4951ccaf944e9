"""Where an estimate's bytes live when they are not on the device it plans for: host memory or disk.

An estimate runs on fake CPU tensors that stand for the planned device's (``"cuda"``): an optimization that
keeps state in host memory (an offloaded EMA's shadows, CPU-offloaded weights, FSDP's CPU-offloaded shards) or
on disk (``Offload(to="disk")``'s files) notes it here, and the estimate reports it apart from the device's
timeline (``timeline.meta["host_bytes"]``, ``["disk_bytes"]``). The plan is an :class:`EstimatePlan` object
that :func:`planning` makes current for the estimate's duration (a context variable, so nothing leaks between
threads or into real runs); outside an estimate every function here answers "no plan" and notes nothing.

This module imports nothing beyond torch and the tracker: an optimization reads the plan directly, whatever
else has been imported.

Example:
    >>> from memkit.memory.placement import planned_device, note_host_memory
    >>> if planned_device() == "cuda":
    ...     note_host_memory("ema", shadows)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "EstimatePlan",
    "current_plan",
    "note_disk_memory",
    "note_host_memory",
    "noted_in_host",
    "planned_device",
    "planning",
]


@dataclass
class EstimatePlan:
    """What a running estimate plans for, and what its optimizations noted off the device.

    Example:
        >>> with planning("cuda") as plan:
        ...     note_host_memory("ema", shadows)
        >>> plan.host["ema"]
    """

    device: str
    """The device the estimate plans for: ``"cpu"`` or ``"cuda"``."""
    host: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Category -> tensors kept in host memory (only in a plan for ``"cuda"``: on the CPU, host is the device)."""
    disk: list[int] = field(default_factory=list)
    """Bytes kept on disk, one entry per note."""


_PLAN: contextvars.ContextVar[EstimatePlan | None] = contextvars.ContextVar("memkit_estimate_plan", default=None)


def current_plan() -> EstimatePlan | None:
    """The running estimate's plan, None outside one.

    Example:
        >>> current_plan() is None   # outside memkit.estimate
        True
    """
    return _PLAN.get()


@contextlib.contextmanager
def planning(device: str) -> Iterator[EstimatePlan]:
    """Make a fresh :class:`EstimatePlan` for ``device`` current inside the block (``memkit.estimate`` does).

    Example:
        >>> with planning("cuda") as plan:
        ...     planned_device()
        'cuda'
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    plan = EstimatePlan(device)
    token = _PLAN.set(plan)
    try:
        yield plan
    finally:
        _PLAN.reset(token)


def planned_device() -> str | None:
    """The device the running estimate plans for (``"cpu"`` or ``"cuda"``), None outside one.

    Its fake parameters are CPU tensors standing for that device's: an optimization that keeps state in host
    memory reads this to know whether that state is off the accelerator.

    Example:
        >>> host = mode != "device" and (param.device.type != "cpu" or planned_device() == "cuda")
    """
    plan = _PLAN.get()
    return plan.device if plan is not None else None


def note_host_memory(category: str, tensors: Iterable[torch.Tensor]) -> None:
    """Inside an estimate for ``"cuda"``: ``tensors`` (owned by an optimization) live in host memory, so they
    are left out of the device timeline and counted in ``timeline.meta["host_bytes"][category]``. Elsewhere:
    nothing (real tensors are tracked on their own device).

    Example:
        >>> note_host_memory("ema", shadows)
    """
    plan = _PLAN.get()
    if plan is not None and plan.device == "cuda":
        plan.host.setdefault(category, []).extend(tensors)


def noted_in_host(tensors: Iterable[torch.Tensor]) -> bool:
    """Inside an estimate for ``"cuda"``: True if every tensor's storage (a DTensor's: its local shard's) was
    noted in host memory, e.g. parameters ``FSDP(cpu_offload=True)`` keeps on the CPU, which are CPU tensors on
    a GPU machine too. Elsewhere: False.

    Example:
        >>> if noted_in_host(params): ...   # an EMA of them lives beside them, in host memory
    """
    from .tracker import _plain

    plan = _PLAN.get()
    if plan is None or plan.device != "cuda":
        return False
    noted = {inner.untyped_storage()._cdata for ts in plan.host.values() for t in ts for inner in _plain(t)}
    inner = [x for t in tensors for x in _plain(t)]
    return bool(inner) and all(x.untyped_storage()._cdata in noted for x in inner)


def note_disk_memory(nbytes: int) -> None:
    """Inside an estimate: an optimization keeps ``nbytes`` on disk (``memkit.Offload(to="disk")``'s files),
    reported in ``timeline.meta["disk_bytes"]``. Elsewhere: nothing.

    Example:
        >>> note_disk_memory(sum(p.numel() * p.element_size() for p in offloaded))
    """
    plan = _PLAN.get()
    if plan is not None:
        plan.disk.append(int(nbytes))
