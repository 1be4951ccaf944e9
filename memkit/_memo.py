"""Block memoization of estimates: a full-size timeline from a probe that keeps three blocks per block list.

A diffusion transformer is a few lists of identical blocks (Flux: 19 double-stream and 38 single-stream blocks),
and a fake step spends nearly all its time running them. The probe is the same model with each list cut to its
first three blocks (the first, a middle one, the last), run through the very same step under the tracker, which
tags every event with the block it happens in:

- inside a block's forward (its module hooks; a checkpointed block's recompute included): that block;
- between two blocks of a list in the forward (the loop's own code, the next block's checkpoint bookkeeping):
  the block before, until a module outside the blocks runs;
- in the backward: the block whose forward made the autograd node that runs (``AccumulateGrad``: the block whose
  parameter it is);
- elsewhere (optimizer, ``zero_grad``): the block that owns the storage (a parameter's, its gradient's, its
  optimizer state's, or a storage an op made from one; a ``_foreach`` op's i-th output from its list's i-th
  element).

The tagged events fall into *sweeps*: runs of consecutive events that go through the blocks of one list in
order (the forward, the backward in reverse, each ``_foreach`` op of the optimizer). The full timeline is the
probe's, each sweep's middle-block events repeated once per middle block of the full model, with fresh storage
keys (a free resolved to the allocation it pairs with in the full model: same block, or the neighbour at the
same distance). The baseline grows by the middle block's parameters, gradients and state per repeated block.

Byte-equal to running every block (``estimate(..., memoize=False)``) on every preset and every supported
setting (``tests/test_memo.py``). Settings whose memory is not a sum over blocks, or whose blocks differ from one
another, run every block (:func:`unsupported` says why): an EMA or offload (state kept as one buffer or off the
device), FSDP, checkpointing patterns that pick some blocks, a model without a list of identical blocks.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import _torch_compat as _compat
from .memory.events import ALLOC, COLUMNS, FREE, PHASE_CODE

PROBE = 4
"""Blocks the probe keeps of each list: the first three and the last. In the full model the first two and the
last are the probe's own, and every other block repeats the third, whose neighbours are middle blocks too."""

_FORWARD, _OTHER = PHASE_CODE["forward"], PHASE_CODE["other"]
_AGG = ("aggregate",)  # an op that reads storages of several blocks at once: its event belongs to none


class Unsupported(Exception):
    """The probe's events do not have the structure memoization relies on (the reason is the message)."""


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ``nn.ModuleList``s of ``model`` longer than the probe whose middle elements (all but the first and the
    last) are identical blocks (same class, same parameter and buffer shapes and dtypes), outermost first, none
    inside another. The first and last block may differ (SD3's last block makes no text output).

    Example:
        >>> [(name, len(blocks)) for name, blocks in block_lists(flux)]
        [('transformer_blocks', 19), ('single_transformer_blocks', 38)]
    """
    found, inside = [], set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList) and len(module) > PROBE and _identical(module):
            found.append((name, module))
            inside.update(id(m) for m in module.modules())
    return found


def _signature(block: nn.Module) -> tuple:
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (type(block), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors))


def _identical(blocks: nn.ModuleList) -> bool:
    middle = _signature(blocks[1])
    return all(_signature(b) == middle for b in list(blocks)[1:-1])


def unsupported(optimizations: Sequence[Any], parallel: Any) -> str | None:
    """Why an estimate with these settings runs every block, or None when it can be memoized."""
    from .optimizations.checkpointing import Checkpointing
    from .optimizations.feedforward import FFSplit

    if parallel is not None:  # its hooks gather and free around the blocks: spliced, FSDP's peak came out wrong
        return "FSDP gathers and frees each block's parameters in hooks the probe does not place yet"
    for o in optimizations:
        if isinstance(o, FFSplit):
            continue
        if isinstance(o, Checkpointing):
            if o.budget_bytes is not None or not isinstance(o.pattern, str) or o.pattern not in ("all", "none"):
                return f"{o} checkpoints some blocks and not others"
            if o.provider == "offload":
                return f"{o} keeps checkpoint inputs off the device"
            continue
        return f"{type(o).__name__} is not memoized (its state is not a sum over identical blocks)"
    return None


def cut(model: nn.Module, lengths: dict[str, int] | None = None) -> list[tuple[str, int, nn.ModuleList]]:
    """Cut each block list of ``model`` to its first :data:`PROBE` - 1 blocks and its last, in place; returns
    (name, full length, the list) for each. With ``lengths`` (from :func:`probe_builder`) the model is a probe
    already: its lists of those names stand for lists of those lengths."""
    if lengths is not None:
        lists = []
        for name, module in model.named_modules():
            if name in lengths:
                if not isinstance(module, nn.ModuleList) or len(module) != PROBE or not _identical(module):
                    raise Unsupported(f"the probe's {name!r} is not a list of {PROBE} blocks")
                lists.append((name, lengths[name], module))
        return lists
    lists = [(name, len(blocks), blocks) for name, blocks in block_lists(model)]
    for _, _, blocks in lists:
        del blocks[PROBE - 1 : -1]
    return lists


# Which config key sets the length of each block list, per diffusers class: a preset's probe is built with at most
# PROBE blocks per list instead of being built whole and cut (building full Flux's 57 blocks alone takes ~0.5 s).
_LAYER_KEYS: dict[str, dict[str, str]] = {
    "FluxTransformer2DModel": {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    "SD3Transformer2DModel": {"transformer_blocks": "num_layers"},
    "LTXVideoTransformer3DModel": {"transformer_blocks": "num_layers"},
    "WanTransformer3DModel": {"blocks": "num_layers"},
    "PixArtTransformer2DModel": {"transformer_blocks": "num_layers"},
    "DiTTransformer2DModel": {"transformer_blocks": "num_layers"},
}


def probe_builder(preset, size: str, dtype: torch.dtype, seed: int):
    """``(build, lengths)`` for a preset: ``build()`` makes the preset at ``size`` with each block list longer than
    the probe built with :data:`PROBE` blocks (the last of them is built as the last block, as SD3 builds its own),
    ``lengths`` maps those lists' names to their full lengths. None when the preset's lists are not known."""
    import dataclasses
    import inspect

    from .models import _build

    keys = _LAYER_KEYS.get(preset.model_class)
    if keys is None:
        return None
    import diffusers

    cls = getattr(diffusers, preset.model_class)
    defaults = inspect.signature(cls.__init__).parameters
    config = dict(preset.configs[size])
    lengths = {}
    for attr, key in keys.items():
        n = config.get(key, defaults[key].default if key in defaults else None)
        if isinstance(n, int) and n > PROBE:
            lengths[attr] = n
            config[key] = PROBE
    if not lengths:
        return None
    small = dataclasses.replace(preset, configs={**preset.configs, size: config})

    def build() -> nn.Module:
        return _build(small, size, dtype, seed, torch.device("cpu"))

    return build, lengths


class _Rows(list):
    """The tracker's event rows, each tagged as it is appended."""

    __slots__ = ("tagger",)

    def append(self, row: tuple) -> None:
        list.append(self, row)
        self.tagger.tag(row)


class Tagger:
    """Tags each event of a probe with the block it belongs to (see the module docstring): installed on a running
    tracker by :meth:`install`, read by :func:`splice`."""

    def __init__(self, lists: list[tuple[str, int, nn.ModuleList]]):
        self.lists = lists
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
        self.sticky: tuple[int, int] | None = None
        self.node: dict[int, tuple[int, int]] = {}  # autograd node sequence number -> block
        self.op_owner: Any = None
        self.out_owner: dict[int, Any] = {}
        self.handles: list[Any] = []
        self.tracker = None

    # ---- installing -----------------------------------------------------------------------------------------
    def install(self, tracker, optimizer: torch.optim.Optimizer | None) -> None:
        """Tag ``tracker``'s events from now on (it has registered the baseline, and recorded nothing yet)."""
        from torch.nn.modules import module as nn_module

        if tracker.log.rows:
            raise RuntimeError("the probe's tracker has recorded events before the tagger was installed")
        self.tracker = tracker
        rows = _Rows()
        rows.tagger = self
        tracker.log.rows = rows
        self.base = {k: e for k, e in tracker._live.items() if e.event < 0}
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
                    block.register_forward_pre_hook(self._block_pre, with_kwargs=True),
                    block.register_forward_hook(self._block_post, with_kwargs=True, always_call=True),
                ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _owned_tensors(self, optimizer) -> dict[int, tuple[int, int]]:
        from .memory.tracker import _plain  # a DTensor's memory is its local shard's

        def storages(t: torch.Tensor) -> list[int]:
            return [inner.untyped_storage()._cdata for inner in _plain(t)]

        keys = {}
        for li, (_, _, blocks) in enumerate(self.lists):
            for b, block in enumerate(blocks):
                for t in (*block.parameters(), *block.buffers()):
                    keys.update(dict.fromkeys(storages(t), (li, b)))
                    grad = getattr(t, "grad", None)
                    if grad is not None:
                        keys.update(dict.fromkeys(storages(grad), (li, b)))
        if optimizer is not None:
            for p, state in optimizer.state.items():
                owner = self.tensor_owner.get(id(p))
                if owner is not None:
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            keys.update(dict.fromkeys(storages(v), owner))
        return keys

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _pre(self, module, args) -> None:
        if id(module) not in self.inside and not self.stack:
            self.sticky = None  # a module outside the blocks: the loop over a block list is over

    def _block_pre(self, module, args, kwargs) -> None:
        self.stack.append(self.block[id(module)])

    def _block_post(self, module, args, kwargs, output) -> None:
        tag = self.block[id(module)]
        if self.stack:
            self.stack.pop()
        if self.stack:
            return
        self.sticky = tag
        if torch.is_grad_enabled() and not _compat.graph_task_running():
            self._map_nodes(tag, (args, kwargs), output)

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
        for t in tree_flatten(args)[0]:
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


def splice(tagger: Tagger, rows: list[tuple], retags: list[tuple[int, int]], baseline: dict[str, int]):
    """The full model's events and baseline from the probe's: returns (rows, baseline, source) where
    ``source[i]`` is the probe row the full row ``i`` repeats. Raises :class:`Unsupported` where the probe's
    events do not split into sweeps of its blocks."""
    from .memory.events import CATEGORIES

    if len(tagger.tags) != len(rows):
        raise Unsupported("events were appended to the probe's log without a tag")
    tags = _filled(tagger.tags, [r[4] for r in rows])
    full = [n for _, n, _ in tagger.lists]
    category = [r[3] for r in rows]
    for index, code in retags:
        category[index] = code

    # each free's allocation: a probe row, or a baseline storage
    alloc_of: dict[int, int] = {}
    pair: list[Any] = [None] * len(rows)
    for i, row in enumerate(rows):
        key = row[8]
        if row[1] == ALLOC:
            alloc_of[key] = i
        elif key == -1:
            pair[i] = i - 1  # a kernel's internal buffer: freed right after it is allocated
        else:
            j = alloc_of.pop(key, None)
            pair[i] = j if j is not None else ("base", key)

    # sweeps: maximal runs of events of one list, going through its blocks in order
    sweeps: list[_Sweep] = []
    sweep_of = [-1] * len(rows)
    pos_of = [-1] * len(rows)
    epochs = tagger.epochs
    i = 0
    while i < len(rows):
        tag = tags[i]
        if tag is _AGG:
            raise Unsupported(f"event {i} reads storages of several blocks at once")
        if tag is None:
            i += 1
            continue
        li, phase = tag[0], rows[i][4]
        runs: list[list[int]] = [[] for _ in range(PROBE)]
        order: list[int] = []
        j = i
        while j < len(rows) and tags[j] is not None and tags[j] is not _AGG and tags[j][0] == li:
            if rows[j][4] != _OTHER:  # FSDP's hooks gather and free between a block's forward events
                if phase == _OTHER:
                    phase = rows[j][4]
                elif rows[j][4] != phase:
                    break
            b = tags[j][1]
            if order and order[-1] != b and b in order:  # the next sweep begins
                last = runs[order[-1]]
                if len(order) >= 2 and (order[-2] < order[-1]) == (b < order[-1]):
                    # up and down again (a _foreach op's outputs, then their frees in reverse): the last block's
                    # events split where the op that freed them began
                    cut = [k for k in range(1, len(last)) if epochs[last[k]] != epochs[last[k - 1]]]
                    if not cut:
                        raise Unsupported(f"events {i}-{j} turn back in block {order[-1]}")
                    j = last[cut[-1]]
                    del last[cut[-1] :]
                break
            if not order or order[-1] != b:
                order.append(b)
            sweep_of[j] = len(sweeps)
            pos_of[j] = len(runs[b])
            runs[b].append(j)
            j += 1
        order = [b for b in order if runs[b]]
        if len(order) == 1 and order[0] not in (0, PROBE - 1):
            raise Unsupported(f"events {i}-{j} belong to block {order[0]} of {tagger.lists[li][0]!r} alone")
        if len(order) > 1 and order not in (_UP, _DOWN):
            raise Unsupported(f"events {i}-{j} go through blocks {order} of list {tagger.lists[li][0]!r}")
        sweeps.append(_Sweep(li, i, runs, order, full[li]))
        i = j

    # baseline storages of each probe block, in registration order, and what the repeated ones add
    base_of: dict[tuple[int, int], list[int]] = {}
    for key, owner in tagger.base_owner.items():
        base_of.setdefault(owner, []).append(key)
    base_pos = {key: q for keys in base_of.values() for q, key in enumerate(keys)}
    out_baseline = dict(baseline)
    for li, n in enumerate(full):
        shapes = [
            [(tagger.base[k].nbytes, tagger.base[k].category) for k in base_of.get((li, b), [])] for b in range(PROBE)
        ]
        if shapes[1] != shapes[2]:
            raise Unsupported(f"the middle blocks of {tagger.lists[li][0]!r} hold different state before the step")
        for nbytes, code in shapes[1]:
            out_baseline[CATEGORIES[code]] += (n - PROBE) * nbytes

    def token(r: int) -> tuple:
        row = rows[r]
        return (row[1], row[2], category[r], row[4], row[6])

    aligned: dict[tuple, dict[int, int]] = {}

    def same_event(runs: list[list[int]], b: int, b2: int, p: int) -> int | None:
        """The position in block b2's events of a sweep of the event at position p of block b's, matching the
        two blocks' events as sequences (the first and last block may do a little more or less than a middle
        one: the first gradient of an input every block uses is kept, the later ones added)."""
        if b == b2:
            return p
        x, y = runs[b], runs[b2]
        key = (x[0], y[0])
        if key not in aligned:
            matcher = difflib.SequenceMatcher(None, [token(r) for r in x], [token(r) for r in y], autojunk=False)
            aligned[key] = {u + k: v + k for u, v, n in matcher.get_matching_blocks() for k in range(n)}
        return aligned[key].get(p)

    counter = iter(range(1, 1 << 62))
    made: dict[tuple, int] = {}  # (sweep, full block, position) or ("row", probe row) -> new key
    base_keys: dict[tuple, int] = {}  # (list, position in its block's, full block) -> new key

    def base_key(key: int, li: int, J: int) -> int:
        """The key of the baseline storage of full block J that is to its block what ``key`` is to its own."""
        n = full[li]
        same = {0: 0, 1: 1, n - 2: PROBE - 2, n - 1: PROBE - 1}.get(J)
        if same is not None:
            return base_of[(li, same)][base_pos[key]]
        slot = (li, base_pos[key], J)
        got = base_keys.get(slot)
        if got is None:
            got = base_keys[slot] = -(1 << 40) - len(base_keys)
        return got

    def resolve(i: int, sweep: _Sweep | None, J: int | None) -> int:
        """The full model's key of the storage probe row ``i`` frees, emitted in block J of a sweep (None:
        outside the blocks)."""
        a = pair[i]
        role = sweep.role(J) if sweep is not None else None
        repeated = sweep is not None and sweep.repeated(J)
        if isinstance(a, tuple):  # a baseline storage
            key = a[1]
            owner = tagger.base_owner.get(key)
            if owner is None:
                if repeated:
                    raise Unsupported(f"every middle block frees the same storage (event {i})")
                return key
            ol, ob = owner
            if sweep is not None and ol == sweep.li:
                target = J + (ob - role)
            elif ob in (0, PROBE - 1):
                target = 0 if ob == 0 else full[ol] - 1
            else:
                raise Unsupported(f"event {i} outside the blocks frees a middle block's storage")
            return base_key(key, ol, target)
        if rows[i][8] == -1:
            return -1
        s = sweep_of[a]
        if s < 0 or sweeps[s].lone:  # allocated outside the blocks, or by the first or last block alone
            if repeated:
                raise Unsupported(f"every middle block frees the same storage (event {i})")
            got = made.get(("row", a))
            if got is None:
                raise Unsupported(f"event {i} frees a storage before it is allocated")
            return got
        at = sweeps[s]
        ab = tags[a][1]
        target = J + (ab - role) if sweep is not None and at.li == sweep.li else at.absolute(ab)
        if not 0 <= target < at.n:
            raise Unsupported(f"event {i} frees a storage of a middle block from outside its list's blocks")
        got = made.get((s, target, same_event(at.runs, ab, at.role(target), pos_of[a])))
        if got is None:
            raise Unsupported(
                f"event {i} (block {J} of list {sweep.li if sweep else None}) frees a storage allocated by event "
                f"{a} (probe block {ab} of list {at.li}), which block {target} of the full model does not allocate"
            )
        return got

    out: list[tuple] = []
    source: list[int] = []

    def emit(i: int, s: int | None, J: int | None) -> None:
        row = rows[i]
        sweep = sweeps[s] if s is not None else None
        if row[1] == ALLOC:
            key = -1 if row[8] == -1 else next(counter)
            if sweep is not None and not sweep.lone:
                made[(s, J, pos_of[i])] = key
            else:
                made[("row", i)] = key
        else:
            key = resolve(i, sweep, J)
        out.append((row[0], row[1], row[2], category[i] if row[1] == ALLOC else row[3], *row[4:8], key))
        source.append(i)

    i = 0
    for s, sweep in enumerate(sweeps):
        while i < sweep.first:  # events outside the blocks
            emit(i, None, None)
            i += 1
        for J in sweep.blocks():
            for r in sweep.runs[sweep.role(J)]:
                emit(r, s, J)
        i = sweep.first + sum(len(r) for r in sweep.runs)
    while i < len(rows):
        emit(i, None, None)
        i += 1
    _check_pairs(out)
    return out, out_baseline, source


_UP = list(range(PROBE))
_DOWN = _UP[::-1]


class _Sweep:
    """Consecutive probe events that go through the blocks of one list in order (or the first or last block's
    alone). In the full model the blocks at sweep positions 0, 1 and N-1 are the probe's own; every other one
    repeats the probe's block at position 2, whose neighbours on both sides are middle blocks too."""

    def __init__(self, li: int, first: int, runs: list[list[int]], order: list[int], n: int):
        self.li, self.first, self.runs, self.order, self.n = li, first, runs, order, n
        self.lone = len(order) == 1
        self.down = order == _DOWN

    def position(self, J: int) -> int:
        return self.n - 1 - J if self.down else J

    def role(self, J: int) -> int:
        """The probe block whose events full block J repeats."""
        if self.lone:
            return self.order[0]
        p = self.position(J)
        return self.order[0 if p == 0 else 1 if p == 1 else PROBE - 1 if p == self.n - 1 else 2]

    def repeated(self, J: int) -> bool:
        return not self.lone and 2 <= self.position(J) < self.n - 1 and self.n - PROBE > 0

    def absolute(self, b: int) -> int:
        """The full block probe block b stands for outside its sweep: the first and the last block only (a middle
        block's events stand for many)."""
        if b not in (0, PROBE - 1):
            raise Unsupported(f"an event outside list {self.li}'s sweeps uses its middle block {b}")
        return 0 if b == 0 else self.n - 1

    def blocks(self) -> range:
        if self.lone:
            J = self.absolute(self.order[0])
            return range(J, J + 1)
        return range(self.n - 1, -1, -1) if self.down else range(self.n)


def _filled(tags: list[Any], phases: list[int]) -> list[Any]:
    """The tags with each run of untagged events between two events of neighbouring blocks of one list, all in
    one phase, given the next event's block: per-block work that touches no block storage (Adam's ``step``
    tensor, made before the parameter's moments) belongs to the block whose work it precedes."""
    out = list(tags)
    i = 0
    while i < len(out):
        if out[i] is not None:
            i += 1
            continue
        j = i
        while j < len(out) and out[j] is None and phases[j] == phases[i]:
            j += 1
        prev = out[i - 1] if i > 0 and phases[i - 1] == phases[i] else None
        nxt = out[j] if j < len(out) and phases[j] == phases[i] else None
        if (
            prev is not None
            and nxt is not None
            and prev is not _AGG
            and nxt is not _AGG
            and prev[0] == nxt[0]
            and abs(prev[1] - nxt[1]) <= 1
        ):
            out[i:j] = [nxt] * (j - i)
        i = j
    return out


def _check_pairs(rows: list[tuple]) -> None:
    """Every storage of the spliced events freed at most once, never before it is allocated."""
    live: set[int] = set()
    allocated: set[int] = set()
    freed: set[int] = set()  # baseline storages
    for i, row in enumerate(rows):
        key = row[8]
        if key == -1:
            continue
        if row[1] == ALLOC:
            if key in live:
                raise Unsupported(f"spliced event {i} allocates a storage that is alive")
            live.add(key)
            allocated.add(key)
        elif key in live:
            live.discard(key)
        elif key in allocated or key in freed:
            raise Unsupported(f"spliced event {i} frees a storage that is not alive")
        else:
            freed.add(key)


def columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    """Numpy columns of spliced rows (times made non-decreasing: repeated events keep their probe times)."""
    cols = list(zip(*rows, strict=True)) if rows else [()] * len(COLUMNS)
    out = {name: np.asarray(cols[i], dtype=dt) for i, (name, dt) in enumerate(COLUMNS)}
    if len(out["time"]):
        out["time"] = np.maximum.accumulate(out["time"])
    return out


def parameters(lists: list[tuple[str, int, nn.ModuleList]], probe_parameters: int) -> int:
    """The full model's parameter count from the probe's."""
    extra = sum((n - PROBE) * sum(p.numel() for p in blocks[1].parameters()) for _, n, blocks in lists)
    return probe_parameters + extra
