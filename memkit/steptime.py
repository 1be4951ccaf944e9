"""A step's time on a GPU from the step's own op stream: FLOPs and bytes per aten op, through a roofline.

:func:`count_ops` runs the very step :func:`memkit.estimate` runs (the same model, optimizations, inputs and
:class:`memkit.Step`, on fake tensors, the first step untracked) and records each aten op of the steady step: its
FLOPs (torch's own formulas, ``torch.utils.flop_counter.flop_registry``: matmuls, convolutions, attention and their
backward ops; every other op is counted as 0 FLOPs), the bytes it reads (its tensor inputs) and writes (its
outputs), and its class: ``"matmul"``, ``"attention"``, ``"conv"``, ``"elementwise"`` (everything else on the
device), ``"optimizer"`` (inside ``optimizer.step()``), ``"transfer"`` (a copy between host memory and the device:
an offloaded weight loaded, a checkpoint input offloaded or brought back), ``"disk"`` (weights ``Offload(to="disk")``
reads) or ``"host"`` (ops on host tensors: a CPU optimizer's, not GPU time). Recompute is counted as it runs: the
forward ops a checkpointed block runs again in the backward are tagged ``recompute`` (an op inside a module's
forward while autograd's backward runs). View ops move nothing and are not counted.

:func:`step_seconds` turns the counts into seconds on a GPU: each op takes
``max(flops / (peak[dtype] * eff_flops), bytes / (bandwidth * eff_bw))`` (compute- or memory-bound, whichever is
slower), summed; transfers take ``bytes / (host link * eff)``, disk reads ``bytes / NVME_READ``. What it leaves out:
kernel launch gaps and the CPU's dispatch (a step of many small ops runs slower than its roofline), fused kernels
(a real run may fuse elementwise ops that the fake step counts apart, or use a kernel torch's CPU path lacks), and
communication. It is a ratio tool first: which configuration is faster, by about how much.

Example:
    >>> tl = memkit.estimate("ltx-video", optimizations=[memkit.Checkpointing()], frames=81, count_ops=True)
    >>> t = memkit.steptime.step_seconds(tl.op_counts, "h100"); t.seconds, t.recompute_seconds, print(t.why)
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from . import _memo
from . import _torch_compat as _compat
from ._step_peaks import _step_of
from .handle import Optimization, apply_all
from .memory._fake_dispatch import FakeDispatchCache
from .memory._roles import _HOST_STATE, _OFF_DEVICE
from .memory.placement import planning
from .models import _build, _default_dtype, config_preset, load_model, make_inputs
from .naming import resolve

__all__ = ["CLASSES", "EFFICIENCY", "NVME_READ", "Op", "OpCounts", "StepTime", "count_ops", "counting", "step_seconds"]

CLASSES = ("matmul", "attention", "conv", "elementwise", "optimizer", "transfer", "disk", "host")
"""The op classes :func:`count_ops` sorts ops into."""

EFFICIENCY: dict[str, tuple[float, float]] = {
    "matmul": (0.7, 0.8), "attention": (0.5, 0.8), "conv": (0.5, 0.8),
    "elementwise": (1.0, 0.8), "optimizer": (1.0, 0.7), "transfer": (1.0, 0.8),
}  # fmt: skip
"""Class -> (share of peak FLOP/s, share of the bandwidth) a real kernel reaches. Assumptions, set from public
figures: large bf16 GEMMs in cuBLAS reach ~60-80% of an H100's dense peak (NVIDIA's and others' published
benchmarks); FlashAttention-2 reaches 50-73% of an A100's peak forward and less backward (Dao, 2023), ~35-50% on an
H100, FlashAttention-3 up to 75% forward (Shah et al., 2024); convolutions taken as attention; streaming
elementwise kernels reach ~80-90% of HBM bandwidth (STREAM-like copies), multi-tensor-apply optimizer kernels a
little less; pinned host-to-device copies ~80% of a PCIe link's per-direction rate. ``transfer``'s bandwidth share
applies to the host link; disk reads take :data:`NVME_READ` as it is."""

NVME_READ = 7.0e9
"""Bytes/s one PCIe 4.0 x4 NVMe drive reads sequentially (Samsung 990 Pro: 7,450 MB/s; WD SN850X: 7,300 MB/s, their
data sheets), rounded down: the disk side of ``Offload(to="disk")``."""

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_addmm_activation", "linear"}
_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
_NO_TRAFFIC = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_local_scalar_dense"}


class Op(NamedTuple):
    """One kind of op in a step: how many of it :class:`OpCounts` holds is its count."""

    kind: str
    """Its class (one of :data:`CLASSES`)."""
    flops: int
    read: int
    """Bytes its tensor inputs hold (each at most its storage: a broadcast input is read once)."""
    written: int
    """Bytes of its outputs (an in-place op's: the tensor it writes)."""
    recompute: bool
    """Run again in the backward by checkpointing."""


@dataclasses.dataclass
class OpCounts:
    """The ops of one step: :class:`Op` -> how many times it ran (a full model's, extrapolated from its probe).

    Example:
        >>> c = count_ops("flux", size="tiny"); c.flops, c.by_class()["matmul"]
    """

    ops: Counter
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def flops(self) -> int:
        return sum(op.flops * n for op, n in self.ops.items())

    @property
    def bytes(self) -> int:
        """Bytes read and written by the device's ops (transfers, disk and host ops apart)."""
        return sum((op.read + op.written) * n for op, n in self.ops.items() if op.kind not in _OFF_GPU)

    def by_class(self, what: str = "flops") -> dict[str, int]:
        """Class -> total ``"flops"``, ``"bytes"`` (read + written) or ``"ops"``."""
        out = dict.fromkeys(CLASSES, 0)
        for op, n in self.ops.items():
            value = {"flops": op.flops, "bytes": op.read + op.written, "ops": 1}[what]
            out[op.kind] += value * n
        return out

    def recompute_flops(self) -> int:
        return sum(op.flops * n for op, n in self.ops.items() if op.recompute)


_OFF_GPU = ("transfer", "disk", "host")


def _nbytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _flops(func, name: str, args, kwargs, out) -> int:
    packet = func._overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if name == "linear":  # reached whole from a kernel run inside a dispatch mode (bitsandbytes' 4-bit gemm)
        x, w = args[0], args[1]
        return 2 * x.numel() // x.shape[-1] * w.shape[0] * w.shape[1]
    if name == "_addmm_activation":
        return int(flop_registry[torch.ops.aten.addmm](*args[:3], out_val=out))
    if name == _CPU_FLASH:  # the path fake CPU tensors take: the same math as the CUDA flash kernel
        return int(sdpa_flop_count(*(a.shape for a in args[:3])))
    if name == _CPU_FLASH + "_backward":
        return int(sdpa_backward_flop_count(*(a.shape for a in args[:4])))
    return 0


def _kind(name: str) -> str:
    if name in _MATMUL:
        return "matmul"
    if "attention" in name:
        return "attention"
    if "convolution" in name or name.startswith("_slow_conv"):
        return "conv"
    return "elementwise"


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


_NAMES: dict[Any, str] = {}  # per aten overload: its name, or "" where it moves nothing (a view): the counter skips it


def _tensors(values) -> list[torch.Tensor]:  # an aten op's tensor arguments: direct or in a list (cat, _foreach)
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


class _Counter(TorchDispatchMode):
    """Records every op of the window into ``ops`` (see the module docstring for what each one counts)."""

    def __init__(self, host: Sequence[torch.Tensor], disk: list[int], fake: bool = False):
        super().__init__()
        self.fake = FakeDispatchCache() if fake else None  # the estimate's own: the same outputs, ~2x faster
        self.ops: Counter = Counter()
        self.host = {t.untyped_storage()._cdata for t in host}
        self.disk = disk  # bytes each disk load read, appended by the store's wrapped load
        self.optimizer = 0
        self.forward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs) if self.fake is None else self.fake(func, args, kwargs)
        name = _NAMES.get(func)
        if name is None:  # the op's name, or "" for one that moves nothing (a view, an empty tensor)
            name = _NAMES[func] = "" if _is_view(func) or func._overloadpacket.__name__ in _NO_TRAFFIC else (
                func._overloadpacket.__name__
            )  # fmt: skip
        if not name:
            return out
        ins = _tensors(args) + _tensors(kwargs.values()) if kwargs else _tensors(args)
        outs = (
            [out] if isinstance(out, torch.Tensor) else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        )
        if not outs and name.startswith("_foreach_") and name.endswith("_"):
            outs = [t for t in args[0] if isinstance(t, torch.Tensor)]  # in place: what it writes is its first list
        if not outs:  # no tensor made or written (prim.device, sym_size): nothing moves on the device
            return out
        if _OFF_DEVICE.get() or _HOST_STATE.get():
            self.host.update(t.untyped_storage()._cdata for t in outs)
        host_in = any(t.untyped_storage()._cdata in self.host for t in ins)
        host_out = bool(outs) and all(t.untyped_storage()._cdata in self.host for t in outs)
        recompute = self.forward > 0 and _compat.graph_task_running()
        if host_in or host_out:
            # a copy across, or an op mixing host and device tensors: the host tensors cross the link
            kind = "host" if host_in and host_out else "transfer"
            # what crosses the link: the host side of the copy (a host op's bytes stay on the host)
            side = outs if host_out else ins
            moved = sum(_nbytes(t) for t in side if t.untyped_storage()._cdata in self.host)
            self._add(Op(kind, 0, moved, 0, recompute), outs[0])
            return out
        kind = "optimizer" if self.optimizer else _kind(name)
        if name.startswith("_foreach_"):  # one op per tensor, as the sum of per-tensor kernels it stands for
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            for i, o in enumerate(outs):
                read = sum(_nbytes(a[i]) for a in lists if i < len(a))
                self._add(Op(kind, 0, read, _nbytes(o), recompute), o)
            return out
        flops = _flops(func, name, args, kwargs, out) if kind != "elementwise" else 0
        self._add(Op(kind, flops, sum(map(_nbytes, ins)), sum(map(_nbytes, outs)), recompute), outs[0])
        return out

    def _add(self, op: Op, out: torch.Tensor) -> None:
        """Count ``op`` once (``out``: the tensor it made or wrote, for a subclass that asks whose op it is)."""
        self.ops[op] += 1

    @contextlib.contextmanager
    def hooks(self):
        """Module forwards (for recompute) and optimizer steps (for the class) counted while the window is open."""

        def enter(*_):
            self.forward += 1

        def leave(*_):
            self.forward -= 1

        def opt_enter(*_):
            self.optimizer += 1

        def opt_leave(*_):
            self.optimizer -= 1

        from torch.nn.modules import module as nn_module
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        handles = [
            nn_module.register_module_forward_pre_hook(enter),
            nn_module.register_module_forward_hook(leave, always_call=True),
            register_optimizer_step_pre_hook(opt_enter),
            register_optimizer_step_post_hook(opt_leave),
        ]
        try:
            with self:
                yield self
        finally:
            for h in handles:
                h.remove()
        for nbytes in self.disk:
            self.ops[Op("disk", 0, nbytes, 0, False)] += 1


@contextlib.contextmanager
def _disk_loads(disk: list[int]):
    """``Offload(to="disk")``'s fake store, each load's bytes appended to ``disk`` (fake tensors read no file)."""
    from .optimizations._offload_store import FakeDiskStore

    load = FakeDiskStore.load

    def counted(self, gid):
        out = load(self, gid)
        disk.append(sum(t.numel() * t.element_size() for t in out))
        return out

    FakeDiskStore.load = counted
    try:
        yield
    finally:
        FakeDiskStore.load = load


def _count(build: Callable[[], nn.Module], lengths, *, step, optimizations, dtype, batch_size, seed, sizes) -> Counter:
    """The steady step's ops of the model ``build()`` makes (its block lists cut to ``lengths``: name -> blocks)."""
    disk: list[int] = []
    with warnings.catch_warnings(), FakeTensorMode(), _default_dtype(dtype), planning("cuda") as plan:
        warnings.simplefilter("ignore")
        net = build()
        for name, module in net.named_modules():
            if name in (lengths or {}):
                del module[lengths[name] - 1 : -1]  # the first k-1 blocks and the last
        with apply_all(net, optimizations) as handle, contextlib.ExitStack() as stack:
            kwargs = make_inputs(net, batch_size=batch_size, seed=seed, **sizes)
            stack.enter_context(_compat.known_values(kwargs))
            runner = step.bind(net, handle)
            for _ in range(step.runs - 1):
                runner.run(kwargs)
            host = [t for ts in plan.host.values() for t in ts]
            with _disk_loads(disk), _Counter(host, disk, fake=True).hooks() as counter:
                runner.run(kwargs)
    return counter.ops


@contextlib.contextmanager
def counting() -> Iterator[OpCounts]:
    """Count the ops of the code inside the block (real or fake tensors, no host memory or disk noted) into the
    yielded :class:`OpCounts`, filled when the block ends.

    Example:
        >>> with counting() as c:
        ...     layer(x).sum().backward()
        >>> c.by_class()["matmul"]
    """
    counts = OpCounts(Counter(), {"memoized": False, "memo": "counted as run"})
    with _Counter([], []).hooks() as counter:
        yield counts
    counts.ops.update(counter.ops)


def count_ops(
    model: str | Callable[[], nn.Module],
    size: str = "full",
    mode: str = "training",
    optimizations: Sequence[Optimization] = (),
    batch_size: int = 1,
    dtype: torch.dtype | None = None,
    optimizer: str | None = "auto",
    *,
    steps: int | None = None,
    seed: int = 0,
    memoize: bool = True,
    **sizes: int,
) -> OpCounts:
    """The ops of the steady step (step 2; ``steps=N``: step N) :func:`memkit.estimate` measures, on a GPU.

    Arguments are :func:`memkit.estimate`'s (a preset name or a callable building the model; AdamW in bf16 by default;
    foreach optimizers as on CUDA). With ``memoize`` a model with lists of more than 5 identical blocks is built whole
    (fake tensors: no memory) and counted with each list cut to its first 3 blocks and its last, then once per list
    with 4 and the last, and every further block adds what the added one did (blocks are identical, so each one's
    ops are the same; a ``_foreach`` op is counted per tensor, so the optimizer's ops add up per block too): equal to
    counting every block (``tests/test_steptime.py``) where the estimate itself memoizes (:func:`memkit._memo.
    unsupported` says where not: a checkpointing pattern that picks some blocks, an EMA staged or in host memory,
    offload; those count every block). ``meta`` holds the settings and which was done (``memoized``, ``memo``). Its
    runs cost ~3x an estimate: ``memkit.estimate(..., count_ops=True)`` counts the same ops as it runs
    (``timeline.op_counts``).

    Example:
        >>> counts = count_ops("flux", optimizations=[memkit.Checkpointing()])
        >>> counts.flops / 1e12, counts.recompute_flops() / counts.flops
    """
    step = _step_of(None, mode, optimizer, steps)
    if step.optimizer is not None:
        step = dataclasses.replace(step, foreach=True)  # torch's default on CUDA
    dtype = torch.bfloat16 if dtype is None else dtype
    preset = None
    if isinstance(model, str):
        ref = resolve(model)
        preset = config_preset(ref)

        def build() -> nn.Module:
            if ref.preset is not None:
                return load_model(ref.preset, size=size, dtype=dtype, seed=seed)
            return _build(preset, size, dtype, seed, torch.device("cpu"))
    elif callable(model):
        build = model
    else:
        raise TypeError(f"model must be a preset name or a callable returning a model, got {type(model).__name__}")
    run = dict(
        step=step, optimizations=tuple(optimizations), dtype=dtype, batch_size=batch_size, seed=seed, sizes=sizes
    )
    label = model if isinstance(model, str) else getattr(model, "__name__", "model")
    settings = dict(model=label, size=size, step=str(step), optimizations=[str(o) for o in optimizations], sizes=sizes)
    # its probe and one block more (below): a checkpointing pattern's period would shift its phase
    why = "memoize=False" if not memoize else _memo.unsupported(optimizations, None, step, True, periodic=False)
    if why is None and preset is not None:
        why = _memo.refused(preset.model_class)
    lists = None
    if why is None:
        with FakeTensorMode(), _default_dtype(dtype):
            net = build()
            keep = _memo._CUT_WHOLE.get(type(net).__name__)  # its other lists are not blocks (Chroma's approximator)
            lists = [(name, len(b)) for name, b in _memo.block_lists(net) if keep is None or name in keep]
        lists = [(name, n) for name, n in lists if n > _memo.PROBE + 1]
        if not lists:
            why = f"the model has no list of more than {_memo.PROBE + 1} identical blocks"
    if why is not None:
        return OpCounts(_count(build, None, **run), dict(settings, memoized=False, memo=why))
    probe = {name: _memo.PROBE for name, _ in lists}
    base = _count(build, probe, **run)
    total = Counter(base)
    for name, n in lists:
        more = _count(build, {**probe, name: _memo.PROBE + 1}, **run)
        total.update({op: (n - _memo.PROBE) * (more[op] - base[op]) for op in more.keys() | base.keys()})
    if any(v < 0 for v in total.values()):  # a block's ops are not the same in the probe: count every block
        why = "the fifth block's ops differ from the others'"
        return OpCounts(_count(build, None, **run), dict(settings, memoized=False, memo=why))
    total = Counter({op: v for op, v in total.items() if v})
    memo = f"{_memo.PROBE} blocks per list, +1 per list, extrapolated to {dict(lists)}"
    return OpCounts(total, dict(settings, memoized=True, memo=memo))


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step's roofline seconds on one GPU, and where they go.

    Example:
        >>> t = step_seconds(counts, gpu); t.seconds, t.by_class["matmul"], t.recompute_seconds
    """

    seconds: float
    """The step: device ops summed, then transfers (summed with them, or overlapped: see ``overlap``)."""
    by_class: dict[str, float]
    compute_bound_seconds: float
    """Of the device ops' seconds, those of ops whose FLOPs take longer than their bytes."""
    memory_bound_seconds: float
    transfer_seconds: float
    """Host link and disk (``"transfer"`` + ``"disk"``)."""
    recompute_seconds: float
    """Of the device ops' seconds, those of the forward ops checkpointing runs again in the backward."""
    why: str
    recompute_by_class: dict[str, float] = dataclasses.field(default_factory=dict)
    """``recompute_seconds`` by op class."""


def _speeds(gpu: Any, dtype: str) -> tuple[float, float, float]:
    if isinstance(gpu, str):
        from . import gpus

        gpu = gpus.find(gpu)
    missing = [a for a in ("flops", "memory_bandwidth", "host_link") if getattr(gpu, a, None) is None]
    if missing:
        raise ValueError(f"gpu {getattr(gpu, 'key', gpu)!r} has no {', '.join(missing)}: the roofline needs them")
    if dtype not in gpu.flops:
        raise ValueError(f"dtype must be one of {sorted(gpu.flops)} for this GPU, got {dtype!r}")
    return float(gpu.flops[dtype]), float(gpu.memory_bandwidth), float(gpu.host_link)


def step_seconds(
    counts: OpCounts,
    gpu: Any,
    dtype: str = "bf16",
    efficiency: Mapping[str, tuple[float, float]] | None = None,
    *,
    overlap: bool = True,
) -> StepTime:
    """The roofline time of ``counts`` on ``gpu`` (a name for :func:`memkit.gpus.find`, or any object with ``flops``
    (dtype -> dense FLOP/s), ``memory_bandwidth`` and ``host_link`` (B/s)): each device op takes the longer of its
    FLOPs at ``dtype``'s peak and its bytes at the memory bandwidth, each times its class's ``efficiency``
    (:data:`EFFICIENCY`, overridden per class); transfers take their bytes over the host link, disk reads over
    :data:`NVME_READ`. ``overlap``: the transfers run beside the compute (prefetch, as ``memkit.Offload`` does), so the
    step takes the longer of the two; False: one after the other. Host ops (a CPU optimizer's) are not timed.

    Example:
        >>> step_seconds(count_ops("flux"), "h100").seconds
    """
    peak, bandwidth, link = _speeds(gpu, dtype)
    eff = {**EFFICIENCY, **(efficiency or {})}
    by_class = dict.fromkeys(CLASSES, 0.0)
    again = dict.fromkeys(CLASSES, 0.0)
    compute = memory = recompute = 0.0
    for op, n in counts.ops.items():
        if op.kind == "host":
            continue
        if op.kind == "disk":
            by_class["disk"] += n * op.read / NVME_READ
            continue
        if op.kind == "transfer":
            by_class["transfer"] += n * op.read / (link * eff["transfer"][1])
            continue
        f_eff, b_eff = eff[op.kind]
        t_flops = op.flops / (peak * f_eff)
        t_bytes = (op.read + op.written) / (bandwidth * b_eff)
        t = n * max(t_flops, t_bytes)
        by_class[op.kind] += t
        if t_flops > t_bytes:
            compute += t
        else:
            memory += t
        if op.recompute:
            recompute += t
            again[op.kind] += t
    device = compute + memory
    moving = by_class["transfer"] + by_class["disk"]
    total = max(device, moving) if overlap else device + moving
    lead = max((c for c in CLASSES if c not in _OFF_GPU), key=lambda c: by_class[c])
    why = (
        f"{device * 1e3:.1f} ms of device ops ({compute / device if device else 0:.0%} compute-bound; most in "
        f"{lead}: {by_class[lead] * 1e3:.1f} ms), {recompute * 1e3:.1f} ms of it recompute"
    )
    if moving:
        how = "overlapped with" if overlap else "after"
        why += f"; {moving * 1e3:.1f} ms moving weights or activations over the host link and disk, {how} the compute"
    if counts.by_class("ops")["host"]:
        why += "; ops on host tensors (a CPU optimizer) are not timed"
    return StepTime(total, by_class, compute, memory, moving, recompute, why, again)
