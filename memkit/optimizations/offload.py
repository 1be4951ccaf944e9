"""Group offloading: keep a model's weights off the compute device (in CPU memory or on disk) except the groups
in use, loading each group just before it runs and a few ahead of it in the background.

Saves: the weights of every offloaded group but the one computing and the ``prefetch`` groups loaded ahead; a
model of N blocks at ``blocks_per_group=1`` keeps about ``(1 + prefetch) / N`` of its block weights resident (the
layers outside the blocks, embedders and final layers, are groups of one layer each; only the model's own
parameters and one-element ones stay). Costs: one transfer per group per forward (and one
per backward in training), hidden behind compute when a group's bytes over the bandwidth take less time than
its FLOPs over the throughput (prefetch makes that overlap); in training ``optimizer.step()`` onloads every
group (the update needs the weights with their gradients and states) and changed weights are written back
before the group is offloaded again, at the next forward. ``to="disk"`` maps each group's file into memory
once (copy-on-write) and gives its pages back when the group is dropped: nothing is copied (the weights are the
page cache's pages, in RSS only while the group is in use), and a group written back gets a new mapping, so
whatever still holds a tensor of the old one (autograd, the caller) keeps its values. Does nothing for
``to="cpu"`` when the model computes on the CPU (its weights are in CPU memory already).

Training is correct: the tensors autograd saves that are views of offloaded weights are kept as references and
rebuilt in the backward from the group, onloaded again in reverse order; ``state_dict()`` gives real values while
offloaded; ``load_state_dict`` and ``memkit.EMA`` onload what they read or write. The same ``nn.Parameter``
objects stay in the model: an offloaded one holds a zero-stride placeholder of its shape, dtype and device (it
reads as zeros; writing to it raises); code that reads weights directly can use :func:`onloaded`.

diffusers' ``apply_group_offloading(offload_to_disk_path=...)`` (PR #11682) gives wrong gradients in training and
wrong ``state_dict()`` values while offloaded, and reuses another model's files given the same folder;
:mod:`memkit.optimizations.offload_check` shows it side by side.

Example:
    >>> with memkit.Offload(to="disk", prefetch=1).apply(model):
    ...     model(**inputs)                # peak RSS: ~(1 + prefetch) blocks of weights
    >>> memkit.estimate("flux", optimizations=[memkit.Offload(to="cpu")], device="cuda", mode="inference")
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..blocks import find_blocks
from ..handle import Handle
from ..memory.placement import note_disk_memory, note_host_memory, planned_device
from ._common import planned_cuda as _planned_cuda
from ._common import warn_once as _warn_once
from ._offload_store import DiskStore, FakeDiskStore, HostStore, OffloadError
from ._offloader import _Group, _Offloader, _owner, _return_freed_memory, onloaded

__all__ = ["Offload", "OffloadError", "groups_of", "onloaded"]

_TO = ("cpu", "disk")
_GROUPS = ("block", "leaf")


_CPU_MOVES = False
"""Tests set this to run ``to="cpu"`` on the CPU through the copying path (the one CUDA takes)."""


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def groups_of(model: nn.Module, group: str = "block", blocks_per_group: int = 1) -> list[tuple[str, list[nn.Module]]]:
    """The groups ``Offload`` makes: (name, modules). ``"block"``: the transformer blocks (as
    :class:`memkit.Checkpointing` finds them), ``blocks_per_group`` consecutive ones a group, then each module
    outside the blocks that holds parameters of its own (embedders, final layers), one a group; ``"leaf"``: each
    module that holds parameters of its own. The model's own parameters (held by no submodule) are a group only at
    leaf level.

    Example:
        >>> [name for name, _ in groups_of(memkit.load_model("flux"))][:3]
        ['transformer_blocks.0', 'single_transformer_blocks.0', 'time_text_embed.timestep_embedder.linear_1']
    """
    return [(name, modules) for name, modules, _ in _found(model, group, blocks_per_group)]


def _owns(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False))


def _found(model: nn.Module, group: str, blocks_per_group: int) -> list[tuple[str, list[nn.Module], bool]]:
    """``groups_of``'s groups, each with whether it is blocks (all their parameters, their layers hooked too)."""
    if group == "leaf":
        return [(n, [m], False) for n, m in model.named_modules() if _owns(m)]
    blocks = find_blocks(model)
    out = []
    for i in range(0, len(blocks), blocks_per_group):
        chunk = blocks[i : i + blocks_per_group]
        name = chunk[0][0] if len(chunk) == 1 else f"{chunk[0][0]}..{chunk[-1][0]}"
        out.append((name, [m for _, m in chunk], True))
    inside = {id(sub) for _, m in blocks for sub in m.modules()}
    out += [(n, [m], False) for n, m in model.named_modules() if m is not model and id(m) not in inside and _owns(m)]
    return out


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Keep a model's weights in CPU memory (``to="cpu"``) or on disk (``to="disk"``) except the groups in use.

    The onload device is where the model computes. On CUDA ``to="cpu"`` keeps the weights in pinned CPU memory
    and copies each group in before it runs; on the CPU it moves nothing (a warning says so) and ``to="disk"``
    keeps a safetensors file per group in a fresh folder, mapping a group into RAM only while it runs or is
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
    transfers). At block level the layers outside the blocks (embedders, final layers) are groups of one layer
    each; parameters the model holds itself (no submodule) and one-element ones stay in memory."""
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
        model bit for bit (the same ``Parameter`` objects), deleting any files. ``handle.folder`` is the files'
        folder (``to="disk"``), ``handle.offloader`` the live state (groups, store, bytes read)."""
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
        found = _found(model, self.group, self.blocks_per_group)
        owners: dict[int, set[int]] = {}
        for i, (_, modules, block) in enumerate(found):
            for m in modules:
                for p in m.parameters(recurse=block):
                    owners.setdefault(id(p), set()).add(i)
        groups = []
        for name, modules, block in found:
            named, seen = [], set()
            for m in modules:
                for p in m.parameters(recurse=block):
                    # shared with another group, or one element (a placeholder would be writable): stays resident
                    if id(p) in seen or len(owners[id(p)]) > 1 or p.numel() <= 1:
                        continue
                    seen.add(id(p))
                    named.append((names[id(p)], p))
            if named:
                groups.append(_Group(len(groups), name, modules, named, block=block))
        if not groups:
            raise ValueError(f"model ({type(model).__name__}) has no parameters in any {self.group!r} group to offload")
        return groups

    @staticmethod
    def _note_memory(store, groups: list[_Group]) -> None:
        if planned_device() is None:
            return
        if isinstance(store, HostStore):
            note_host_memory("parameter", [t for ts in store.host.values() for t in ts])
        else:
            note_disk_memory(sum(g.nbytes for g in groups))

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
