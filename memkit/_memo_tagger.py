"""The tagger of block memoization (see :mod:`memkit._memo`): each event of a probe's step tagged with the block it
belongs to, as the tracker appends it, for :mod:`memkit._splice` to repeat the middle block's."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import _torch_compat as _compat
from ._memo import _AGG, _FORWARD, Unsupported, stands_for
from .memory.events import ALLOC, FREE


class _Rows(list):
    """The tracker's event rows, each tagged as it is appended."""

    __slots__ = ("tagger",)

    def append(self, row: tuple) -> None:
        list.append(self, row)
        self.tagger.tag(row)


class Tagger:
    """Tags each event of a probe with the block it belongs to (see the module docstring): installed on a running
    tracker by :meth:`install`, read by :func:`splice`."""

    def __init__(self, lists: list[tuple[str, int, nn.ModuleList]], period: int = 1):
        self.lists = lists
        self.period = period  # of the checkpointing pattern: the probe's middle repeats it (memkit._memo_period)
        self.block: dict[int, tuple[int, int]] = {}
        self.inside: set[int] = set()
        self.tensor_owner: dict[int, tuple[int, int]] = {}  # id(parameter or buffer) -> block
        for li, (_, _, blocks) in enumerate(lists):
            for b, block in enumerate(blocks):
                self.block[id(block)] = (li, b)
                self.inside.update(id(m) for m in block.modules())
                for t in (*block.parameters(), *block.buffers()):
                    self.tensor_owner[id(t)] = (li, b)
        self.tags: list[Any] = []
        self.epochs: list[int] = []  # per event: how many ops had run when it was appended
        self.epoch = 0
        self.owner: dict[int, Any] = {}  # storage key -> block (or None)
        self.base: dict[int, Any] = {}  # baseline storage key -> its tracker entry
        self.base_owner: dict[int, tuple[int, int]] = {}
        self.stack: list[tuple[int, int]] = []
        self.inputs: list[tuple] = []  # the arguments each block on the stack was called with
        self.sticky: tuple[int, int] | None = None
        self.node: dict[int, tuple[int, int]] = {}  # autograd node sequence number -> block
        self.op_owner: Any = None
        self.out_owner: dict[int, Any] = {}
        self.handles: list[Any] = []
        self.tracker = None
        # an EMA's shadows: the block of each shadow's storage that holds one block's shadows alone, and, for a
        # storage holding the shadows of several blocks (one buffer for all), its bytes and what the blocks the probe
        # leaves out add to them
        self.mirror_owner: dict[int, tuple[int, int]] = {}
        self.grown: dict[int, tuple[int, int]] = {}  # storage key -> (its bytes in the probe, the bytes added)
        self.shadows: dict[int, tuple[list[int], list[Any]]] = {}  # such a storage -> where each shadow starts, whose
        self.kept: dict[int, tuple[int, str]] = {}  # host state from before the step: storage key -> (bytes, category)
        self.kept_events = 0  # the tracker's host-state events when the tagger was installed (the baseline's)

    # ---- installing -----------------------------------------------------------------------------------------
    def install(
        self, tracker, optimizer: torch.optim.Optimizer | None, model: nn.Module | None = None, handle: Any = None
    ) -> None:
        """Tag ``tracker``'s events from now on (it has registered the baseline, and recorded nothing yet);
        ``handle``: the optimizations applied to ``model`` (an EMA's shadows are per-parameter state)."""
        from torch.nn.modules import module as nn_module

        if tracker.log.rows:
            raise RuntimeError("the probe's tracker has recorded events before the tagger was installed")
        self.tracker = tracker
        self.kept_events = len(tracker._kept_events)
        self.kept = {key: (n, tracker._kept_category[ident]) for key, (n, _, ident) in tracker._kept.items()}
        self._mirror(model, handle)
        rows = _Rows()
        rows.tagger = self
        tracker.log.rows = rows
        self.base = {k: e for k, e in tracker._live.items() if e.event < 0}
        if any(key not in self.base and key not in self.kept for key in self.grown):
            raise Unsupported("an EMA's buffer of several blocks' shadows is not among the step's baseline storages")
        owned = self._owned_tensors(optimizer)
        for key in self.base:
            if key in owned:
                self.base_owner[key] = owned[key]
        self.owner.update(self.base_owner)
        record = tracker._record_outputs

        def record_outputs(func, args, kwargs, out, phase):
            self._op(func, args, out)
            record(func, args, kwargs, out, phase)

        tracker._record_outputs = record_outputs
        self.handles.append(nn_module.register_module_forward_pre_hook(self._pre))
        for _, _, blocks in self.lists:
            for block in blocks:
                self.handles += [
                    # first, before hooks that gather the block's parameters (FSDP's) or replace its inputs
                    block.register_forward_pre_hook(self._block_pre, with_kwargs=True, prepend=True),
                    block.register_forward_hook(self._block_post, with_kwargs=True, always_call=True),
                ]

    def _mirror(self, model: nn.Module | None, handle: Any) -> None:
        """Attribute an EMA's shadows to blocks: a shadow is its parameter's. The shadows are views of one buffer
        per dtype (each padded to 512 bytes for the CUDA allocator): a buffer's bytes are a sum over parameters,
        and each middle block adds to the full model's what the probe's middle blocks take of it (the bytes from the
        start of each of their shadows to the next shadow's). Each shadow's staging weight is the blocks its block
        stands for (:attr:`memkit.optimizations.EMAState.stands_for`)."""
        from .memory.tracker import _plain

        full = {li: n for li, (_, n, _) in enumerate(self.lists)}
        sizes = {li: len(blocks) for li, (_, _, blocks) in enumerate(self.lists)}
        for part in getattr(handle, "parts", ()):
            ema = getattr(part, "ema", None)
            if ema is None:
                continue
            params = list(model.parameters()) if model is not None else []
            if [p.shape for p in params] != [s.shape for s in ema.shadow_params]:
                raise Unsupported("an EMA's shadows are not the model's parameters, in order")
            owners = [self.tensor_owner.get(id(p)) for p in params]
            ema.stands_for = [
                stands_for(o[1], full[o[0]], sizes[o[0]], self.period) if o is not None else 1 for o in owners
            ]
            pieces: dict[int, tuple[int, list[tuple[int, Any]]]] = {}
            for shadow, owner in zip(ema.shadow_params, owners, strict=True):
                for t in _plain(shadow):
                    storage = t.untyped_storage()
                    entry = pieces.setdefault(storage._cdata, (storage.nbytes(), []))
                    entry[1].append((t.storage_offset() * t.element_size(), owner))
            for key, (nbytes, starts) in pieces.items():
                if len({o for _, o in starts}) == 1:  # one block's shadows (or none's) alone: the block's storage
                    if starts[0][1] is not None:
                        self.mirror_owner[key] = starts[0][1]
                    continue
                starts.sort(key=lambda s: s[0])
                self.shadows[key] = ([s for s, _ in starts], [o for _, o in starts])
                took: dict[Any, int] = {}
                for (start, owner), end in zip(starts, [s for s, _ in starts[1:]] + [nbytes], strict=True):
                    took[owner] = took.get(owner, 0) + end - start
                added = 0
                for li, n in full.items():
                    middle = took.get((li, 1), 0)
                    if any(took.get((li, b), 0) != middle for b in range(2, sizes[li] - 1)):
                        raise Unsupported(f"the middle blocks of {self.lists[li][0]!r} take different EMA bytes")
                    added += (n - sizes[li]) * middle
                self.grown[key] = (nbytes, added)

    def shadow_block(self, t: torch.Tensor) -> Any:
        """The block of the EMA shadow ``t`` is (or is a slice of), in a buffer of several blocks' shadows."""
        import bisect

        starts, owners = self.shadows[t.untyped_storage()._cdata]
        return owners[bisect.bisect_right(starts, t.storage_offset() * t.element_size()) - 1]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _owned_tensors(self, optimizer) -> dict[int, tuple[int, int]]:
        """Every block's parameters, buffers, quant states, gradients and optimizer state, by storage key: the blocks
        that own them now (a key names another storage once its own dies: see :class:`OwnedNow`)."""
        return {key: tag for key, (tag, _) in self._owned_refs(optimizer).items()}

    def _owned_refs(self, optimizer) -> dict[int, tuple[tuple[int, int], Any]]:
        """:meth:`_owned_tensors` with a weak reference to each tensor (None: a mirror's storage, the EMA's)."""
        keys: dict[int, tuple[tuple[int, int], Any]] = {}

        def own(t: torch.Tensor, tag: tuple[int, int]) -> None:
            ref = weakref.ref(t)
            keys.update(dict.fromkeys(_storages(t), (tag, ref)))

        for li, (_, _, blocks) in enumerate(self.lists):
            for b, block in enumerate(blocks):
                # bitsandbytes' quant states (absmax, code; LLM.int8's row scales) sit beside each quantized weight
                for t in (*block.parameters(), *block.buffers(), *_quant_states(block)):
                    own(t, (li, b))
                    grad = getattr(t, "grad", None)
                    if grad is not None:
                        own(grad, (li, b))
        keys.update({key: (tag, None) for key, tag in self.mirror_owner.items()})
        if optimizer is not None:
            for p, state in optimizer.state.items():
                owner = self.tensor_owner.get(id(p))
                if owner is None:  # a parameter the optimizer holds as its local shard (FSDP): by its storage
                    owner = next((keys[k][0] for k in _storages(p) if k in keys), None)
                if owner is not None:
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            own(v, owner)
        return keys

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _pre(self, module, args) -> None:
        if id(module) not in self.inside and not self.stack:
            self.sticky = None  # a module outside the blocks: the loop over a block list is over

    def _block_pre(self, module, args, kwargs) -> None:
        self.stack.append(self.block[id(module)])
        self.inputs.append((args, kwargs))  # as the caller gave them: later pre-hooks may wrap them (FSDP)

    def _block_post(self, module, args, kwargs, output) -> None:
        tag = self.block[id(module)]
        called = (args, kwargs)
        if self.stack:
            self.stack.pop()
            called = self.inputs.pop()  # the nodes of FSDP's input wrapping are the block's own
        if self.stack:
            return
        self.sticky = tag
        if torch.is_grad_enabled() and not _compat.graph_task_running():
            self._map_nodes(tag, called, output)

    def _map_nodes(self, tag, args, output) -> None:
        """The autograd nodes this block's forward made: everything reachable from its outputs' nodes before
        its inputs' nodes."""
        stop = {t.grad_fn for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        todo = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        node_map = self.node
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or node in stop or node in seen:
                continue
            seen.add(node)
            seq = node._sequence_nr()
            if seq in node_map:
                continue
            if type(node).__name__ == "AccumulateGrad":
                continue
            node_map[seq] = tag
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)

    def _op(self, func, args, out) -> None:
        """The owner of what an op outside any block's forward or backward allocates (set before the op's
        events are appended)."""
        self.out_owner = {}
        self.epoch += 1
        if self.stack or _compat.graph_task_running():
            self.op_owner = None
            return
        owner = self.owner
        found = None
        for a in args:  # an aten op's arguments: tensors, lists of tensors (foreach), scalars
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    o = owner.get(t.untyped_storage()._cdata)
                    if o is not None and o != found:
                        found = o if found is None else _AGG
        self.op_owner = found
        if found is _AGG and func.__name__.startswith("_foreach_") and isinstance(out, (list, tuple)):
            first = next((a for a in args if isinstance(a, (list, tuple)) and len(a) == len(out)), None)
            if first is not None:
                for t, src in zip(out, first, strict=True):
                    if isinstance(t, torch.Tensor) and isinstance(src, torch.Tensor):
                        self.out_owner[t.untyped_storage()._cdata] = owner.get(src.untyped_storage()._cdata)

    # ---- tagging --------------------------------------------------------------------------------------------
    def _context(self, row: tuple):
        if self.stack:
            return self.stack[-1]
        if _compat.graph_task_running():
            node = _compat.current_autograd_node()
            if node is None:
                return None
            if type(node).__name__ == "AccumulateGrad":
                return self.tensor_owner.get(id(node.variable))
            return self.node.get(node._sequence_nr())
        if row[4] == _FORWARD:  # between blocks: the block before; after the last one, outside the blocks
            return self.sticky
        if row[1] == FREE:
            owner = self.owner.get(row[8])
            op = self.op_owner
            if (
                op is not None
                and op is not _AGG
                and owner is not None
                and op[0] == owner[0]
                and abs(op[1] - owner[1]) == 1
            ):
                # the neighbour block's storage a variable held until the op that just ran for this block replaced
                # it (a per-parameter optimizer loop): freed in this block's work
                return op
            return owner
        return self.out_owner.get(row[8], self.op_owner)

    def tag(self, row: tuple) -> None:
        tag = self._context(row)
        self.tags.append(tag)
        self.epochs.append(self.epoch)
        if row[8] == -1:
            return
        if row[1] == ALLOC:
            self.owner[row[8]] = tag if tag is not _AGG else None
        else:  # the key may name another storage later
            self.owner.pop(row[8], None)


def _storages(t: torch.Tensor) -> list[int]:
    from .memory.tracker import _plain  # a DTensor's memory is its local shard's

    return [inner.untyped_storage()._cdata for inner in _plain(t)]


class OwnedNow:
    """The blocks owning storages, by key, as :meth:`Tagger._owned_tensors` found them, asked later: a key whose
    tensor died (a gradient ``zero_grad`` dropped) or moved to another storage (a weight layerwise casting
    re-cast) names no block, though the allocator may have given its address to a new storage since (which an op
    outside the blocks then writes: counted as one block's, it would be counted ``n - 3`` times, or once, by where
    the process's allocator put it)."""

    def __init__(self, refs: dict[int, tuple[tuple[int, int], Any]]):
        self.refs = refs

    def get(self, key: int) -> tuple[int, int] | None:
        entry = self.refs.get(key)
        if entry is None:
            return None
        tag, ref = entry
        if ref is not None:
            t = ref()
            if t is None or key not in _storages(t):
                return None
        return tag


def _quant_states(block: nn.Module) -> list[torch.Tensor]:
    from .optimizations._bnb import state_tensors

    return state_tensors(block)
