"""The optional libraries' optimizer steps, run where memkit measures them: under the tracker (whose dispatch mode
sees an op's outputs, not what its kernel allocates inside) and under fake tensors (which have no values).

:func:`seen` gives a library class a step that, while a tracker is active, runs under :class:`_StepMode`; a plain
run is the library's own step. What each adaptation does and why is in :mod:`memkit.optimizers`' docstring.

:func:`cpu_offload` builds torchao's ``CPUOffloadOptimizer`` (``Step(optimizer_on="cpu")``) and runs its code on CPU
tensors through :func:`without_cuda`, a stand-in for the CUDA streams, events and pinned memory it asks for, in place
only while torchao's own code runs.
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
        from .memory.tracker import _active

        planned, fake = _planned(self), _fake_mode() is not None
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
        from .memory.placement import note_host_memory

        if not (getattr(self, "is_paged", False) and p.numel() >= PAGED_FROM and _planned(self) == "cuda"):
            return super().get_state_buffer(p, dtype=dtype)
        from .memory.tracker import host_state

        with host_state():
            buffer = super().get_state_buffer(p, dtype=dtype)
        note_host_memory("optimizer_state", [buffer])  # for a tracked window that starts after this step
        return buffer


def _planned(optimizer: Any) -> str | None:
    """The device an estimate plans ``optimizer``'s step for: the CPU for one that torchao's ``CPUOffloadOptimizer``
    steps on a host copy (:func:`cpu_offload`), else the estimate's device (None outside one)."""
    from .memory.placement import planned_device

    planned = planned_device()
    return "cpu" if planned is not None and getattr(optimizer, "_memkit_host", False) else planned


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


# ---- torchao's CPUOffloadOptimizer without CUDA ----------------------------------------------------------------------
#
# torchao's class asserts a CUDA/XPU device, makes a side stream, records events, pins its host copies and calls
# ``record_stream``. On CPU tensors (a real CPU run, or an estimate's fake tensors standing for CUDA ones) there is one
# stream and no pinned allocator: while torchao's own code runs (construction, each backward hook, the step), its
# module sees a ``torch`` (:class:`_Torch`) whose ``cuda`` has one stream (:class:`_OneStream`) and whose
# ``empty_like`` leaves out ``pin_memory``, its ``get_available_devices`` answers ``cuda``, and
# ``Tensor.record_stream`` does nothing. Copies on one CPU stream are done when they return, so every ``non_blocking``
# copy torchao makes has finished when it reads it: the values and the bytes are its own. All restored on leaving,
# also on an error.


class _Event:
    """An event on the one stream: always complete."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _OneStream:
    """The CPU's only stream, for torchao's ``torch.cuda.Stream()``, ``current_stream()`` and ``stream(s)``."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


class _Cuda:
    """``torch.cuda`` as torchao's module sees it on CPU tensors: one stream, already in use."""

    Stream = _OneStream

    @staticmethod
    def current_stream(device: Any = None) -> _OneStream:
        return _OneStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _Torch:
    """``torch`` for torchao's module: :class:`_Cuda` for ``torch.cuda``, ``empty_like`` without ``pin_memory`` (no
    pinned allocator without an accelerator), the rest torch's own."""

    cuda = _Cuda

    @staticmethod
    def empty_like(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.empty_like(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _torchao_module():
    """torchao's ``cpu_offload`` module (imported by :func:`memkit.optimizers.make_optimizer`, quietly)."""
    return importlib.import_module("torchao.optim.cpu_offload")


@contextlib.contextmanager
def without_cuda() -> Iterator[None]:
    """torchao's ``CPUOffloadOptimizer`` code runs on CPU tensors inside (see the comment above); everything is
    restored on leaving, also on an error.

    Example:
        >>> with without_cuda():
        ...     opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW)
    """
    module = _torchao_module()
    saved = (module.torch, module.get_available_devices, torch.Tensor.record_stream)
    module.torch, module.get_available_devices = _Torch(), lambda: ["cpu", "cuda"]
    torch.Tensor.record_stream = lambda self, stream: None
    try:
        yield
    finally:
        module.torch, module.get_available_devices, torch.Tensor.record_stream = saved


@functools.cache
def _offload_class() -> type:
    """torchao's ``CPUOffloadOptimizer`` with what memkit needs around it (:func:`cpu_offload`)."""
    base = _torchao_module().CPUOffloadOptimizer

    class CPUOffloadOptimizer(base):
        """torchao's class; run through :func:`without_cuda` when its parameters are CPU tensors, with the handles
        of its gradient hooks kept (:meth:`remove`), and ``state`` gathering its optimizers' states (torchao's class
        has none of its own) so the tracker counts them."""

        def __init__(self, params, optimizer_class, **kwargs):
            params = list(params)
            self._on_cpu = not any(p.device.type in ("cuda", "xpu") for p in params)
            self.grad_hooks: list[Any] = []
            register = torch.Tensor.register_post_accumulate_grad_hook
            outer = self

            def keep(tensor, hook):  # each hook torchao registers: its handle kept, its run adapted
                handle = register(tensor, functools.partial(outer._backward_hook, hook))
                outer.grad_hooks.append(handle)
                return handle

            torch.Tensor.register_post_accumulate_grad_hook = keep
            try:
                with self._adapted():
                    super().__init__(params, optimizer_class, **kwargs)
            except BaseException:
                self.remove()
                raise
            finally:
                torch.Tensor.register_post_accumulate_grad_hook = register

        def _adapted(self) -> contextlib.AbstractContextManager:
            return without_cuda() if self._on_cpu else contextlib.nullcontext()

        def _backward_hook(self, hook, param: torch.Tensor) -> None:
            from .memory.recording import tag

            tag([param.grad], "gradient")  # before offload_gradients frees it: the tracker's own hook runs after
            with self._adapted():
                hook(param)

        @torch.no_grad()
        def step(self, closure=None):
            with self._adapted():
                return super().step(closure)

        @property
        def optimizers(self) -> list[torch.optim.Optimizer]:
            """The optimizer on the device (parameters under ``minimal_size``), if any, then one per host copy."""
            return [o for o in (self.d_opt, *self.optim_dict.values()) if o is not None]

        @property
        def state(self) -> dict[torch.Tensor, dict[str, Any]]:
            """Every optimizer's state, by the parameter it steps (a host copy, or a small device parameter)."""
            return {p: s for o in self.optimizers for p, s in o.state.items()}

        def host_tensors(self) -> dict[str, list[torch.Tensor]]:
            """The host copies torchao made: ``"parameter"`` (each offloaded parameter's) and ``"gradient"`` (its
            gradient's)."""
            hosts = list(self.param_d2h_map.values())
            return {"parameter": hosts, "gradient": [p.grad for p in hosts]}

        def remove(self) -> None:
            """Take torchao's gradient hooks off the model's parameters (torchao keeps no handle of them)."""
            for h in self.grad_hooks:
                h.remove()
            self.grad_hooks = []

    CPUOffloadOptimizer.__qualname__ = "CPUOffloadOptimizer"
    return CPUOffloadOptimizer


def cpu_offload(
    name: str, params: list[torch.Tensor], *, foreach: bool | None = None, offload_gradients: bool = False
) -> torch.optim.Optimizer:
    """torchao's ``CPUOffloadOptimizer`` over ``params``, stepping memkit's optimizer ``name`` on each parameter's host
    copy (torch's CPU default there: AdamW fused, as torchao makes it, the others a loop per parameter) and on the
    device for the small parameters (``foreach`` reaching it; in an estimate for ``"cuda"``, torch's CUDA default).
    In an estimate for ``"cuda"`` the host copies, their gradients and every host optimizer's state and temporaries
    are noted in host memory (:func:`memkit.memory.placement.note_host_memory`).

    Example:
        >>> opt = cpu_offload("adamw", list(model.parameters()))
    """
    from .memory.placement import note_host_memory, planned_device
    from .optimizers import build_optimizer

    holder: list[Any] = []

    def inner(groups, **kwargs):
        offloaded = holder[0]
        host = any(p is q for g in groups for p in _as_list(g["params"]) for q in offloaded.param_d2h_map.values())
        if host:
            opt = build_optimizer(name, groups, foreach=None)
            opt._memkit_host = True  # steps on the CPU, whatever the estimate plans for (_Adapted reads it)
            return opt
        on_device = foreach if foreach is not None or planned_device() != "cuda" else True
        return build_optimizer(name, groups, foreach=on_device)

    cls = _offload_class()
    if name == "adamw":
        # torchao's own default: fused AdamW, host and device, made by torchao from the class itself
        if foreach is not None:
            raise ValueError(
                f"foreach={foreach} does not apply to AdamW on the CPU: torchao's CPUOffloadOptimizer runs it fused "
                "(on the host and on the device); leave foreach=None"
            )
        optimizer = cls(params, torch.optim.AdamW, lr=1e-4, offload_gradients=offload_gradients)
    else:
        optimizer = cls.__new__(cls)
        holder.append(optimizer)
        cls.__init__(optimizer, params, inner, offload_gradients=offload_gradients)
    for category, tensors in optimizer.host_tensors().items():
        note_host_memory(category, tensors)
    return optimizer


def _as_list(params: Any) -> list[torch.Tensor]:
    return [params] if isinstance(params, torch.Tensor) else list(params)
