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
What it learns is kept for the process (the next estimate, a widget's next setting, starts with it) and on disk
(:func:`save`, :func:`cache_file`: a JSON file per torch version in the user's cache folder or ``MEMKIT_CACHE_DIR``,
read once per process), so a fresh process, each CLI call, starts with what earlier ones learned. Entries are
metadata only; a file that cannot be read or written is ignored with a warning, never an error.

``tests/test_fake_dispatch.py`` checks that estimates are byte-equal with the cache on and off, and through the
file.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import warnings
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
_ENTRIES_KEPT = 200_000  # ~100 bytes each; past it the store starts again
_OPS: dict[int, int] = {}  # id(func) -> 0 never, 1 new tensors, 2 in place, 3 view, 4 prim.device, 5 item
_FUNCS: dict[int, Any] = {}  # id(func) -> func, for the file's op names
_FORMAT = 1  # the file's: bump when what an entry means changes
_SAVE_EVERY = 30.0  # seconds between writes while a process keeps learning (the rest is written at its exit)


def _fresh_disk() -> dict:
    """The file's state in a process: read yet, entries written, when last written, exit hook, warnings given."""
    return {"read": False, "saved": 0, "at": float("-inf"), "atexit": False, "warned": set()}


_disk = _fresh_disk()


class FakeDispatchCache:
    """Call ops through it instead of ``func(*args, **kwargs)`` under ``FakeTensorMode`` (see the module
    docstring). One instance per estimate (it makes its fake tensors in that estimate's mode); what it learns is
    kept for the process.

    Example:
        >>> cache = FakeDispatchCache()
        >>> out = cache(torch.ops.aten.mm.default, (a, b), {})
    """

    def __init__(self) -> None:
        _read_once()
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
            _FUNCS[id(func)] = func
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
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else 0
        if s.nbytes() != extent * t.element_size():
            return None  # a slice of a larger buffer: its storage is not what empty_strided makes
        infos.append((shape, stride, t.dtype, t.device, t.requires_grad))
    return ("new", (infos, container))


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


# -- the file ----------------------------------------------------------------------------------------------------
def cache_file() -> str:
    """The file fake dispatch answers are kept in across processes: one per torch version (meta kernels decide
    them), in ``MEMKIT_CACHE_DIR`` or the user's cache folder.

    Example:
        >>> from memkit.memory import _fake_dispatch
        >>> _fake_dispatch.cache_file()   # e.g. ~/.cache/memkit/fake-dispatch-torch2.13.0-v1.json
    """
    from platformdirs import user_cache_dir

    root = os.environ.get("MEMKIT_CACHE_DIR") or user_cache_dir("memkit")
    return os.path.join(root, f"fake-dispatch-torch{torch.__version__}-v{_FORMAT}.json")


def save_soon() -> None:
    """:func:`save` now if the last write is :data:`_SAVE_EVERY` seconds old (a process's first estimate is written
    at once), else at the process's exit: ``memkit.estimate`` calls it after each estimate, and a widget or a test
    suite making hundreds of them rewrites the file twice a minute at most.

    Example:
        >>> memkit.estimate("flux", size="full"); _fake_dispatch.save_soon()
    """
    if len(_ENTRIES) == _disk["saved"]:
        return
    if not _disk["atexit"]:
        _disk["atexit"] = True
        atexit.register(lambda: save())  # the module's save at exit, whatever _disk is then
    if time.monotonic() - _disk["at"] >= _SAVE_EVERY:
        save()


def save() -> None:
    """Write what this process learned to :func:`cache_file` (merged with what other processes wrote meanwhile,
    replaced atomically); nothing to do when nothing is new.

    Example:
        >>> memkit.estimate("flux", size="full"); _fake_dispatch.save()   # the next process starts faster
    """
    if len(_ENTRIES) == _disk["saved"]:
        return
    _disk["at"] = time.monotonic()
    path = cache_file()
    mine = []
    for k, v in list(_ENTRIES.items()):
        if not _small(k[1]):
            continue  # a foreach op over every parameter of a model run whole: its own, and large to read back
        try:
            mine.append([_op_name(_FUNCS[k[0]]), _enc(k[1:]), _enc(v)])
        except (KeyError, TypeError):  # an op or a container type the file cannot name: kept in the process only
            pass
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            theirs = _read(path)
        except (OSError, ValueError):
            theirs = []
        known = {json.dumps(e[:2]) for e in mine}
        merged = mine + [e for e in theirs if json.dumps(e[:2]) not in known]
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": _FORMAT, "torch": torch.__version__, "entries": merged[:_ENTRIES_KEPT]}, f)
        os.replace(tmp, path)
        _disk["saved"] = len(_ENTRIES)
    except OSError as e:
        _warn_once("written", path, e)


_DISK_LIST = 64  # the longest tensor list a key on disk holds


def _small(args_key: tuple) -> bool:
    """Whether no list argument of a key (what :func:`_key_of` makes of an op's args) is longer than _DISK_LIST."""
    return not any(len(a) == 2 and a[0] in (list, tuple) and len(a[1]) > _DISK_LIST for a in args_key[1])


def _read_once() -> None:
    if _disk["read"]:
        return
    _disk["read"] = True
    path = cache_file()
    if not os.path.exists(path):
        return
    try:
        entries = _read(path)
        for name, key, value in entries:
            func = _op(name)
            if func is not None:
                _FUNCS[id(func)] = func
                _ENTRIES.setdefault((id(func), *_dec(key)), _dec(value))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        _warn_once("read", path, e)
    _disk["saved"] = len(_ENTRIES)


def _read(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("torch") != torch.__version__:
        raise ValueError(f"not a format-{_FORMAT} fake dispatch cache of torch {torch.__version__}")
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) == 3 for e in entries):
        raise ValueError("its entries are not [op, key, value] triples")
    return entries


def _warn_once(what: str, path: str, e: Exception) -> None:
    if what not in _disk["warned"]:
        _disk["warned"].add(what)
        warnings.warn(
            f"memkit: the fake dispatch cache {path} cannot be {what} ({type(e).__name__}: {e}); it is ignored, "
            "and each process learns its estimates' ops again",
            stacklevel=3,
        )


def _op_name(func) -> str:
    return f"{func._schema.name.split('::', 1)[1]}.{func._overloadname}"


def _op(name: str):
    packet, _, overload = name.rpartition(".")
    try:
        return getattr(getattr(torch.ops.aten, packet), overload)
    except (AttributeError, RuntimeError):
        return None  # an op this torch does not have: its entries are not used


_TYPES = {t.__name__: t for t in (*_SCALARS, list, tuple)}
_NAMED = {"dt": torch.dtype, "mf": torch.memory_format, "ly": torch.layout}


def _enc(x: Any) -> Any:
    """JSON for a key or an entry: tagged objects for what JSON has not (tuples, dtypes, devices, types)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, tuple):
        return {"T": [_enc(v) for v in x]}
    if isinstance(x, list):
        return {"L": [_enc(v) for v in x]}
    if isinstance(x, torch.device):
        return {"dv": str(x)}
    if isinstance(x, type) and x.__name__ in _TYPES:
        return {"ty": x.__name__}
    for tag, kind in _NAMED.items():
        if isinstance(x, kind):
            return {tag: str(x).removeprefix("torch.")}
    raise TypeError(f"cannot write a {type(x).__name__} to the fake dispatch cache")


def _dec(x: Any) -> Any:
    if not isinstance(x, dict):
        if isinstance(x, list):
            raise ValueError("a bare list")
        return x
    ((tag, v),) = x.items()
    if tag == "T":
        return tuple(_dec(e) for e in v)
    if tag == "L":
        return [_dec(e) for e in v]
    if tag == "dv":
        return torch.device(v)
    if tag == "ty":
        return _TYPES[v]
    value = getattr(torch, v)
    if not isinstance(value, _NAMED[tag]):
        raise ValueError(f"torch.{v} is not a {_NAMED[tag].__name__}")
    return value
