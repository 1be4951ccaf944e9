"""Group offloading: keep a model's weights off the compute device (in CPU memory or on disk) except the groups
in use, loading each group just before it runs and a few ahead of it in the background.

Saves: the weights of every offloaded group but the one computing and the ``prefetch`` groups loaded ahead; a
model of N blocks at ``blocks_per_group=1`` keeps about ``(1 + prefetch) / N`` of its block weights resident
(embedders, final norms and one-element parameters stay). Costs: one transfer per group per forward (and one
per backward in training), hidden behind compute when a group's bytes over the bandwidth take less time than
its FLOPs over the throughput (prefetch makes that overlap); in training ``optimizer.step()`` onloads every
group (the update needs the weights with their gradients and states) and changed weights are written back
before the group is offloaded again, at the next forward. Does nothing for ``to="cpu"`` when the model computes
on the CPU (its weights are in CPU memory already).

Training is correct: the tensors autograd saves that are views of offloaded weights are kept as references and
rebuilt in the backward from the group, onloaded again in reverse order; ``state_dict()`` gives real values while
offloaded; ``load_state_dict`` and ``memkit.EMA`` onload what they read or write. The same ``nn.Parameter``
objects stay in the model: an offloaded one holds a zero-stride placeholder of its shape, dtype and device (it
reads as zeros; writing to it raises). Apply it after :class:`memkit.EMA` (the registry's order does).

diffusers' ``apply_group_offloading(offload_to_disk_path=...)`` (PR #11682) gives wrong gradients in training and
wrong ``state_dict()`` values while offloaded, and reuses another model's files given the same folder;
:mod:`memkit.optimizations.offload_check` shows it side by side.

Example:
    >>> with memkit.Offload(to="disk", prefetch=1).apply(model):
    ...     model(**inputs)                # peak RSS: ~(1 + prefetch) blocks of weights
    >>> memkit.estimate("flux", optimizations=[memkit.Offload(to="cpu")], device="cuda", mode="inference")
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.optim import optimizer as _optim

from ..handle import Handle
from ._offload_store import DiskStore, FakeDiskStore, HostStore, OffloadError
from .checkpointing import diffusers_blocks, module_list_blocks

__all__ = ["Offload", "OffloadError", "groups_of", "onloaded"]

_TO = ("cpu", "disk")
_GROUPS = ("block", "leaf")
_warned: set[str] = set()
_OWNER: dict[int, tuple[weakref.ref, _Offloader, _Group]] = {}  # id(parameter) -> (it, its offloader, group)


def _owner(p: object) -> tuple[_Offloader, _Group] | None:
    hit = _OWNER.get(id(p))
    return (hit[1], hit[2]) if hit is not None and hit[0]() is p else None


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _planned_cuda() -> bool:
    estimation = sys.modules.get("memkit.estimation")  # not imported here: it would pull in diffusers
    return estimation is not None and estimation.planned_device() == "cuda"


_CPU_MOVES = False
"""Tests set this to run ``to="cpu"`` on the CPU through the copying path (the one CUDA takes)."""


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Group:
    __slots__ = ("gid", "name", "modules", "names", "params", "real", "versions", "keys", "active")

    def __init__(self, gid: int, name: str, modules: list[nn.Module], named: list[tuple[str, nn.Parameter]]):
        self.gid, self.name, self.modules = gid, name, modules
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.real: list[torch.Tensor] | None = None  # the onloaded tensors; None while offloaded
        self.versions: list[int] = []
        self.keys: list[int] = []
        self.active = 0  # members whose forward is running

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def groups_of(model: nn.Module, group: str = "block", blocks_per_group: int = 1) -> list[tuple[str, list[nn.Module]]]:
    """The groups ``Offload`` makes: (name, modules). ``"block"``: the transformer blocks (as
    :class:`memkit.Checkpointing` finds them), ``blocks_per_group`` consecutive ones a group; ``"leaf"``: each
    module that holds parameters of its own.

    Example:
        >>> [name for name, _ in groups_of(memkit.load_model("flux"))]
        ['transformer_blocks.0', 'single_transformer_blocks.0']
    """
    if group == "leaf":
        return [(n, [m]) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    if getattr(model, "_supports_gradient_checkpointing", False):
        blocks = diffusers_blocks(model)
    else:
        blocks = module_list_blocks(model)
    out = []
    for i in range(0, len(blocks), blocks_per_group):
        chunk = blocks[i : i + blocks_per_group]
        name = chunk[0][0] if len(chunk) == 1 else f"{chunk[0][0]}..{chunk[-1][0]}"
        out.append((name, [m for _, m in chunk]))
    return out


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

    def offload_others(self, keep: Iterable[_Group] = ()) -> None:
        keep = {id(g) for g in keep}
        for g in self.groups:
            if g.real is not None and not g.active and id(g) not in keep:
                self.offload(g)

    def onload_all(self) -> None:
        for g in self.groups:
            self.onload(g)

    def prefetch_after(self, g: _Group, step: int) -> list[_Group]:
        """Start loading the ``prefetch`` groups after ``g`` in the learned order (``step=-1``: before it)."""
        if self.order is None or not self.config.prefetch or g not in self.order:
            return []
        i = self.order.index(g)
        window = range(i + step, i + step * (self.config.prefetch + 1), step)
        ahead = [self.order[j] for j in window if 0 <= j < len(self.order)]
        with self.lock:
            for h in ahead:
                if h.real is None and h.gid not in self.prefetched:
                    self.prefetched[h.gid] = self.store.prefetch(h.gid)
        return ahead

    # -- hooks ---------------------------------------------------------------------------------------------
    def enter(self, g: _Group, top: bool) -> None:
        """A module of ``g`` starts its forward (``top``: a block itself; else one of its layers, which a model may
        call outside the block, as DiT calls block 0's embedder): the groups not in use go, ``g`` comes, the
        next ones start loading."""
        g.active += 1
        if g.real is None:
            self.offload_others(keep=[g])
            self.onload(g)
            top = True
        if top:
            self.prefetch_after(g, 1)

    def root_pre(self, module, args) -> None:
        self.offload_others()  # what an optimizer step onloaded (written back if changed)
        if self.order is None:
            self.seen = []
        elif self.order:
            with self.lock:
                for h in self.order[: self.config.prefetch]:
                    if h.real is None and h.gid not in self.prefetched:
                        self.prefetched[h.gid] = self.store.prefetch(h.gid)
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
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
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
                ahead = self.prefetch_after(g, -1)
                self.offload_others(keep=[g, *ahead])
                self.onload(g)
            base = g.real[ref.index]
        return base.as_strided(ref.size, ref.stride, base.storage_offset() + ref.offset)

    def state_dict_hook(self, member: nn.Module, entries):
        def hook(module, state_dict, prefix, local_metadata):
            for name, g, i in entries:
                key = prefix + name
                if g.real is None and key in state_dict and state_dict[key] is not g.params[i]:
                    state_dict[key] = self.store.read(g.gid)[i]

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
                for sub in m.modules() if self.config.group == "block" else ():
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
                pending.result()
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


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Keep a model's weights in CPU memory (``to="cpu"``) or on disk (``to="disk"``) except the groups in use.

    The onload device is where the model computes. On CUDA ``to="cpu"`` keeps the weights in pinned CPU memory
    and copies each group in before it runs; on the CPU it moves nothing (a warning says so) and ``to="disk"``
    keeps a safetensors file per group in a fresh folder, reading a group into RAM only while it runs or is
    prefetched, so peak RSS drops. Trade-off: weight memory falls to ``(1 + prefetch)`` groups for one transfer of
    every group per forward (and per backward); ``optimizer.step()`` onloads every group and changed weights are
    written back (to the file) before the group is offloaded again.

    Example:
        >>> handle = memkit.Offload(to="disk").apply(model)
        >>> model(**inputs)                  # the same outputs, a fraction of the weights resident
        >>> handle.remove()                  # weights back in memory, files deleted
    """

    to: Literal["cpu", "disk"] = "cpu"
    """Where offloaded weights live: ``"cpu"`` (CPU memory; a no-op on a model that computes on the CPU) or
    ``"disk"`` (a safetensors file per group)."""
    group: Literal["block", "leaf"] = "block"
    """What a group is: ``"block"``: ``blocks_per_group`` consecutive transformer blocks (the modules
    :class:`memkit.Checkpointing` numbers); ``"leaf"``: each module holding parameters of its own (finest, most
    transfers). Parameters outside every group (embedders, final layers) stay in memory."""
    blocks_per_group: int = 1
    """Blocks per group with ``group="block"`` (>= 1): more means fewer, larger transfers and more memory."""
    path: str | os.PathLike | None = None
    """With ``to="disk"``: the folder under which a fresh ``memkit-offload-*`` folder is made for this model
    (default: the system's temporary folder); it is deleted by ``remove()``."""
    prefetch: int = 1
    """Groups loaded ahead of the one computing, in the background (>= 0; 0 loads each group when it is
    needed). The order is learned on the first forward; the backward prefetches in reverse."""

    def __post_init__(self) -> None:
        if self.to not in _TO:
            raise ValueError(f"to must be one of {list(_TO)}, got {self.to!r}")
        if self.group not in _GROUPS:
            raise ValueError(f"group must be one of {list(_GROUPS)}, got {self.group!r}")
        for name in ("blocks_per_group", "prefetch"):
            value, low = getattr(self, name), 1 if name == "blocks_per_group" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.path is not None:
            if self.to != "disk":
                raise ValueError(f"path is only used with to='disk', got path={self.path!r} with to={self.to!r}")
            if not isinstance(self.path, (str, os.PathLike)):
                raise ValueError(f"path must be a folder (str or os.PathLike) or None, got {self.path!r}")

    def apply(self, model: nn.Module) -> Handle:
        """Offload ``model``'s groups; returns the handle whose ``remove()`` onloads everything and restores the
        model bit for bit (the same ``Parameter`` objects), deleting any files."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if any(_owner(p) is not None for p in model.parameters()):
            raise ValueError("model is offloaded already: remove() the first Offload's handle before applying another")
        params = [p for p in model.parameters()]
        device = params[0].device if params else torch.device("cpu")
        fake = bool(params) and _is_fake(params[0])
        if self.to == "cpu" and device.type == "cpu" and not (_planned_cuda() or _CPU_MOVES):
            _warn_once(
                "Offload(to='cpu'): the model computes on the CPU, where its weights are already, so nothing moves; "
                "use to='disk' to lower the RAM it takes"
            )
            return Handle(lambda: None, name=str(self))
        groups = self._groups(model)
        if self.to == "cpu":
            store = HostStore(device)
        else:
            store = FakeDiskStore(device) if fake else DiskStore(device, self.path)
        try:
            for g in groups:
                store.save(g.gid, g.names, [p.detach() for p in g.params])
        except BaseException:
            store.close()
            raise
        self._note_memory(store, groups)
        offloader = _Offloader(model, self, groups, store, device)
        offloader.install()
        if not fake:
            _return_freed_memory()
        handle = Handle(offloader.remove, name=str(self))
        handle.offloader = offloader
        handle.folder = getattr(store, "folder", None)
        return handle

    def _groups(self, model: nn.Module) -> list[_Group]:
        names = {id(p): n for n, p in model.named_parameters()}
        found = groups_of(model, self.group, self.blocks_per_group)
        owners: dict[int, set[int]] = {}
        for i, (_, modules) in enumerate(found):
            for m in modules:
                for p in m.parameters(recurse=self.group == "block"):
                    owners.setdefault(id(p), set()).add(i)
        groups = []
        for name, modules in found:
            named, seen = [], set()
            for m in modules:
                for p in m.parameters(recurse=self.group == "block"):
                    # shared with another group, or one element (a placeholder would be writable): stays resident
                    if id(p) in seen or len(owners[id(p)]) > 1 or p.numel() <= 1:
                        continue
                    seen.add(id(p))
                    named.append((names[id(p)], p))
            if named:
                groups.append(_Group(len(groups), name, modules, named))
        if not groups:
            raise ValueError(f"model ({type(model).__name__}) has no parameters in any {self.group!r} group to offload")
        return groups

    @staticmethod
    def _note_memory(store, groups: list[_Group]) -> None:
        estimation = sys.modules.get("memkit.estimation")
        if estimation is None or estimation.planned_device() is None:
            return
        if isinstance(store, HostStore):
            estimation.note_host_memory("parameter", [t for ts in store.host.values() for t in ts])
        else:
            estimation.note_disk_memory(sum(g.nbytes for g in groups))

    @classmethod
    def parse(cls, value: str) -> Offload:
        """The config a command-line or widget value names: ``TO[:leaf|:block][:blocks=N][:prefetch=N]``.

        Example:
            >>> memkit.Offload.parse("disk:leaf:prefetch=0")
            Offload(to='disk', group='leaf', blocks_per_group=1, path=None, prefetch=0)
        """
        if not isinstance(value, str) or not value:
            raise ValueError(f"offload value must be TO[:GROUP][:blocks=N][:prefetch=N], TO one of {list(_TO)}")
        to, *rest = value.split(":")
        kwargs: dict = {"to": to}
        for part in rest:
            key, eq, n = part.partition("=")
            if not eq and part in _GROUPS:
                kwargs["group"] = part
            elif eq and key in ("blocks", "prefetch") and n.isdigit():
                kwargs["blocks_per_group" if key == "blocks" else "prefetch"] = int(n)
            else:
                raise ValueError(
                    f"offload value must be TO[:GROUP][:blocks=N][:prefetch=N] (TO in {list(_TO)}, GROUP in "
                    f"{list(_GROUPS)}), got {value!r}"
                )
        return cls(**kwargs)

    def __str__(self) -> str:
        parts = [self.to]
        if self.group != "block":
            parts.append(self.group)
        if self.blocks_per_group != 1:
            parts.append(f"blocks={self.blocks_per_group}")
        if self.prefetch != 1:
            parts.append(f"prefetch={self.prefetch}")
        return "offload:" + ":".join(parts)
