"""Every private torch API memkit uses, in one place: the next torch release breaks one module, not ten.

memkit supports torch ``>=2.8,<2.15`` (:data:`SUPPORTED`, the same range as ``pyproject.toml``; checked on 2.8.0,
2.13.0 and 2.14.1). Each shim below says which torch versions it is for and has its test in
``tests/test_torch_compat.py``. A feature that needs a newer torch than the floor asks :func:`require_torch`,
which raises a ``RuntimeError`` naming the version instead of letting torch fail deep inside: FSDP needs 2.11
(:data:`FSDP_MIN`, the first torch whose fake collectives run under ``FakeTensorMode``).

Left as direct imports, because memkit is built on them and they have kept their names and behaviour on every
supported torch: ``TorchDispatchMode`` and ``is_traceable_wrapper_subclass`` (``torch.utils._python_dispatch``),
``FakeTensorMode`` and ``is_fake`` (``torch._subclasses.fake_tensor``) and ``torch.utils._pytree``; the whole test
suite exercises them on the pin and ``make test-matrix`` on both ends of the range.

This module imports torch only inside its functions, so ``import memkit`` (which calls :func:`warn_if_unsupported`)
stays cheap.

Example:
    >>> from memkit import _torch_compat as compat
    >>> compat.torch_version()                      # e.g. (2, 13)
    >>> compat.require_torch(compat.FSDP_MIN, "memkit.FSDP")   # RuntimeError on torch 2.8
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from types import SimpleNamespace
from typing import Any

TORCH_MIN = (2, 8)
"""The oldest torch memkit supports: Colab's torch (2.8/2.9 in 2025-26) is inside, and 2.8 is the first torch with
``_top_saved_tensors_default_hooks``, which disk offload needs in training."""
TORCH_BELOW = (2, 15)
"""The first torch not supported (not tested yet)."""
SUPPORTED = ">=2.8,<2.15"
"""The range as ``pyproject.toml`` writes it (``tests/test_torch_compat.py`` checks they agree)."""
FSDP_MIN = (2, 11)
"""``memkit.FSDP`` (FSDP2 on a fake process group): the fake collectives it runs under ``FakeTensorMode`` are
registered from torch 2.11; 2.9 fails inside torch, 2.8 cannot run FSDP2 on a CPU mesh."""


def _parse(text: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``"2.16.0.dev20260101"`` -> ``(2, 16)``."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"torch version must look like 'MAJOR.MINOR...', got {text!r}")
    return int(match.group(1)), int(match.group(2))


def torch_version_text() -> str:
    """The torch version string: ``torch.__version__`` when torch is loaded, else its installed metadata (so that
    ``import memkit`` does not load torch)."""
    loaded = sys.modules.get("torch")
    version = getattr(loaded, "__version__", None)
    return str(version) if version else metadata.version("torch")


def torch_version() -> tuple[int, int]:
    """(major, minor) of this torch."""
    return _parse(torch_version_text())


def _range_words() -> str:
    newest = f"{TORCH_BELOW[0]}.{TORCH_BELOW[1] - 1}"  # torch's release after 2.x is 2.(x+1)
    return f"torch {SUPPORTED} ({TORCH_MIN[0]}.{TORCH_MIN[1]} to {newest})"


def warn_if_unsupported() -> bool:
    """All torch versions: warn once (``import memkit`` calls this) when this torch is outside :data:`SUPPORTED`.
    Returns True when it warned. No torch installed: nothing (importing torch fails later with its own message)."""
    try:
        text = torch_version_text()
        version = _parse(text)
    except (metadata.PackageNotFoundError, ValueError):
        return False
    if TORCH_MIN <= version < TORCH_BELOW:
        return False
    warnings.warn(
        f"memkit supports {_range_words()}; this is torch {text}. Features may fail inside torch or measure "
        f"wrongly: install a supported torch (pip install 'torch{SUPPORTED}').",
        RuntimeWarning,
        stacklevel=2,
    )
    return True


class TorchVersionError(RuntimeError):
    """A feature needs a newer torch than this one (a ``RuntimeError``, so code catching that still does)."""


def require_torch(version: tuple[int, int], feature: str) -> None:
    """All torch versions: raise a :class:`TorchVersionError` naming ``version`` if this torch is older.

    Example:
        >>> require_torch(FSDP_MIN, "memkit.FSDP")
    """
    if torch_version() < version:
        need = f"{version[0]}.{version[1]}"
        raise TorchVersionError(
            f"{feature} needs torch >= {need}; this is torch {torch_version_text()}, where memkit's other features "
            f"work: pip install 'torch>={need},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}'"
        )


# --- autograd -----------------------------------------------------------------------------------------------------


def graph_task_running() -> bool:
    """torch 2.8-2.14: ``torch._C._current_graph_task_id()`` is -1 outside a backward."""
    import torch

    return torch._C._current_graph_task_id() != -1


def current_autograd_node() -> Any:
    """torch 2.8-2.14: the autograd node whose backward runs now (``torch._C._current_autograd_node``), or None."""
    import torch

    return torch._C._current_autograd_node()


def outer_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """torch 2.8-2.14 (added in 2.8): the (pack, unpack) of the innermost ``saved_tensors_hooks`` active now, or
    None, without disabling them: disk offload's hooks wrap them (an outer checkpointing's, a tracker's)."""
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# --- functions the tracker replaces (calls that allocate outside dispatch) -----------------------------------------


def swap_outside_dispatch(get_rng_state: Callable, resize: Callable) -> tuple[Callable, Callable]:
    """torch 2.8-2.14: put ``get_rng_state`` in ``torch.get_rng_state`` and ``resize`` in
    ``torch.UntypedStorage.resize_`` (both build or resize storages in C++, where no dispatch mode sees them);
    returns what was there, which a second call with it puts back.

    Example:
        >>> saved = swap_outside_dispatch(my_rng, my_resize); ...; swap_outside_dispatch(*saved)
    """
    import torch

    saved = torch.get_rng_state, torch.UntypedStorage.resize_
    torch.get_rng_state, torch.UntypedStorage.resize_ = get_rng_state, resize
    return saved


@contextlib.contextmanager
def fake_module_to() -> Iterator[None]:
    """torch 2.8-2.14: while active, ``Module.to(...)`` on a module whose parameters or buffers are fake tensors
    gives each one that must change dtype a new fake tensor of the new dtype (same shape, strides and fake device),
    instead of torch's swap, which a fake parameter refuses ("Couldn't swap": it carries a weakref of the fake
    mode's). Device moves keep the fake device: an estimate's fake CPU tensors stand for the planned device.
    Modules of real tensors go through torch's own ``to``. For libraries that move the modules they build (peft's
    adapters) inside an estimate; the replaced tensors are new objects, so call it before anything holds them.

    Example:
        >>> with FakeTensorMode(), fake_module_to():
        ...     torch.nn.Linear(4, 2).to(torch.bfloat16).weight.dtype      # torch.bfloat16
    """
    import torch

    def cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
        for m in module.modules():
            for store in (m._parameters, m._buffers):
                for key, t in store.items():
                    if t is None or not _casts(t, dtype):
                        continue
                    new = torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=t.device)
                    param = store is m._parameters
                    store[key] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if param else new

    with _fake_module_to(cast):
        yield


def _casts(t, dtype) -> bool:
    """Whether ``Module.to(dtype)`` changes ``t``: a floating or complex tensor of another dtype."""
    return t.dtype != dtype and (t.is_floating_point() or t.is_complex())


@contextlib.contextmanager
def _fake_module_to(cast: Callable[[Any, Any], None]) -> Iterator[None]:
    """``Module.to`` patched while active: on a module holding fake tensors, ``cast(module, dtype)`` where the call
    names a dtype (a device move keeps the fake device); torch's own ``to`` for real modules."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        tensors = [*self.parameters(), *self.buffers()]
        if not tensors or not any(isinstance(t, FakeTensor) for t in tensors):
            return original(self, *args, **kwargs)
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            cast(self, dtype)
        return self

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def known_constant(make: Callable[[], Any]) -> Any:
    """torch 2.8-2.14: the tensor ``make()`` builds, as a fake tensor of the active ``FakeTensorMode`` that keeps
    its values (a fake "constant", built for real outside the mode), so ops whose output shape depends on values
    (``nonzero``, boolean indexing) can run on it and on what :func:`known_values` lets inherit them; outside fake
    mode, ``make()`` itself.

    Example:
        >>> with FakeTensorMode():
        ...     mask = known_constant(lambda: torch.ones(2, 8, dtype=torch.bool))   # mask.constant holds the ones
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    mode = detect_fake_mode()
    if mode is None:
        return make()
    with unset_fake_temporarily():
        real = make()
    return mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)


@contextlib.contextmanager
def known_values(inputs: Any) -> Iterator[None]:
    """torch 2.8-2.14: while active, values stay known under ``FakeTensorMode`` for tensors up to the size of
    ``nonzero`` of the largest fake constant (:func:`known_constant`) among ``inputs``: ops on constants keep their
    values (torch keeps them up to one element, ``fake_tensor.CONSTANT_NUMEL_LIMIT``), and so do the fills
    ``zeros``, ``ones`` and ``full`` (an ordinary fake tensor stands for them otherwise), so a data-dependent op
    (``nonzero``, boolean indexing, ``if tensor``) on what derives from them runs. Mochi's attention takes
    ``nonzero`` of a row of its text mask; HunyuanVideo 1.5 indexes its tokens by masks it builds with
    ``torch.zeros`` and branches on ``torch.all(image_embeds == 0)``. Enter it before any op touches the inputs (a
    view of a constant taken while torch keeps one element makes the constant forget its values). Nothing changes
    when ``inputs`` (a dict of forward arguments) holds no constant.

    Example:
        >>> with FakeTensorMode():
        ...     inputs = make_inputs(model)
        ...     with known_values(inputs):
        ...         model(**inputs)
    """
    import torch
    from torch._guards import detect_fake_mode
    from torch._subclasses import fake_tensor
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    values = inputs.values() if isinstance(inputs, dict) else inputs
    # the largest nonzero of a known input: one index per element and dimension
    sizes = [
        t.numel() * max(t.dim(), 1) for t in values if isinstance(t, fake_tensor.FakeTensor) and t.constant is not None
    ]
    mode = detect_fake_mode()
    if not sizes or mode is None:
        yield
        return
    limit = max(sizes)
    fills = (torch.ops.aten.zeros.default, torch.ops.aten.ones.default, torch.ops.aten.full.default)

    def too_large(func, args, kwargs) -> bool:  # the op's outputs, from its meta kernel
        try:
            with fake_tensor.in_kernel_invocation_manager(mode):
                out = func(*args, **kwargs)
        except Exception:  # a data-dependent meta kernel (nonzero): its output is no larger than its input
            return False
        return any(t.numel() > limit for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))

    class KnownFills(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in fills and math.prod(args[0]) <= limit and str(kwargs.get("device")) != "meta":
                return known_constant(lambda: func(*args, **kwargs))
            known = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, fake_tensor.FakeTensor)]
            if (
                known
                and all(t.constant is not None for t in known)
                and not func._schema.is_mutable
                and too_large(func, args, kwargs)
            ):
                # torch computes an op on constants for real before it looks at the size of the result: a
                # HunyuanVideo 1.5 attention mask of (tokens x tokens) would be gigabytes of host memory per block
                constants = [t.constant for t in known]
                for t in known:
                    t.constant = None
                try:
                    return func(*args, **kwargs)
                finally:
                    for t, c in zip(known, constants, strict=True):
                        t.constant = c
            return func(*args, **kwargs)

    original = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = max(original, limit)
    try:
        with KnownFills():
            yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = original


@contextlib.contextmanager
def fake_module_to_in_place() -> Iterator[None]:
    """Like :func:`fake_module_to`, but each fake parameter or buffer that must change dtype keeps its object and gets
    new data (``t.data = t.to(dtype)``, torch's own ``set_data`` path for real tensors): for a library that casts a
    module back and forth while others hold its parameters (diffusers' layerwise casting, under peft's adapters), so
    the old storage is freed as it is on real tensors.

    Example:
        >>> with FakeTensorMode(), fake_module_to_in_place():
        ...     layer = torch.nn.Linear(4, 2); w = layer.weight
        ...     layer.to(torch.float8_e4m3fn).weight is w                      # True
    """
    import torch

    from .optimizations._common import weights_replaced

    def cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                if _casts(t, dtype):
                    old = t.data
                    t.data = t.to(dtype)
                    weights_replaced([old])

    with _fake_module_to(cast):
        yield


# --- CPU feature probes and the profiler ---------------------------------------------------------------------------


def sized_by_values(measure: Callable) -> Callable:
    """``measure`` with fake mode's error for an op whose output size depends on its input's values (``aten.nonzero``
    under boolean-mask indexing, ``aten.bincount``: a mixture of experts routing tokens) turned into one that says why
    no estimate is made: fake tensors hold no values, and the real memory follows them."""

    import functools

    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    @functools.wraps(measure)
    def measured(**kwargs):
        try:
            return measure(**kwargs)
        except DynamicOutputShapeException as e:
            raise NotImplementedError(
                f"{kwargs['label']} cannot be estimated: its forward sizes a tensor by the values of another "
                f"({e.func}, as boolean-mask indexing or a mixture of experts routing tokens does); fake tensors hold "
                "no values, and the real step's memory follows them: measure a real step with memkit.compare"
            ) from e

    return measured


def amx_tile_supported() -> bool:
    """AMX tiles usable by this CPU and OS. torch >= 2.11: ``torch.cpu._is_amx_tile_supported()`` (the
    ``torch._C._cpu`` function moved there); torch 2.8-2.10: ``torch._C._cpu._is_amx_tile_supported()``."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is None:
        probe = getattr(torch._C._cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def profiler_allocations(prof: Any, device: str) -> list[tuple[int, int]]:
    """torch 2.8-2.14: (time ns, bytes; negative for a free) of each allocator event of ``device`` in a finished
    ``torch.profiler.profile(profile_memory=True)``, in recorded order (``kineto_results.experimental_event_tree``
    and ``torch._C._profiler._EventType``)."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth first, in recorded order
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(reversed(node.children))
    return events


# --- the CUDA caching allocator's history (CUDA builds only) -------------------------------------------------------


def cuda_history_missing() -> str | None:
    """torch 2.8-2.14: the private name this build lacks for the CUDA allocator's history, or None if all exist."""
    import torch

    memory = getattr(torch.cuda, "memory", None)
    for name in ("_record_memory_history", "_snapshot"):
        if not callable(getattr(memory, name, None)):
            return f"torch.cuda.memory.{name}"
    if not hasattr(torch._C, "_cuda_record_memory_history"):
        return "torch._C._cuda_record_memory_history"
    return None


def record_memory_history(**kwargs: Any) -> None:
    """torch 2.8-2.14: ``torch.cuda.memory._record_memory_history(**kwargs)`` (``enabled=None`` stops it)."""
    import torch

    torch.cuda.memory._record_memory_history(**kwargs)


def memory_snapshot() -> dict:
    """torch 2.8-2.14: ``torch.cuda.memory._snapshot()``, the allocator's segments and trace."""
    import torch

    return torch.cuda.memory._snapshot()


# --- FSDP2 (memkit.FSDP; torch >= 2.11, see FSDP_MIN) ---------------------------------------------------------------


def register_fake_backend() -> None:
    """torch 2.11-2.14: register the ``"fake"`` process-group backend (``torch.testing._internal``), after
    :func:`require_torch` for :data:`FSDP_MIN`."""
    require_torch(FSDP_MIN, "memkit.FSDP (FSDP2 on a fake process group)")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def fsdp_internals() -> SimpleNamespace:
    """torch 2.11-2.14: the FSDP2 classes memkit's tracker wraps (``memkit/memory/fsdp.py``); ImportError where
    torch has none: ``group`` (``FSDPParamGroup``), ``param`` (``FSDPParam``), ``propagator`` (DTensor's
    ``ShardingPropagator``) and ``allocators``, the buffer-allocating mixins that define ``allocate``
    (``DefaultAllocMixin``, ``ProcessGroupAllocMixin``, ``SymmMemAllocMixin``; those a torch lacks are left out)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    names = ("DefaultAllocMixin", "ProcessGroupAllocMixin", "SymmMemAllocMixin")
    found = [getattr(collectives, name, None) for name in names]
    allocators = [cls for cls in found if cls is not None and "allocate" in vars(cls)]
    return SimpleNamespace(group=FSDPParamGroup, param=FSDPParam, propagator=ShardingPropagator, allocators=allocators)


def fsdp_params(module: Any) -> list:
    """torch 2.11-2.14: the ``FSDPParam`` objects of a module ``fully_shard`` wrapped ([] for any other module)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    group = getattr(state, "_fsdp_param_group", None) if state is not None else None
    return list(group.fsdp_params) if group is not None else []


def fsdp_unsharded_tensors(group: Any) -> list:
    """torch 2.11-2.14: the unsharded parameter tensors of an ``FSDPParamGroup`` (all-gather outputs and the
    inner tensors of tensor subclasses)."""
    tensors = []
    for fsdp_param in group.fsdp_params:
        tensors += fsdp_param.all_gather_outputs
        tensors += getattr(fsdp_param, "_unsharded_inner_tensors", [])
    return tensors


def forget_fsdp_state(module: Any) -> None:
    """torch 2.11-2.14: drop ``module`` from FSDP's registry of module -> state (``torch.distributed.
    _composable_state._module_state_mapping``), which refuses to shard a module it already knows."""
    states = sys.modules.get("torch.distributed._composable_state")
    if states is not None:
        states._module_state_mapping.pop(module, None)


def local_tensor(t: Any) -> Any:
    """torch 2.8-2.14: a DTensor's local shard (``_local_tensor``, no autograd view), or None for another tensor."""
    return getattr(t, "_local_tensor", None)


def set_local_tensor(t: Any, local: Any) -> None:
    """torch 2.8-2.14: replace a DTensor's local shard (same shape, dtype and device) in place."""
    t._local_tensor = local
