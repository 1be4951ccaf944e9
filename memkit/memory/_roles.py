"""What a :class:`~memkit.memory.tracker.Tracker` knows about storages: their roles and where they live.

``_Roles`` is the half of the tracker that gives storages their categories (registration before and during the
window, the retags when a role becomes known) and keeps host memory apart (storages made under :func:`off_device`
or :func:`host_state`, and the host state passed to ``track(host=...)``); ``tracker.py`` holds the dispatch mode
and the event log.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .events import CATEGORIES, CATEGORY_CODE, PHASE_CODE, check_category

_FORWARD, _OTHER = PHASE_CODE["forward"], PHASE_CODE["other"]
_ACTIVATION, _TEMPORARY = CATEGORY_CODE["activation"], CATEGORY_CODE["temporary"]


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own memory behind ``t``: itself, or a wrapper subclass's inner tensors (a DTensor's
    local shard); the wrapper's own storage has the global size and holds no memory."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, name) for name in names)
    return [p for x in inner if isinstance(x, torch.Tensor) for p in _plain(x)]


_OFF_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("memkit_off_device", default=False)


@contextmanager
def off_device() -> Iterator[None]:
    """Storages created inside live in host memory, not on the device the tracked step runs on: an optimization
    that moves tensors off an accelerator (offloaded checkpoints) creates their host copies inside. Active
    trackers leave them out of the timeline and count them in ``timeline.meta["host_peak_bytes"]`` (the most
    alive at once). In an estimate for ``"cuda"`` the fake CPU tensors stand for device ones, so the same holds.

    Example:
        >>> with off_device():
        ...     saved = x.to("cpu", non_blocking=True)
    """
    token = _OFF_DEVICE.set(True)
    try:
        yield
    finally:
        _OFF_DEVICE.reset(token)


_HOST_STATE: contextvars.ContextVar[bool] = contextvars.ContextVar("memkit_host_state", default=False)


@contextmanager
def host_state() -> Iterator[None]:
    """Storages created inside are state kept in host memory while the step computes on an accelerator (the
    gradient shards FSDP2's CPU offload copies to the host). Unlike :func:`off_device`'s copies they keep a
    category: active trackers leave them out of the timeline, let :meth:`Tracker.register` and :func:`tag` set
    their category, and count them in ``timeline.meta["host_state_bytes"]`` (category -> the most alive at once).
    Storages that exist already are declared with ``track(host=...)``; an optimizer whose parameters are all host
    state steps on the host, so its state and temporaries are host state too.

    Example:
        >>> with host_state():
        ...     grad = grad.to("cpu", non_blocking=True)
    """
    token = _HOST_STATE.set(True)
    try:
        yield
    finally:
        _HOST_STATE.reset(token)


class _Live:
    """What the tracker knows about one live storage."""

    __slots__ = ("event", "nbytes", "category", "phase", "ref")

    def __init__(self, event: int, nbytes: int, category: int, phase: int, ref):
        # ``ref`` is a weakref whose callback records the free; dropping it (at stop) cancels the callback.
        self.event, self.nbytes, self.category, self.phase, self.ref = event, nbytes, category, phase, ref


class _Roles:
    """Categories and host memory: the methods of :class:`~memkit.memory.tracker.Tracker` that concern roles."""

    def _on_host_now(self) -> bool:
        return _OFF_DEVICE.get() or _HOST_STATE.get() or bool(self._host_steps and self._host_steps[-1])

    def _keep(self, key: int, s: torch.UntypedStorage, n: int, category: str) -> None:
        ident = len(self._kept_category)
        self._kept_category.append(category)
        self._kept[key] = (n, weakref.ref(s, partial(self._on_kept_free, key)), ident)
        self._kept_events.append((ident, n))

    def _on_kept_free(self, key: int, _ref=None) -> None:
        entry = self._kept.pop(key, None)
        if entry is not None and not self._closed:
            self._kept_events.append((entry[2], -entry[0]))

    def _host_state_bytes(self) -> dict[str, int]:
        """Category -> the most host state of that category alive at once."""
        live: dict[str, int] = {}
        peak: dict[str, int] = {}
        for ident, n in self._kept_events:
            category = self._kept_category[ident]
            live[category] = live.get(category, 0) + n
            peak[category] = max(peak.get(category, 0), live[category])
        return {c: n for c, n in peak.items() if n}

    def _in_host(self, t: torch.Tensor) -> bool:
        return any(inner.untyped_storage()._cdata in self._kept for inner in _plain(t))

    def _on_host_free(self, key: int, _ref=None) -> None:
        entry = self._host.pop(key, None)
        if entry is not None:
            self._host_bytes -= entry[0]

    def _backward_started(self) -> None:
        for entry in self._live.values():
            if entry.phase == _FORWARD and entry.category == _TEMPORARY and entry.event >= 0:
                self._retag(entry, _ACTIVATION)

    def _retag(self, entry: _Live, code: int) -> None:
        if entry.category == code:
            return
        if entry.event >= 0:
            self.log.retags.append((entry.event, code))
        else:  # a storage from before the window: move its bytes between baseline categories
            self._baseline[CATEGORIES[entry.category]] -= entry.nbytes
            self._baseline[CATEGORIES[code]] += entry.nbytes
        entry.category = code

    def register(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Give ``tensors`` the ``category``: storages allocated inside the window are retagged, storages
        that existed before it are added to the baseline (they were live all along)."""
        code = check_category(category)
        for t in (inner for x in tensors if isinstance(x, torch.Tensor) for inner in _plain(x)):
            s = t.untyped_storage()
            key = s._cdata
            kept = self._kept.get(key)
            if kept is not None:  # host state keeps its bytes off the timeline, under the category it is given
                self._kept_category[kept[2]] = category
                continue
            if key in self._host:  # a host copy made off the device (off_device()): not on the device's timeline
                continue
            entry = self._live.get(key)
            if entry is not None:
                self._retag(entry, code)
                continue
            n = s.nbytes()
            if n == 0:  # resized to 0 (an FSDP unsharded parameter between uses): its role when it regrows
                self._resized_role[key] = code
                continue
            n = self._round(n)
            self._baseline[category] += n
            device = self._device_code(t.device)
            self.baseline_blocks.append((key, n, device))
            self._live[key] = _Live(-1, n, code, _OTHER, weakref.ref(s, partial(self._on_free, key, device)))

    def register_host(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """``tensors`` live in host memory while the step computes on the accelerator (FSDP2's CPU-offloaded
        shards in an estimate for ``"cuda"``): left out of the timeline, counted in
        ``timeline.meta["host_state_bytes"][category]``, unrounded (no device allocator). Register them before
        the objects that hold them (the model), so those find them here."""
        check_category(category)
        for t in (inner for x in tensors if isinstance(x, torch.Tensor) for inner in _plain(x)):
            s = t.untyped_storage()
            key = s._cdata
            n = s.nbytes()
            if key in self._kept:
                self.register([t], category)
            elif key not in self._live and n:
                self._keep(key, s, n, category)

    def register_module(self, module: torch.nn.Module, recurse: bool = True) -> None:
        """Register a module's parameters, buffers and existing gradients, and hook its gradients."""
        for m in module.modules() if recurse else (module,):
            if id(m) in self._seen_modules:
                continue
            self._seen_modules.add(id(m))
            params = list(m.parameters(recurse=False))
            self.register(params, "parameter")
            self.register(m.buffers(recurse=False), "buffer")
            self.register([p.grad for p in params if p.grad is not None], "gradient")
            for p in params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Register an optimizer's state tensors as optimizer state (host state for a parameter in host memory:
        an optimizer steps where its parameters are)."""
        for param, state in optimizer.state.items():
            tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
            if self._kept and isinstance(param, torch.Tensor) and self._in_host(param):
                self.register_host(tensors, "optimizer_state")
            else:
                self.register(tensors, "optimizer_state")

    def _grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.register([param.grad], "gradient")
