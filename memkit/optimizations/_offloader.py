"""The machinery of :class:`memkit.Offload`: the groups, the hooks that load and drop them, the saved-tensor hooks
that keep training exact, and :func:`onloaded`.

A group is onloaded when its parameters' ``data`` are real tensors and offloaded when they hold a zero-stride
placeholder (same shape, dtype and device; one element of storage shared by all). Forward pre-hooks on the
blocks (and on their parameter-holding layers, which a model may call outside the block) onload a group and
drop the groups not in use; prefetches start the next groups in the order learned on the first forward. While
autograd records, tensors it saves that are views of an onloaded weight are packed as a :class:`_Ref` (group,
index, size, stride, offset) and rebuilt in the backward from the group, onloaded again in reverse order. An
optimizer step onloads every group of its parameters; a changed group (its parameters' version counters moved)
is written back to its store when it is offloaded again.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim import optimizer as _optim

from .. import _torch_compat as _compat

if TYPE_CHECKING:
    from .offload import Offload

_OWNER: dict[int, tuple[weakref.ref, _Offloader, _Group]] = {}  # id(parameter) -> (it, its offloader, group)


def _owner(p: object) -> tuple[_Offloader, _Group] | None:
    hit = _OWNER.get(id(p))
    return (hit[1], hit[2]) if hit is not None and hit[0]() is p else None


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Group:
    __slots__ = ("gid", "name", "modules", "names", "params", "real", "versions", "keys", "active", "block")

    def __init__(
        self, gid: int, name: str, modules: list[nn.Module], named: list[tuple[str, nn.Parameter]], block: bool = False
    ):
        self.gid, self.name, self.modules, self.block = gid, name, modules, block  # block: its layers hooked too
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.real: list[torch.Tensor] | None = None  # the onloaded tensors; None while offloaded
        self.versions: list[int] = []
        self.keys: list[int] = []
        self.active = 0  # members whose forward is running

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


class _Offloader:
    """The state of one applied ``Offload``: its groups, store, hooks and prefetches."""

    def __init__(self, model: nn.Module, config: Offload, groups: list[_Group], store, device: torch.device):
        self.model, self.config, self.groups, self.store, self.device = model, config, groups, store, device
        self.lock = threading.RLock()
        self.hooks: list = []
        self.by_storage: dict[int, tuple[_Group, int]] = {}
        self.prefetched: dict[int, object] = {}
        self.order: list[_Group] | None = None  # learned on the first forward
        self.seen: list[_Group] | None = None
        self.saved_hooks: list = []
        self.placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.loads = 0

    # -- moving a group ------------------------------------------------------------------------------------
    def placeholder(self, p: torch.Tensor) -> torch.Tensor:
        base = self.placeholders.get((p.dtype, p.device))
        if base is None:
            base = self.placeholders[(p.dtype, p.device)] = torch.zeros((), dtype=p.dtype, device=p.device)
        return base.expand(p.shape)

    def onload(self, g: _Group) -> None:
        with self.lock:
            if g.real is not None:
                return
            pending = self.prefetched.pop(g.gid, None)
            tensors = pending.result() if pending is not None else self.store.load(g.gid)
            self.loads += 1
            for p, t in zip(g.params, tensors, strict=True):
                p.data = t
            g.real = list(tensors)
            g.versions = [p._version for p in g.params]
            g.keys = [_key(t) for t in tensors]
            for i, k in enumerate(g.keys):
                self.by_storage[k] = (g, i)
            if self.seen is not None and g not in self.seen:
                self.seen.append(g)

    def changed(self, g: _Group) -> bool:
        return any(p._version != v or _key(p.data) != k for p, v, k in zip(g.params, g.versions, g.keys, strict=True))

    def offload(self, g: _Group, force_write: bool = False) -> None:
        with self.lock:
            if g.real is None or g.active:
                return
            if force_write or self.changed(g):  # an optimizer step or load_state_dict changed it: save before dropping
                self.store.write_back(g.gid, [p.data for p in g.params])
            for p in g.params:
                p.data = self.placeholder(p)
            for k in g.keys:
                self.by_storage.pop(k, None)
            g.real, g.keys = None, []
            self.store.release(g.gid)

    def offload_others(self, keep: Iterable[_Group] = ()) -> None:
        keep = {id(g) for g in keep}
        for g in self.groups:
            if g.real is not None and not g.active and id(g) not in keep:
                self.offload(g)

    def onload_all(self) -> None:
        for g in self.groups:
            self.onload(g)

    def ahead_of(self, g: _Group, step: int) -> list[_Group]:
        """The ``prefetch`` groups after ``g`` in the learned order (``step=-1``: before it)."""
        if self.order is None or not self.config.prefetch or g not in self.order:
            return []
        i = self.order.index(g)
        window = range(i + step, i + step * (self.config.prefetch + 1), step)
        return [self.order[j] for j in window if 0 <= j < len(self.order)]

    def start(self, groups: Iterable[_Group]) -> None:
        """Start loading ``groups`` in the background (those not onloaded or loading already)."""
        with self.lock:
            for h in groups:
                if h.real is None and h.gid not in self.prefetched:
                    self.prefetched[h.gid] = self.store.prefetch(h.gid)

    def prefetch_after(self, g: _Group, step: int) -> list[_Group]:
        ahead = self.ahead_of(g, step)
        self.start(ahead)
        return ahead

    # -- hooks ---------------------------------------------------------------------------------------------
    def enter(self, g: _Group, top: bool) -> None:
        """A module of ``g`` starts its forward (``top``: a block itself; else one of its layers, which a model may
        call outside the block, as DiT calls block 0's embedder after the last block): the groups not in use go,
        ``g`` comes, and, when the block itself starts, the next ones start loading (not for a layer called out of
        order: its read-ahead would hold a mapping that nothing uses until the next step)."""
        g.active += 1
        if g.real is None:
            self.offload_others(keep=[g])
            self.onload(g)
        if top:
            self.prefetch_after(g, 1)

    def root_pre(self, module, args) -> None:
        self.offload_others()  # what an optimizer step onloaded (written back if changed)
        if self.order is None:
            self.seen = []
        elif self.order:
            self.start(self.order[: self.config.prefetch])
        if torch.is_grad_enabled():
            ctx = torch.autograd.graph.saved_tensors_hooks(*self._pack_unpack())
            ctx.__enter__()
            self.saved_hooks.append(ctx)
        else:
            self.saved_hooks.append(None)

    def root_post(self, module, args, output) -> None:
        ctx = self.saved_hooks.pop() if self.saved_hooks else None
        if self.seen is not None:
            self.order, self.seen = list(self.seen), None
        if ctx is not None:
            ctx.__exit__(None, None, None)
            if self.order:  # the backward starts from the last groups
                self.prefetch_after(self.order[-1], -1)
        else:
            self.offload_others()

    def _pack_unpack(self):
        outer = _compat.outer_saved_tensors_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor):
            hit = self.by_storage.get(_key(t)) if t.layout == torch.strided else None
            if hit is not None and hit[0].real is not None and hit[0].real[hit[1]].dtype == t.dtype:
                g, i = hit
                return _Ref(g, i, t.size(), t.stride(), t.storage_offset() - g.real[i].storage_offset())
            return ("outer", outer_pack(t)) if outer_pack is not None else t

        def unpack(x):
            if isinstance(x, _Ref):
                return self.rebuild(x)
            if isinstance(x, tuple) and len(x) == 2 and x[0] == "outer":
                return outer_unpack(x[1])
            return x

        return pack, unpack

    def rebuild(self, ref: _Ref) -> torch.Tensor:
        """A saved view of an offloaded weight, for the backward: its group onloaded (reverse order)."""
        g = ref.group
        with self.lock:
            if g.real is None:
                ahead = self.ahead_of(g, -1)
                self.offload_others(keep=[g, *ahead])  # first: the groups not needed go before more come in
                self.start(ahead)
                self.onload(g)
            base = g.real[ref.index]
        return base.as_strided(ref.size, ref.stride, base.storage_offset() + ref.offset)

    def state_dict_hook(self, member: nn.Module, entries):
        def hook(module, state_dict, prefix, local_metadata):
            read: dict[int, list[torch.Tensor]] = {}  # each group's file read once per state_dict()
            for name, g, i in entries:
                key = prefix + name
                if g.real is None and key in state_dict and state_dict[key] is not g.params[i]:
                    if g.gid not in read:
                        read[g.gid] = self.store.read(g.gid)
                    state_dict[key] = read[g.gid][i]

        return hook

    def load_pre_hook(self, groups: list[_Group]):
        def hook(*args, **kwargs):
            for g in groups:
                self.onload(g)

        return hook

    def optimizer_pre(self, optimizer, args, kwargs) -> None:
        if any((_owner(p) or (None,))[0] is self for group in optimizer.param_groups for p in group["params"]):
            self.onload_all()

    # -- install and remove --------------------------------------------------------------------------------
    def install(self) -> None:
        for g in self.groups:
            for p in g.params:
                _OWNER[id(p)] = (weakref.ref(p), self, g)
            for p in g.params:
                p.data = self.placeholder(p)
        h = self.hooks
        h.append(self.model.register_forward_pre_hook(self.root_pre))
        h.append(self.model.register_forward_hook(self.root_post, always_call=True))
        entries: dict[int, tuple[nn.Module, list]] = {}
        for g in self.groups:
            for m in g.modules:
                h.append(m.register_forward_pre_hook(lambda mod, args, g=g: self.enter(g, True)))
                h.append(m.register_forward_hook(lambda mod, a, o, g=g: _leave(g), always_call=True))
                for sub in m.modules() if g.block else ():
                    if sub is not m and any(True for _ in sub.parameters(recurse=False)):
                        h.append(sub.register_forward_pre_hook(lambda mod, args, g=g: self.enter(g, False)))
                        h.append(sub.register_forward_hook(lambda mod, a, o, g=g: _leave(g), always_call=True))
                h.append(m.register_load_state_dict_pre_hook(self.load_pre_hook([g])))
                names = {id(p): n for n, p in m.named_parameters()}
                listed = entries.setdefault(id(m), (m, []))[1]
                listed += [(names[id(p)], g, i) for i, p in enumerate(g.params) if id(p) in names]
        for m, listed in entries.values():
            h.append(m.register_state_dict_post_hook(self.state_dict_hook(m, listed)))
        h.append(_optim.register_optimizer_step_pre_hook(self.optimizer_pre))

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        while self.saved_hooks:
            ctx = self.saved_hooks.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
        with self.lock:
            for pending in list(self.prefetched.values()):
                try:
                    pending.result()  # let the reader finish before the files go
                except OSError:
                    pass  # a failed read ahead: the group is read again below
            self.prefetched.clear()
            restored = []
            for g in self.groups:
                current = [p.data for p in g.params] if g.real is not None else None
                restored.append(self.store.restore(g.gid, current))
            for g, tensors in zip(self.groups, restored, strict=True):
                for p, t in zip(g.params, tensors, strict=True):
                    p.data = t
                    _OWNER.pop(id(p), None)
                g.real = None
            self.by_storage.clear()
        self.store.close()


def _return_freed_memory() -> None:
    """Hand the weights just freed back to the operating system, so RSS drops now: glibc keeps freed blocks
    below its (adaptive) mmap threshold in its heap until ``malloc_trim``. Elsewhere nothing."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def _leave(g: _Group) -> None:
    g.active = max(0, g.active - 1)


@dataclass(frozen=True)
class _Ref:
    """What autograd keeps of a saved view of an offloaded weight: where it lies in its group."""

    group: _Group
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@contextlib.contextmanager
def onloaded(params: nn.Module | Iterable[torch.Tensor], *, writes: bool = False) -> Iterator[None]:
    """Inside, every offloaded group holding one of ``params`` (or a model's) has its real weights in place;
    on exit they are offloaded again, written back if changed (``writes=True``: always, for writes through
    ``p.data`` that no version counter sees). Nothing for parameters no ``Offload`` holds.

    Example:
        >>> with onloaded(model):
        ...     total = sum(p.sum() for p in model.parameters())
    """
    if not _OWNER:  # nothing is offloaded: no parameter to look up (the EMA update enters this every step)
        yield
        return
    if isinstance(params, nn.Module):
        params = params.parameters()
    groups: dict[int, tuple[_Offloader, _Group]] = {}
    for p in params:
        owner = _owner(p)
        if owner is None:
            continue
        if owner[1].real is None:
            groups.setdefault(id(owner[1]), owner)
        elif writes:  # onloaded already: make its next offload write it back
            owner[1].versions = [-1] * len(owner[1].params)
    for o, g in groups.values():
        o.onload(g)
    try:
        yield
    finally:
        for o, g in groups.values():
            o.offload(g, force_write=writes)
