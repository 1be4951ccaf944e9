"""How :func:`memkit.estimate_job` builds its phases: events put together from tracked runs (the step's, each
component's, a quantization's) and synthetic weight moves, each event's owner, and the one allocator replay through
the phases."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ._job import Phase
from .memory.events import ALLOC, CATEGORY_CODE, COLUMNS, CUDA_BLOCK, FREE, PHASE_CODE, round_alloc
from .memory.reserved import replay_reserved
from .memory.timeline import Timeline

# ---- building phases from events ------------------------------------------------------------------------------
_NAMES = [name for name, _ in COLUMNS]
_KEYS = itertools.count(2**60)  # storage keys of composed events: far above any storage address


def _fresh_keys(n: int) -> np.ndarray:
    start = next(_KEYS)
    for _ in range(n - 1):
        next(_KEYS)
    return np.arange(start, start + n, dtype=np.int64)


class _Compose:
    """A phase's events, put together from tracked runs and synthetic weight moves, with each event's owner."""

    def __init__(self, components: list[str], device: str, cuda: bool) -> None:
        self.components, self.device, self.cuda = components, device, cuda
        self.parts: list[dict[str, np.ndarray]] = []
        self.owners: list[np.ndarray] = []
        self.ops: list[str] = []
        self.base_cat = {c: 0 for c in CATEGORY_CODE}
        self.base_comp: dict[str, int] = {}
        self.blocks: list[tuple[int, int, int]] = []
        self.t = 0.0
        self.lower_bound: list[str] = []

    def _round(self, n: int) -> int:
        return int(round_alloc(int(n), CUDA_BLOCK if self.cuda else None))

    def resident(self, component: str, category: str, blocks: Iterable[tuple[int, int]]) -> None:
        """Storages live before the phase: ``(key, bytes)`` each."""
        for key, n in blocks:
            self.blocks.append((int(key), int(n), 0))
            self.base_cat[category] += int(n)
            self.base_comp[component] = self.base_comp.get(component, 0) + int(n)

    def _append(self, cols: dict[str, np.ndarray], component: str) -> None:
        n = len(cols["bytes"])
        if not n:
            return
        self.parts.append(cols)
        self.owners.append(np.full(n, self.components.index(component), dtype=np.int16))
        self.t = float(cols["time"][-1])

    def move(self, component: str, blocks: Sequence[tuple[int, int]], action: int, category: str = "parameter") -> None:
        """Synthetic allocations (``ALLOC``) or frees of ``blocks`` (weights moved on or off the device)."""
        n = len(blocks)
        if not n:
            return
        self.t += 1e-6
        cols = {
            "time": np.full(n, self.t),
            "action": np.full(n, action, dtype=np.int8),
            "bytes": np.array([b for _, b in blocks], dtype=np.int64),
            "category": np.full(n, CATEGORY_CODE[category], dtype=np.int8),
            "phase": np.full(n, PHASE_CODE["other"], dtype=np.int8),
            "device": np.zeros(n, dtype=np.int16),
            "op": np.full(n, -1, dtype=np.int32),
            "frame": np.full(n, -1, dtype=np.int32),
            "storage": np.array([k for k, _ in blocks], dtype=np.int64),
        }
        self._append(cols, component)

    def events(
        self, tl: Timeline, component: str, *, keep_keys: bool = False, start: int = 0, stop=None, drop: bool = False
    ) -> None:
        """Append ``tl``'s events (``start:stop``) after what is there, its time shifted and, unless ``keep_keys``
        (the step whose baseline blocks the phase keeps), its storage keys renamed apart from every other part's.
        ``drop``: then free what they leave allocated (an output the script lets go before its next part)."""
        cols = {name: tl.column(name)[start:stop] for name in _NAMES}
        real = [i for i, d in enumerate(tl.devices) if d != "meta"]  # meta tensors (empty-weight inits) hold nothing
        if len(real) > 1:
            raise NotImplementedError(f"a job's phases are composed on one device; this run has events on {tl.devices}")
        if len(real) < len(tl.devices):
            keep = np.isin(cols["device"], real)
            cols = {name: col[keep] for name, col in cols.items()}
        if not len(cols["bytes"]):
            return
        cols = dict(cols)
        t0 = float(tl.column("time")[0]) if len(tl) else 0.0
        cols["time"] = cols["time"] - t0 + self.t + 1e-6
        if not keep_keys:
            keys = cols["storage"]
            uniq, inverse = np.unique(keys, return_inverse=True)
            fresh = _fresh_keys(len(uniq))
            cols["storage"] = np.where(keys == -1, -1, fresh[inverse])
        op = cols["op"]
        cols["op"] = np.where(op >= 0, op + len(self.ops), -1).astype(np.int32)
        self.ops.extend(tl.ops)
        cols["frame"] = np.full(len(op), -1, dtype=np.int32)
        cols["device"] = np.zeros(len(op), dtype=np.int16)
        self._append(cols, component)
        if drop:
            left: dict[int, list[int]] = {}
            for act, n, key in zip(*(cols[c].tolist() for c in ("action", "bytes", "storage")), strict=True):
                if act == ALLOC:
                    left.setdefault(key, []).append(n)
                elif left.get(key):
                    left[key].pop()
            self.move(component, [(k, n) for k, ns in left.items() for n in ns], FREE, "temporary")

    def phase(self, name: str, *, host_bytes: int, alloc_conf: str, note: str = "") -> Phase:
        if self.parts:
            columns = {name_: np.concatenate([p[name_] for p in self.parts]) for name_ in _NAMES}
            owner = np.concatenate(self.owners)
        else:
            columns, owner = {}, np.zeros(0, dtype=np.int16)
        tl = Timeline(
            columns, baseline_by_category=self.base_cat, devices=[self.device], ops=self.ops,
            meta=dict(phase=name, device="cuda" if self.cuda else "cpu", bytes="allocated"),
        )  # fmt: skip
        tl.baseline_blocks = list(self.blocks)
        if self.lower_bound:
            tl.meta["lower_bound"] = "; ".join(dict.fromkeys(self.lower_bound))
        if self.cuda:
            replay = replay_reserved(tl, baseline_blocks=self.blocks, alloc_conf=alloc_conf)
            tl.set_reserved(replay.series, replay.baseline_bytes)
            tl.meta["peak_reserved_bytes"] = tl.peak_reserved_bytes
        tl.meta["peak_bytes"] = tl.peak_bytes
        return Phase(name, tl, owner, dict(self.base_comp), int(host_bytes), note)


def _live_at_end(tl: Timeline) -> list[tuple[int, int, str]]:
    """The storages alive at the end of ``tl`` (its baseline blocks not freed, then its allocations not freed), as
    ``(key, bytes, category)``; a baseline block's category is ``"input"`` for ``tl.input_keys``, else
    ``"parameter"`` (an estimate's baseline: the model's weights and buffers, and its inputs)."""
    live: dict[int, list[tuple[int, str]]] = {}
    by_size: dict[int, list[int]] = {}
    for key, n, _ in tl.baseline_blocks or []:
        live.setdefault(key, []).append((n, "input" if key in tl.input_keys else "parameter"))
        by_size.setdefault(n, []).append(key)
    names = {i: c for c, i in CATEGORY_CODE.items()}
    cols = [tl.column(c).tolist() for c in ("action", "bytes", "category", "storage")]
    for act, n, cat, key in zip(*cols, strict=True):
        if act == ALLOC:
            live.setdefault(key, []).append((n, names[cat]))
        elif live.get(key):
            live[key].pop()
        else:  # a spliced timeline frees a repeated baseline block by its size
            same = by_size.get(n, [])
            while same and not live.get(same[-1]):
                same.pop()
            if same:
                live[same.pop()].pop()
    return [(k, n, c) for k, entries in live.items() for n, c in entries]


# ---- the components' runs ----------------------------------------------------------------------------------------
_RUNS: dict[tuple, tuple[Timeline, list[tuple[int, int]], list[tuple[int, int]]]] = {}


def _component_run(comp, csize: str, part: str, *, batch_size, sizes, tiling, slicing, dtype, device):
    """One tracked run of a component on fake tensors: (timeline of the run, its weights' blocks, its buffers'
    blocks). The weights are the run's baseline; the timeline holds what the run adds (inputs, activations, output
    freed at its end)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import _components
    from .estimation import _active_tracker
    from .memory._fake_dispatch import FakeDispatchCache
    from .memory.placement import planning
    from .memory.recording import track
    from .models import _default_dtype

    key = (comp.preset, comp.name, csize, part, batch_size, tuple(sorted(sizes.items())), tiling, slicing, dtype,
           device)  # fmt: skip
    if key in _RUNS:
        return _RUNS[key]
    cuda = device == "cuda"
    with FakeTensorMode(), _default_dtype(dtype), planning(device):
        module = comp.build(csize)
        with track(module, alloc_granularity=CUDA_BLOCK if cuda else None, device=device if cuda else None) as tl:
            tracker = _active_tracker()
            tracker.fake = FakeDispatchCache()
            out = _components.run(comp, module, batch_size=batch_size, sizes=sizes, part=part, tiling=tiling,
                                  slicing=slicing)  # fmt: skip
            del out
        params = {p.untyped_storage()._cdata for p in module.parameters()}
        blocks = list(tracker.baseline_blocks)
    weights = [(k, n) for k, n, _ in blocks if k in params]
    buffers = [(k, n) for k, n, _ in blocks if k not in params]
    _RUNS[key] = (tl, weights, buffers)
    return _RUNS[key]


def _renamed(blocks: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    fresh = _fresh_keys(len(blocks)) if blocks else []
    return [(int(k), int(n)) for k, (_, n) in zip(fresh, blocks, strict=True)]


_VAE_LOWER_BOUND = (
    "a lower bound: the VAE's convolutions take cuDNN workspaces on a GPU (chosen at run time, CUDA-only), which "
    "these CPU-kernel events do not hold; Flux's 1024x1024 decode in the HF quantization-backends blog peaks "
    "1.4-1.6 GiB above this phase's reserved figure"
)


def _fix_categories(c: _Compose, step: Timeline) -> None:
    """The step's baseline by category exactly as the step counts it (its blocks only say which are inputs)."""
    base = step.baseline_by_category
    for cat in c.base_cat:
        c.base_cat[cat] = int(base.get(cat, 0))


def _inference_kept(o) -> bool:
    """Whether an optimization changes an inference step of the same model: the weights' (quantization, adapters,
    offload, split feed-forward), not the training's (checkpointing, EMA)."""
    return type(o).__name__ not in ("Checkpointing", "EMA")


def _denoise(c: _Compose, tl: Timeline, pipeline: Any, *, events_only: bool = False) -> None:
    """Append a denoising step's events: the inference estimate ``tl``'s, twice apart with ``cfg="separate"`` (the
    first pass's prediction kept through the second)."""
    inputs = [] if events_only else _renamed([(k, n) for k, n, _ in tl.baseline_blocks or [] if k in tl.input_keys])
    c.move("transformer", inputs, ALLOC, "input")  # validation: its inputs made after the prompt is encoded
    held = _output_blocks(tl)
    if pipeline.cfg == "separate":  # the first pass's prediction, kept through the second
        c.events(tl, "transformer", drop=True)
        held = _renamed(held)
        c.move("transformer", held, ALLOC, "temporary")
    c.events(tl, "transformer", keep_keys=events_only, drop=not events_only)
    if pipeline.cfg == "separate":
        c.move("transformer", held, FREE, "temporary")
    c.move("transformer", inputs, FREE, "input")


@contextlib.contextmanager
def _releasing_replaced():
    """While a quantization replaces the model's weights, count each original freed once its new storage exists, as
    a script keeping no reference frees it (memkit's handle keeps the originals, to put them back): bitsandbytes'
    layers as each is filled, torchao's parameters as each is registered, layerwise casting's as each is cast."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    from .memory.recording import released
    from .optimizations._common import on_weights_replaced

    def on_parameter(module, name, param):
        old = module._parameters.get(name)
        if old is not None and old is not param:
            released([old])

    hook = register_module_parameter_registration_hook(on_parameter)
    try:
        with on_weights_replaced(released):
            yield
    finally:
        hook.remove()


def _output_blocks(tl: Timeline) -> list[tuple[int, int]]:
    """The prediction a denoising forward hands back: its window's last allocation (the output projection's), when
    nothing frees it before the window ends."""
    action, nbytes, key = (tl.column(c) for c in ("action", "bytes", "storage"))
    allocs = np.flatnonzero(action == ALLOC)
    if not len(allocs):
        return []
    last = int(allocs[-1])
    return [(int(key[last]), int(nbytes[last]))]


def _quantize_on_device(model, quantize, *, size, dtype, device, seed) -> Timeline:
    """The transformer loaded in ``dtype`` on the device and quantized there: the real library's quantization on
    fake tensors, tracked (the weights in ``dtype`` are the baseline; the events are the quantized copies made and
    the weights freed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .estimation import _active_tracker
    from .memory.placement import planning
    from .memory.recording import track
    from .models import _default_dtype, load_model

    cuda = device == "cuda"
    with FakeTensorMode(), _default_dtype(dtype), planning(device):
        net = load_model(model, size=size, dtype=dtype, seed=seed)
        # one device (the estimate's): the originals' frees would otherwise go to the meta device diffusers'
        # empty-weight layers are made on
        with track(net, alloc_granularity=CUDA_BLOCK if cuda else None, device=device) as tl:
            tracker = _active_tracker()
            with _releasing_replaced():
                handle = quantize.apply(net)
        blocks = list(tracker.baseline_blocks)
        del handle
    tl.baseline_blocks = blocks
    return tl


def _continuous_reserved(phases: Sequence[Phase], empty_after: set[str], alloc_conf: str) -> None:
    """Replay the job's phases one after the other through one caching allocator, as the process runs them: a phase
    starts with the segments the one before left cached (a pipeline call's encode, denoise and decode; training then
    validation), unless the phase before it ends with ``free_memory()`` (``empty_after``: the training scripts
    empty the cache after precomputing and after validation). Each phase's reserved series becomes its segment of
    that replay. Between two phases the storages that change (a validation's inputs made, a component moved off) are
    allocated or freed before the next phase's events, so the replay holds each phase's baseline."""
    parts, spans, empties = [], [], []
    live: dict[int, int] = {}
    n = 0
    for i, phase in enumerate(phases):
        tl = phase.timeline
        base = {int(k): int(b) for k, b, _ in tl.baseline_blocks or []}
        if i and phases[i - 1].name in empty_after:
            empties.append(n)
        gone = [(k, b) for k, b in live.items() if k not in base]
        new = [(k, b) for k, b in base.items() if k not in live]
        for action, blocks in ((FREE, gone), (ALLOC, new)):
            if blocks:
                parts.append(_synthetic(blocks, action))
                n += len(blocks)
        for k, _ in gone:
            del live[k]
        live.update(new)
        cols = {name: tl.column(name) for name in ("action", "bytes", "storage")}
        parts.append({**cols, "device": np.zeros(len(cols["bytes"]), dtype=np.int16)})
        spans.append((n, n + len(cols["bytes"])))
        n += len(cols["bytes"])
        for act, b, k in zip(cols["action"].tolist(), cols["bytes"].tolist(), cols["storage"].tolist(), strict=True):
            if act == ALLOC:
                live[k] = b
            else:
                live.pop(k, None)
    names = ("action", "bytes", "device", "storage")
    columns = {c: np.concatenate([p[c] for p in parts]) if parts else np.zeros(0) for c in names}
    total = len(columns["bytes"])
    whole = Timeline(
        {
            **columns,
            "time": np.arange(total, dtype=np.float64),
            "category": np.zeros(total, dtype=np.int8),
            "phase": np.zeros(total, dtype=np.int8),
        },
        devices=["cuda"],
    )
    replay = replay_reserved(whole, alloc_conf=alloc_conf, empty_cache_at=empties)
    series = replay.series
    for phase, (a, b) in zip(phases, spans, strict=True):
        before = int(series[a - 1]) if a else replay.baseline_bytes
        phase.timeline.set_reserved(series[a:b].copy(), before)
        phase.timeline.meta["peak_reserved_bytes"] = phase.timeline.peak_reserved_bytes
        phase.timeline.meta["reserved"] = "continued from the phase before" if a else "from an empty device"


def _synthetic(blocks: Sequence[tuple[int, int]], action: int) -> dict[str, np.ndarray]:
    return {
        "action": np.full(len(blocks), action, dtype=np.int8),
        "bytes": np.array([b for _, b in blocks], dtype=np.int64),
        "device": np.zeros(len(blocks), dtype=np.int16),
        "storage": np.array([k for k, _ in blocks], dtype=np.int64),
    }
