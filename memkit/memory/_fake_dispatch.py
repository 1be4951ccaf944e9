"""A cheaper front for ``FakeTensorMode``'s dispatch, for estimates: the same outputs, built from a plain-tuple key.

Under fake tensors an op costs ~150-400 µs, nearly all of it ``FakeTensorMode`` computing the cache key of its
arguments (generic: symbolic sizes, nested structures, many metadata fields) and synthesizing its outputs; a
transformer step repeats the same few hundred signatures thousands of times. This cache keys an op by what decides
its outputs' metadata when nothing is symbolic (each fake tensor argument's dtype, shape, strides, offset and
device; every other argument by type and value) and, from the second time on:

- an op that makes new tensors (no alias in its schema's returns) gets new fake tensors with the metadata, storage
  size and ``requires_grad`` fake dispatch gave them the first time;
- an in-place op whose first call changed no argument's metadata and returned its first argument, or nothing,
  returns the same again without running.

Everything else goes to ``FakeTensorMode`` as before: views (which must share their base's storage), ops tagged
random, data-dependent or dynamic-shape, ops on constants (``torch.tensor(0.)``, whose values fake tensors
propagate), outputs that are not plain fake tensors, or whose storage is larger than their extent, or shared.
What it learns is kept for the process: the next estimate (a widget's next setting) starts with it. Entries are
metadata only. (Kept on disk across processes, it saved ~0.2 s of a 2.6 s full Flux estimate, and reading and
merging the file grew with it: 6.8 MB after one CI run made a first estimate 12 s. It is not.)

``tests/test_fake_dispatch.py`` checks that estimates are byte-equal with the cache on and off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.utils._mode_utils import no_dispatch

_DEVICE = torch.ops.prim.device.default
_ITEM = torch.ops.aten._local_scalar_dense.default
_SKIP_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class _Bypass(Exception):
    pass


def _key_of(a: Any) -> Any:
    if isinstance(a, FakeTensor):
        if a.constant is not None:
            raise _Bypass
        return (a.dtype, a.shape, a.stride(), a.storage_offset(), a.fake_device, a.requires_grad)
    if isinstance(a, torch.Tensor):
        raise _Bypass
    if isinstance(a, (list, tuple)):
        return (type(a), tuple([_key_of(x) for x in a]))
    if isinstance(a, _SCALARS):
        return (type(a), a)
    raise _Bypass


def _meta(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (tuple(t.shape), t.stride(), t.storage_offset(), s.nbytes(), s._cdata)


# What fake dispatch gave each signature, for the whole process: entries hold no tensors and no mode, only
# metadata, which is a function of the key alone (torch's meta kernels), so the next estimate (a widget's next
# setting) starts with what the earlier ones learned.
_ENTRIES: dict[tuple, Any] = {}
_ENTRIES_KEPT = 200_000  # past it the store starts again (most keys are ~100 B; a foreach over every parameter of
# a model run whole is one key of up to ~0.36 MB written as JSON, 38 of them
# after one un-memoized full FSDP run)
_OPS: dict[int, int] = {}  # id(func) -> 0 never, 1 new tensors, 2 in place, 3 view, 4 prim.device, 5 item


class FakeDispatchCache:
    """Call ops through it instead of ``func(*args, **kwargs)`` under ``FakeTensorMode`` (see the module
    docstring). One instance per estimate (it makes its fake tensors in that estimate's mode); what it learns is
    kept for the process.

    Example:
        >>> cache = FakeDispatchCache()
        >>> out = cache(torch.ops.aten.mm.default, (a, b), {})
    """

    def __init__(self) -> None:
        self._entries = _ENTRIES
        self._ops = _OPS
        self.mode = None  # the estimate's FakeTensorMode, from the first fake tensor an op gives
        self.hits = 0

    def _kind(self, func) -> int:
        kind = self._ops.get(id(func))
        if kind is None:
            kind = 0
            schema = func._schema
            if func is _DEVICE:
                kind = 4
            elif func is _ITEM:
                kind = 5
            elif (
                func.namespace == "aten"
                and func is not torch.ops.aten._unsafe_view.default  # returns a view its schema does not declare
                and not any(tag in func.tags for tag in _SKIP_TAGS)
                and torch.Tag.inplace_view not in func.tags
            ):
                returns_alias = any(r.alias_info is not None for r in schema.returns)
                if func.is_view and not schema.is_mutable:
                    kind = 3
                elif not returns_alias and not schema.is_mutable:
                    kind = 1
                elif schema.is_mutable and schema.name.endswith("_"):  # add_, _foreach_mul_: not out= variants
                    kind = 2
            self._ops[id(func)] = kind
        return kind

    def __call__(self, func, args: tuple, kwargs: dict) -> Any:
        kind = self._kind(func)
        if not kind:
            return func(*args, **kwargs)
        if kind == 4:  # the device a fake tensor stands for: asked for by autograd for every op
            (t,) = args
            return t.fake_device if isinstance(t, FakeTensor) and not kwargs else func(*args, **kwargs)
        if kind == 5:  # .item() of a constant (Adam's step count): fake dispatch reads the value it propagated
            (t,) = args
            if isinstance(t, FakeTensor) and t.constant is not None and not kwargs:
                with no_dispatch():
                    return t.constant.item()
            return func(*args, **kwargs)
        try:
            key = (id(func), _key_of(args), _key_of(tuple(kwargs.items())) if kwargs else None)
        except _Bypass:
            return func(*args, **kwargs)
        entry = self._entries.get(key)
        if entry is not None and (self.mode is not None or entry[0] == "inplace"):
            self.hits += 1
            return self._replay(entry, args)
        return self._first(key, kind, func, args, kwargs)

    def _first(self, key, kind, func, args, kwargs):
        tensors = [a for a in _flat((*args, *kwargs.values())) if isinstance(a, FakeTensor)]
        before = [_meta(t) for t in tensors] if kind == 2 else None
        out = func(*args, **kwargs)
        made = out if isinstance(out, FakeTensor) else out[0] if isinstance(out, (list, tuple)) and out else None
        if isinstance(made, FakeTensor):
            if self.mode is None:
                self.mode = made.fake_mode
            elif made.fake_mode is not self.mode:
                return out  # another mode's tensors (not an estimate's): nothing to learn
        if key not in self._entries:
            entry = _entry_of(kind, out, args, tensors, before)
            if entry is not None:
                if len(self._entries) >= _ENTRIES_KEPT:
                    self._entries.clear()
                self._entries[key] = entry
        return out

    def _replay(self, entry, args):
        kind, value = entry
        if kind == "inplace":
            return args[value] if value is not None else None
        if kind == "view":
            base, outputs, container = value
            storage = args[base].untyped_storage()
            made = [_view(self.mode, storage, m) for m in outputs]
            return made[0] if container is None else container(made)
        outputs, container = value
        made = [_fresh(self.mode, m) for m in outputs]
        return made[0] if container is None else container(made)


def _flat(args) -> list:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _entry_of(kind, out, args, tensors, before):
    if kind == 2:
        if [_meta(t) for t in tensors] != before:
            return None  # the op changed an argument's metadata (resized it): always run it
        if out is None or (isinstance(out, (list, tuple)) and not out):
            return ("inplace", None) if out is None else None
        if isinstance(out, FakeTensor) and args and out is args[0]:
            return ("inplace", 0)
        return None
    if kind == 3:
        return _view_entry(out, args)
    if isinstance(out, FakeTensor):
        outs, container = [out], None
    elif isinstance(out, (list, tuple)) and out and all(isinstance(t, FakeTensor) for t in out):
        outs, container = list(out), type(out)
    else:
        return None
    infos = []
    storages = {t.untyped_storage()._cdata for t in tensors}  # an output on an argument's storage is a view
    for t in outs:
        if t.constant is not None or t.is_conj() or t.is_neg() or t.layout != torch.strided:
            return None
        s = t.untyped_storage()
        if s._cdata in storages or t.storage_offset() != 0:
            return None
        storages.add(s._cdata)
        shape, stride = tuple(t.shape), t.stride()
        if s.nbytes() != extent(shape, stride) * t.element_size():
            return None  # a slice of a larger buffer: its storage is not what empty_strided makes
        infos.append((shape, stride, t.dtype, t.device, t.requires_grad))
    return ("new", (infos, container))


def extent(shape, stride) -> int:
    """The elements a tensor of ``shape`` and ``stride`` reaches from its storage offset (0 when it is empty)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else 0


def _fresh(mode, info) -> FakeTensor:
    shape, stride, dtype, device, requires_grad = info
    with in_kernel_invocation_manager(mode):
        empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
    return FakeTensor(mode, empty, device)


def _view_entry(out, args):
    outs, container = ([out], None) if isinstance(out, FakeTensor) else (list(out), type(out))
    if not outs or not all(isinstance(t, FakeTensor) for t in outs):
        return None
    bases = [i for i, a in enumerate(args) if isinstance(a, FakeTensor)]
    if len(bases) != 1:
        return None
    base = bases[0]
    storage = args[base].untyped_storage()._cdata
    infos = []
    for t in outs:
        if t.untyped_storage()._cdata != storage or t.constant is not None or t.is_conj() or t.is_neg():
            return None
        if t.layout != torch.strided:
            return None
        infos.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad))
    return ("view", (base, infos, container))


def _view(mode, storage, info) -> FakeTensor:
    shape, stride, offset, dtype, device, requires_grad = info
    with in_kernel_invocation_manager(mode):
        empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
        empty.set_(storage, offset, shape, stride)
    return FakeTensor(mode, empty, device)
