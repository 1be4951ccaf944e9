"""The optional libraries' optimizer steps, run where memkit measures them: under the tracker (whose dispatch mode
sees an op's outputs, not what its kernel allocates inside) and under fake tensors (which have no values).

:func:`seen` gives a library class a step that, while a tracker is active, runs under :class:`_StepMode`; a plain
run is the library's own step. What each adaptation does and why is in :mod:`memkit.optimizers`' docstring.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

# bitsandbytes keeps a paged optimizer's state in managed memory from this many elements on (its
# Optimizer8bit.get_state_buffer: ``p.numel() < 1e5`` stays in device memory)
PAGED_FROM = 100_000


@functools.cache
def seen(cls: type) -> type:
    """``cls`` with a step that the tracker and fake tensors can follow (:class:`_Adapted`); an instance is still an
    instance of ``cls``.

    Example:
        >>> opt = seen(bitsandbytes.optim.AdamW8bit)(params, lr=1e-4)
    """
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_library": cls}
    return type(cls.__name__, (_Adapted, cls), names)


class _Adapted:
    """Mixed in before an optimizer class whose step fake tensors or the tracker cannot follow as it is: while a
    tracker is active its step runs under :class:`_StepMode`; a plain run is the library's step, untouched."""

    _library: type

    def step(self, closure=None):
        # torch wraps this class's step in its hook caller: call the library's step without a second one
        step = self._library.step
        step = step.__wrapped__ if getattr(step, "hooked", False) else step
        from .memory.placement import planned_device
        from .memory.tracker import _active

        planned, fake = planned_device(), _fake_mode() is not None
        if not (_active or fake or planned):  # a plain run: the library's step as it is
            return step(self, closure)
        # the mode only where it is needed: re-dispatching every op from Python has the allocator wrap a Python
        # number or two more than the library's own step would (8 bytes each, which the tracker does not see)
        kernels = bool(_active) and self._library.__module__.startswith("bitsandbytes") and planned != "cuda"
        needed = fake or kernels
        mode = _StepMode(planned) if needed else contextlib.nullcontext()
        with warnings.catch_warnings(), mode, _float32_default(planned is not None):
            # bitsandbytes warns once per optimizer that CPU tensors are not paged: memkit says so in its docs
            warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
            return step(self, closure)

    def fill_qmap(self) -> None:
        # bitsandbytes' Optimizer8bit only, at construction: its quantization maps are built from Python lists
        # (``.tolist()``), which fake tensors cannot give; built for real, they enter fake mode as its tensors. (On
        # a GPU they are built on the CPU and copied to the device at the first step: 2 KiB counted from the start.)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        mode = _fake_mode()
        if mode is None:
            return super().fill_qmap()
        with unset_fake_temporarily():
            super().fill_qmap()
        self.name2qmap = {k: mode.from_tensor(v) for k, v in self.name2qmap.items()}

    def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # bitsandbytes' Optimizer8bit only (the others never call it): a paged moment in an estimate for "cuda" is
        # managed memory, off the caching allocator
        from .memory.placement import note_host_memory, planned_device

        if not (getattr(self, "is_paged", False) and p.numel() >= PAGED_FROM and planned_device() == "cuda"):
            return super().get_state_buffer(p, dtype=dtype)
        from .memory.tracker import host_state

        with host_state():
            buffer = super().get_state_buffer(p, dtype=dtype)
        note_host_memory("optimizer_state", [buffer])  # for a tracked window that starts after this step
        return buffer


@contextlib.contextmanager
def _float32_default(on: bool) -> Iterator[None]:
    """torch's default dtype float32 inside (an estimate builds its model under the model's dtype; a training
    script's default stays float32, and CAME makes its factors with ``torch.zeros(shape).type_as(grad)``)."""
    before = torch.get_default_dtype()
    if on:
        torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


_ITEM = torch.ops.aten._local_scalar_dense.default


@functools.cache
def _python_kernels() -> dict[Any, Callable]:
    """bitsandbytes' update ops -> the Python functions its CPU backend registers for them (empty where this
    bitsandbytes has none)."""
    try:
        cpu = importlib.import_module("bitsandbytes.backends.cpu.ops")
    except ImportError:
        return {}
    ops = torch.ops.bitsandbytes
    pairs = (
        ("optimizer_update_8bit_blockwise", "_optimizer_update_8bit_blockwise_cpu"),
        ("optimizer_update_32bit", "_optimizer_update_32bit_cpu"),
    )
    return {
        getattr(ops, op).default: getattr(cpu, fn)
        for op, fn in pairs
        if hasattr(ops, op) and callable(getattr(cpu, fn, None))
    }


class _StepMode(TorchDispatchMode):
    """Pushed above the tracker for an optional library's step:

    - bitsandbytes' opaque update op on CPU tensors (a real CPU run, or an estimate for ``"cpu"``) runs as the
      Python kernel bitsandbytes registers for the CPU, whose ops reach the tracker below this mode;
    - ``.item()`` of a fake tensor (Prodigy and Adafactor read statistics as Python floats, Prodigy asks
      ``p.any()`` before it copies a parameter) answers 1 (True): values steer nothing that allocates, except
      ``p.any()``, which is True for every parameter of a trained model and of memkit's presets (``load_model``
      gives no parameter all zeros).
    """

    def __init__(self, planned: str | None):
        super().__init__()
        self.planned = planned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ITEM and _fake_without_value(args[0]):
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        if func.namespace == "bitsandbytes" and self.planned != "cuda":
            kernel = _python_kernels().get(func)
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if kernel is not None and tensor is not None and tensor.device.type == "cpu":
                return kernel(*args, **kwargs)
        return func(*args, **kwargs)


def _fake_mode():
    """The active FakeTensorMode, None outside one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, FakeTensorMode)), None)


def _fake_without_value(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and t.constant is None
