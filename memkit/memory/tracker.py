"""The live-storage tracker: a ``TorchDispatchMode`` that records every new storage and its free.

Why a dispatch mode: it sees every op on any device (CPU, CUDA, fake tensors) with its real output
storages, so the bytes it adds up are the bytes the allocator handed out, not an estimate from shapes.
Frees come from a weakref callback on each storage, which fires exactly when the storage dies.
Three things a dispatch mode cannot see are added explicitly: buffers that a kernel allocates internally
and frees before returning (``workspace``), the 0-dim tensors of Python numbers passed as Tensor arguments,
which autograd may keep for backward (``workspace/scalars.py``), and, on CUDA, the caching allocator's rounding.

Categories are assigned when a storage is allocated, from what is running (module hooks give the forward,
autograd's graph task gives the backward, optimizer hooks the optimizer step), and corrected once a
storage's role becomes known: autograd puts it in ``param.grad`` (gradient), it survives in
``optimizer.state`` (optimizer state), or a forward allocation is still alive when backward starts
(activation).
"""

from __future__ import annotations

import sys
import time
import traceback
import weakref
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _torch_compat as _compat
from . import workspace
from ._roles import _HOST_STATE, _OFF_DEVICE, _Live, _plain, _Roles, host_state, off_device  # noqa: F401 (API)
from .events import ALLOC, CATEGORIES, CATEGORY_CODE, FREE, PHASE_CODE, EventLog
from .timeline import Timeline
from .workspace.scalars import reused_bytes, saved_scalars_fn

_FORWARD, _BACKWARD, _OPTIMIZER, _OTHER = (PHASE_CODE[p] for p in ("forward", "backward", "optimizer", "other"))
_ACTIVATION, _TEMPORARY = CATEGORY_CODE["activation"], CATEGORY_CODE["temporary"]

_active: list[Tracker] = []  # innermost last
_get_rng_state = None  # torch.get_rng_state while trackers are active (it is replaced by _rng_state_seen)
_storage_resize = None  # torch.UntypedStorage.resize_ while trackers are active (replaced by _resize_seen)
_DTENSOR: tuple[type, ...] = ()  # DTensor once torch.distributed.tensor is imported: its ops are seen desugared
_shapes_only = [0]  # > 0 while DTensor runs an op on fake tensors only to learn its output's shape


def _rng_state_seen() -> torch.Tensor:
    # torch.get_rng_state() builds its ByteTensor in C++, outside dispatch; activation checkpointing keeps one per
    # checkpointed block (preserve_rng_state=True, the default) until that block's backward recomputes it.
    state = _get_rng_state()
    for tracker in list(_active):
        tracker._outside_dispatch(state, "torch.get_rng_state")
    return state


def _resize_seen(storage: torch.UntypedStorage, nbytes: int):
    # FSDP frees and re-allocates its unsharded parameters by resizing their storages in place (Python calls
    # UntypedStorage.resize_, outside dispatch): a storage that grows is an allocation, one that shrinks a free.
    before = storage.nbytes()
    out = _storage_resize(storage, nbytes)
    if storage.nbytes() != before:
        for tracker in list(_active):
            tracker._resized(storage)
    return out


def _watch_outside_dispatch(on: bool) -> None:
    global _get_rng_state, _storage_resize, _DTENSOR
    if on and _get_rng_state is None:
        _get_rng_state, _storage_resize = _compat.swap_outside_dispatch(_rng_state_seen, _resize_seen)
        dtensor = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = (dtensor.DTensor,) if dtensor is not None else ()
        if dtensor is not None:  # no DTensor (nor FSDP module) can exist unless torch.distributed.tensor is imported
            from . import fsdp

            fsdp.instrument(True)  # a torch without these FSDP2 internals: a warning, and FSDP's buffers uncategorized
    elif not on and _get_rng_state is not None:
        _compat.swap_outside_dispatch(_get_rng_state, _storage_resize)
        _get_rng_state = _storage_resize = None
        if "memkit.memory.fsdp" in sys.modules:
            sys.modules["memkit.memory.fsdp"].instrument(False)


_FRESH = {torch.ops.aten.lift_fresh.default}


def in_host_state(t: torch.Tensor) -> bool:
    """True if an active tracker holds ``t``'s storage (a DTensor's: its local shard's) as host state."""
    keys = [inner.untyped_storage()._cdata for inner in _plain(t)]
    return any(k in tracker._kept for tracker in _active for k in keys)


_graph_task_running = _compat.graph_task_running


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTENSOR and _DTENSOR[0] in types:
            # Let DTensor desugar into ops on its local shards, which come back here: they are the allocations.
            return NotImplemented
        kwargs = kwargs or {}
        tracker = self.tracker
        if _shapes_only[0]:
            # DTensor's sharding propagation runs the op on fake tensors (the first time it sees a signature) to
            # learn the output's shape: nothing is allocated (torch's FSDPMemTracker skips these too).
            return func(*args, **kwargs)
        if tracker._pending and func.namespace != "prim":
            # Before the phase: a backward starting now retags what is saved. Not on prim ops (prim.device): they
            # allocate nothing, and fake tensors' device queries run before autograd has set the output's grad_fn.
            tracker._resolve_saved()
        phase = tracker._phase_now()
        out = func(*args, **kwargs) if tracker.fake is None else tracker.fake(func, args, kwargs)
        tracker._record_outputs(func, args, kwargs, out, phase)
        return out


class Tracker(_Roles):
    """Records the storages allocated and freed while it is active. Use it through :func:`track`, which
    registers the objects, starts and stops it; ``Tracker`` is public for code that needs ``register()``.

    Example:
        >>> with memkit.track() as tl:   # creates, starts and stops a Tracker
        ...     y = torch.randn(1024) * 2
    """

    def __init__(
        self,
        *,
        record_stacks: bool = False,
        alloc_granularity: int | None = None,
        device: str | None = None,
        label: str | None = None,
    ):
        self.log = EventLog()
        self.record_stacks = record_stacks
        self.alloc_granularity = alloc_granularity
        self.device = device
        self._live: dict[int, _Live] = {}
        self._baseline = {c: 0 for c in CATEGORY_CODE}
        # each baseline storage as (key, bytes, device code), in registration order: the allocator replay's blocks
        self.baseline_blocks: list[tuple[int, int, int]] = []
        self._explicit: list[int] = []
        self._forward_depth = 0
        self._optimizer_depth = 0
        self._last_phase = _OTHER
        self._seen_modules: set[int] = set()
        self._handles: list[Any] = []
        self._ops: dict[int, tuple] = {}
        # Wrapped numbers autograd may have saved, each with the output whose grad_fn holds it (see _expect_saved)
        self._pending: list[tuple] = []
        self._synthetic_key = -1  # storage keys of those rows until the real storage is known: -2, -3, ...
        self._saved_by_node: dict[int, list[tuple[int, object]]] = {}  # node sequence nr -> (storage key, number)
        self._saved_node: dict[int, int] = {}  # storage key -> node sequence nr
        self._host: dict[int, tuple[int, weakref.ref]] = {}  # storages created under off_device(): key -> bytes
        self._resized_role: dict[int, int] = {}  # storage resized to 0 -> its category, kept for when it regrows
        self._host_bytes = self._host_peak = 0
        # host state (track(host=...), host_state(), a host optimizer's step): storage key -> (bytes, weakref, id);
        # its allocations and frees by id, and each id's category (the last one given counts from the allocation
        # on, as a retag does on the timeline)
        self._kept: dict[int, tuple[int, weakref.ref, int]] = {}
        self._kept_events: list[tuple[int, int]] = []
        self._kept_category: list[str] = []
        self._host_steps: list[bool] = []  # per running optimizer step: do all its parameters live in host memory?
        self._lower_bound: set[str] = set()  # ops that ran a kernel path whose internal buffers are not modelled
        self._devices: dict[torch.device | None, int] = {}
        self._t0 = time.perf_counter()
        self._closed = False
        self._mode: _Mode | None = None
        # estimates: a FakeDispatchCache that runs each op in place of func(*args, **kwargs) (same outputs, faster)
        self.fake = None
        self.timeline = Timeline(source=self._snapshot, meta={"label": label, "source": "tracker"})

    # ---- hot path -------------------------------------------------------------------------------------------
    def _phase_now(self) -> int:
        if self._explicit:
            phase = self._explicit[-1]
        elif _graph_task_running():
            phase = _BACKWARD
        elif self._optimizer_depth:
            phase = _OPTIMIZER
        elif self._forward_depth:
            phase = _FORWARD
        else:
            phase = _OTHER
        if phase == _BACKWARD and self._last_phase != _BACKWARD:
            self._backward_started()
        self._last_phase = phase
        return phase

    def _op_info(self, func) -> tuple:
        # Keyed by id: OpOverload's __hash__ is Python code. The tuple keeps ``func`` alive, so its id stays its own.
        info = self._ops.get(id(func))
        if info is None:
            # lift_fresh returns the tensor that torch.tensor(data) just built outside dispatch: a new storage.
            aliasing = func not in _FRESH and any(r.alias_info is not None for r in func._schema.returns)
            fn = workspace.workspace_fn(func, self.device)
            partial_fn = workspace.lower_bound_fn(func, self.device)
            if partial_fn is not None:
                fn = partial(self._flag_lower_bound, str(func.overloadpacket), partial_fn, fn)
            slots = tuple(
                i for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor" and not a.kwarg_only
            )
            info = (aliasing, self.log.ops(str(func)), fn, saved_scalars_fn(func, self.device), slots, func)
            self._ops[id(func)] = info
        return info

    def _flag_lower_bound(self, name: str, unmodelled, fn, args, kwargs, out) -> int:
        if unmodelled(args, kwargs):
            self._lower_bound.add(name)
        return fn(args, kwargs, out) if fn is not None else 0

    def _record_outputs(self, func, args, kwargs, out, phase: int) -> None:
        aliasing, op, workspace_fn, saved_fn, slots, _ = self._op_info(func)
        if not aliasing:
            # A forward op replayed inside backward (activation checkpointing) recomputes an activation.
            category = _ACTIVATION if (phase == _BACKWARD and self._forward_depth) else _TEMPORARY
            if isinstance(out, torch.Tensor):
                self._new_storage(out, category, phase, op)
            else:
                # A flat tuple or list is the common case; some ops nest (functional fused Adam: a tuple of lists).
                flat = isinstance(out, (tuple, list)) and not any(isinstance(t, (tuple, list, dict)) for t in out)
                for t in out if flat else tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self._new_storage(t, category, phase, op)
        extra = workspace_fn(args, kwargs, out) if workspace_fn is not None and not self._on_host_now() else 0
        if extra and self._saved_by_node and phase == _BACKWARD and slots:
            extra -= self._reused_saved(args, slots)
        if extra:
            device = self._device_code(self._first_tensor_device(out))
            n = self._round(extra)
            now = time.perf_counter() - self._t0
            frame = self._frame() if self.record_stacks else -1
            self.log.rows.append((now, ALLOC, n, _TEMPORARY, phase, device, op, frame, -1))
            self.log.rows.append((now, FREE, n, _TEMPORARY, phase, device, op, frame, -1))
        if saved_fn is not None and isinstance(out, torch.Tensor):
            saved = saved_fn(args)
            if saved:
                self._expect_saved(out, saved, phase, op)

    def _expect_saved(self, out: torch.Tensor, saved: tuple[tuple[str, int, object], ...], phase: int, op: int) -> None:
        # Autograd's node, which may keep the argument parser's wrapped number, exists only once this op has
        # returned through the autograd kernel: count the number as live from here, and find it on the output's
        # grad_fn before the next op (nothing allocates in between that this tracker would record).
        device = self._device_code(out.device)
        ref = weakref.ref(out)
        rows = self.log.rows
        frame = self._frame() if self.record_stacks else -1
        for attr, n, value in saved:
            n = self._round(n)
            self._synthetic_key -= 1
            key = self._synthetic_key
            self._pending.append((ref, attr, n, value, len(rows), key, phase, device))
            rows.append((time.perf_counter() - self._t0, ALLOC, n, _TEMPORARY, phase, device, op, frame, key))

    def _reused_saved(self, args, slots: tuple[int, ...]) -> int:
        node = _compat.current_autograd_node()
        seq = getattr(node, "_sequence_nr", None)
        saved = self._saved_by_node.get(seq()) if seq is not None else None
        return reused_bytes(slots, args, saved) if saved else 0

    def _resolve_saved(self) -> None:
        pending, self._pending = self._pending, []
        for ref, attr, n, value, index, key, phase, device in pending:
            out = ref()
            node = out.grad_fn if out is not None else None
            saved = getattr(node, attr, None) if node is not None else None
            if isinstance(saved, torch.Tensor):
                s = saved.untyped_storage()
                skey = s._cdata
                if skey not in self._live:  # the same number saved twice is one storage
                    on_free = partial(self._on_free, skey, device, row_key=key)
                    self._live[skey] = _Live(index, n, _TEMPORARY, phase, weakref.ref(s, on_free))
                    seq = node._sequence_nr()
                    self._saved_by_node.setdefault(seq, []).append((skey, value))
                    self._saved_node[skey] = seq
                    continue
            # not saved after all (no node, or the node does not keep it): it died when the op returned
            self.log.rows.append((time.perf_counter() - self._t0, FREE, n, _TEMPORARY, phase, device, -1, -1, key))

    def _outside_dispatch(self, t: torch.Tensor, name: str) -> None:
        """A new tensor that torch built without dispatching an op (the tracker's mode never saw it)."""
        phase = self._phase_now()
        category = _ACTIVATION if (phase == _BACKWARD and self._forward_depth) else _TEMPORARY
        self._new_storage(t, category, phase, self.log.ops(name))

    def _new_storage(self, t: torch.Tensor, category: int, phase: int, op: int) -> None:
        if _DTENSOR and isinstance(t, _DTENSOR):
            for inner in _plain(t):
                self._new_storage(inner, category, phase, op)
            return
        s = t.untyped_storage()
        key = s._cdata
        if key in self._live or key in self._host or key in self._kept:
            return
        n = s.nbytes()
        if n == 0:
            return
        if _HOST_STATE.get() or (self._host_steps and self._host_steps[-1]):
            self._keep(key, s, n, CATEGORIES[category])
            return
        if _OFF_DEVICE.get():
            self._host[key] = (n, weakref.ref(s, partial(self._on_host_free, key)))
            self._host_bytes += n
            self._host_peak = max(self._host_peak, self._host_bytes)
            return
        if self.alloc_granularity:
            n = self._round(n)
        rows = self.log.rows
        index = len(rows)
        frame = self._frame() if self.record_stacks else -1
        device = self._device_code(t.device)
        rows.append((time.perf_counter() - self._t0, ALLOC, n, category, phase, device, op, frame, key))
        self._live[key] = _Live(index, n, category, phase, weakref.ref(s, partial(self._on_free, key, device)))

    def _resized(self, s: torch.UntypedStorage) -> None:
        """``s`` was resized in place: its old bytes are freed and its new bytes allocated, keeping its category."""
        key = s._cdata
        if key in self._host or key in self._kept:
            return
        phase = self._phase_now()
        entry = self._free_now(s, phase)
        now = time.perf_counter() - self._t0
        rows = self.log.rows
        if entry is not None:
            self._resized_role[key] = entry.category
        n = s.nbytes()
        if n == 0:
            return
        n = self._round(n)
        category = self._resized_role.get(key)
        if category is None:
            category = _ACTIVATION if (phase == _BACKWARD and self._forward_depth) else _TEMPORARY
        device = self._device_code(s.device)
        index = len(rows)
        frame = self._frame() if self.record_stacks else -1
        rows.append((now, ALLOC, n, category, phase, device, self.log.ops("UntypedStorage.resize_"), frame, key))
        self._live[key] = _Live(index, n, category, phase, weakref.ref(s, partial(self._on_free, key, device)))

    def _free_now(self, s: torch.UntypedStorage, phase: int) -> _Live | None:
        """Record ``s``'s bytes as freed now though the storage lives on (resized, or its pages given back); returns
        the entry it had. Dropping the entry drops its weakref: no free is recorded twice."""
        key = s._cdata
        entry = self._live.pop(key, None)
        if entry is not None:
            device = self.log.rows[entry.event][5] if entry.event >= 0 else self._device_code(s.device)
            now = time.perf_counter() - self._t0
            self.log.rows.append((now, FREE, entry.nbytes, entry.category, phase, device, -1, -1, key))
        return entry

    def _released(self, t: torch.Tensor) -> None:
        """``t``'s memory was given back while its storage lives on: a free now (host bytes: off the count)."""
        for inner in _plain(t):
            s = inner.untyped_storage()
            host = self._host.pop(s._cdata, None)
            if host is not None:
                self._host_bytes -= host[0]
            elif not self._closed:
                self._free_now(s, self._phase_now())

    def _on_free(self, key: int, device: int, _ref=None, row_key: int | None = None) -> None:
        self._resized_role.pop(key, None)
        entry = self._live.pop(key, None)
        if entry is None or self._closed:
            return
        phase = self._explicit[-1] if self._explicit else self._last_phase
        if row_key is None:
            row_key = key
        else:  # a saved wrapped number: its node no longer holds it
            seq = self._saved_node.pop(key, None)
            held = self._saved_by_node.get(seq)
            if held is not None:
                held[:] = [h for h in held if h[0] != key]
                if not held:
                    del self._saved_by_node[seq]
        self.log.rows.append(
            (time.perf_counter() - self._t0, FREE, entry.nbytes, entry.category, phase, device, -1, -1, row_key)
        )

    def _round(self, n: int) -> int:
        from .events import round_alloc  # TODO: move to the module's events import once tracker.py is quiet

        return round_alloc(n, self.alloc_granularity)

    def _device_code(self, device: torch.device | None) -> int:
        code = self._devices.get(device)
        if code is None:
            name = self.device or (str(device) if device is not None else "cpu")
            code = self._devices[device] = self.log.devices(name)
        return code

    @staticmethod
    def _first_tensor_device(out) -> torch.device | None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                return t.device
        return None

    def _frame(self) -> int:
        # the caller's frames up to where the tracker was entered (dispatch, a resize, the RNG state), torch's
        # own left out: the innermost 8 of them name the allocation's site
        stack = traceback.extract_stack()
        entered = next((i for i, f in enumerate(stack) if "/memkit/memory/" in f.filename), len(stack))
        frames = [f"{f.filename}:{f.lineno} {f.name}" for f in stack[:entered] if "/torch/" not in f.filename]
        return self.log.frames("\n".join(frames[-8:]))

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _forward_pre(self, module, args) -> None:
        if id(module) not in self._seen_modules:
            self.register_module(module, recurse=False)
        self._forward_depth += 1

    def _forward_post(self, module, args, output) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        self.register_optimizer(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._host_steps.append(bool(self._kept and params) and all(self._in_host(p) for p in params))
        self._optimizer_depth += 1

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        if self._host_steps:
            self._host_steps.pop()
        self.register_optimizer(optimizer)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._handles += [
            nn_module.register_module_forward_pre_hook(self._forward_pre),
            nn_module.register_module_forward_hook(self._forward_post, always_call=True),
            optim_module.register_optimizer_step_pre_hook(self._optimizer_pre),
            optim_module.register_optimizer_step_post_hook(self._optimizer_post),
        ]
        self._mode = _Mode(self)
        self._t0 = time.perf_counter()
        self._mode.__enter__()
        _active.append(self)
        _watch_outside_dispatch(True)

    def stop(self) -> None:
        """Stop recording and remove every hook; safe to call if ``start`` never ran or failed."""
        try:
            mode, self._mode = self._mode, None
            if mode is not None:
                mode.__exit__(None, None, None)
            if self._pending:
                self._resolve_saved()
        finally:
            if self in _active:
                _active.remove(self)
            if not _active:
                _watch_outside_dispatch(False)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self.timeline.meta["lower_bound_ops"] = sorted(self._lower_bound)
            self.timeline.meta["host_peak_bytes"] = self._host_peak
            self.timeline.meta["host_state_bytes"] = self._host_state_bytes()
            self.timeline._freeze()
            self._closed = True
            self._live.clear()  # drops the weakrefs, so no callback runs for storages that die later
            self._host.clear()
            self._kept.clear()
            self._host_steps.clear()
            self._pending.clear()
            self._saved_by_node.clear()
            self._saved_node.clear()
            self._resized_role.clear()

    def _snapshot(self, seen_version) -> tuple[tuple, dict, dict] | None:
        version = (len(self.log.rows), len(self.log.retags), tuple(self._baseline.values()))
        if version == seen_version:
            return None
        return (
            version,
            self.log.columns(),
            {
                "baseline": dict(self._baseline),
                "devices": list(self.log.devices.items),
                "ops": list(self.log.ops.items),
                "frames": list(self.log.frames.items),
            },
        )
