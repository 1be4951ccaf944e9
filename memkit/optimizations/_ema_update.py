"""The EMA update itself: ``shadow += weight * (param - shadow)`` for every pair, in place, with no full temporary.

Pairs whose shadow and parameter share device and dtype are lerped directly (one ``torch._foreach_lerp_``); the
others (an fp32 EMA of a bf16 model, host shadows of device parameters) go through staging buffers of at most
``chunk_mb``. The per-step bookkeeping is kept to attribute reads: on a 140-tensor model it costs ~0.1 ms next to
the lerp's pass over memory.

Example:
    >>> _lerp(shadows, list(model.parameters()), 1 - 0.999, torch.device("cpu"), memkit.EMA(), False)
    >>> # each shadow moved 0.1% of the way towards its parameter
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .. import _torch_compat as _compat

if TYPE_CHECKING:
    from .ema import EMA


def _local(shadows: list[torch.Tensor], compute: torch.device, stream: bool) -> list[bool | None]:
    """Per shadow, fixed while it lives: None for an integer one (copied), True where a parameter of its dtype on
    ``compute`` is lerped into it directly, False where every update is staged (``stream``, or off ``compute``)."""
    return [None if not s.is_floating_point() else (not stream and s.device == compute) for s in shadows]


def _lerp(
    shadows: list[torch.Tensor],
    params: list[torch.Tensor],
    weight: float,
    compute: torch.device,
    cfg: EMA,
    non_blocking: bool,
    stream: bool = False,
    local: list[bool | None] | None = None,
    stands_for: list[int] | None = None,
) -> None:
    """shadow += weight * (param - shadow) for every pair, in place; frozen parameters are copied (as diffusers).

    Pairs whose shadow and parameter share device and dtype on ``compute`` are lerped directly (one foreach
    op, no temporary), unless ``stream`` (offload: the shadows stand for host memory). The others go through
    staging buffers of at most ``chunk_mb`` each, in flat slices. ``local``: :func:`_local` of the shadows,
    computed once by a caller that updates the same shadows again (the per-step loop then reads only the
    parameters' flag, dtype and device). ``stands_for``: per pair, how many of the model's tensors it stands for
    (None: one each), which sizes the staging buffers as that model's would be (:attr:`EMAState.stands_for`).
    Called under ``torch.no_grad()``.
    """
    if local is None:
        local = _local(shadows, compute, stream)
    direct_s, direct_p, staged = [], [], []
    staged_total = 0  # the staged elements of the model the shadows stand for
    for i, (s, p, near) in enumerate(zip(shadows, params, local, strict=True)):
        if near is None or not p.requires_grad:  # integer or frozen: copied, as diffusers does
            s.copy_(p, non_blocking=non_blocking)
        elif near and p.dtype == s.dtype and p.device == compute:
            direct_s.append(s)
            direct_p.append(p)
        else:  # a DTensor pair (FSDP's shards) by its local shards: the staging buffers are plain tensors
            s, p = _shard(s), _shard(p.detach())
            staged.append((s, p))
            staged_total += s.numel() * (stands_for[i] if stands_for is not None else 1)
    if direct_s:
        if compute.type == "cpu":
            sizes = [s.numel() * s.element_size() for s in direct_s]
            small = [i for i, n in enumerate(sizes) if n < ONE_THREAD_BYTES]
            if small:
                pairs = [direct_s[i] for i in small], [direct_p[i] for i in small]
                one = THREADS.one_thread()
                t0 = time.perf_counter()
                with _one_thread() if one else contextlib.nullcontext():
                    _direct(*pairs, weight, cfg.foreach)
                THREADS.record(one, time.perf_counter() - t0, sum(sizes[i] for i in small))
                keep = set(small)
                direct_s = [s for i, s in enumerate(direct_s) if i not in keep]
                direct_p = [p for i, p in enumerate(direct_p) if i not in keep]
        if direct_s:
            _direct(direct_s, direct_p, weight, cfg.foreach)
    if staged:
        _lerp_staged(staged, weight, compute, cfg, non_blocking, stream, staged_total)


def _shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (torch refuses to mix DTensors with plain tensors in one op), else ``t``."""
    local = _compat.local_tensor(t)
    return t if local is None else local


ONE_THREAD_BYTES = 32 << 20
"""CPU shadows under this many bytes may be lerped on one thread (:class:`ThreadChoice` decides); larger ones (full
models' big matrices) always use torch's threads."""


class ThreadChoice:
    """Whether the CPU shadows under :data:`ONE_THREAD_BYTES` are lerped on one thread or on torch's, by which was
    faster per byte in its last :attr:`window` tries (the fastest of them: noise only slows a try, and a process's
    first parallel region also starts its threads): each way is tried twice, then the other way again every
    :attr:`retry` updates.

    The lerp is a pass over memory, in one parallel region per tensor. On a quiet machine torch's threads stream more
    bandwidth (the project's 2-core machine: Flux small's 140 tensors in 15 ms on two threads, 22 ms on one, a flat
    lerp of the same bytes 14 ms). On a busy one each region waits for a descheduled thread, since OpenMP's threads
    spin unless ``OMP_WAIT_POLICY=PASSIVE``: 480 ms on two threads, 21 ms on one (the flat lerp: 28 ms). Either way
    gives the same values (an elementwise pass); one instance serves the process (the load is the machine's).

    Example:
        >>> THREADS.one_thread()  # False while torch runs one thread anyway
    """

    retry = 64
    first_tries = 2
    window = 4

    def __init__(self) -> None:
        self.tries: dict[bool, list[float]] = {True: [], False: []}  # seconds per byte, the last `window` tries
        self.updates = 0  # after the first tries

    @property
    def rate(self) -> dict[bool, float]:
        """Each way's seconds per byte: the fastest of its last tries (inf before its first)."""
        return {way: min(t, default=float("inf")) for way, t in self.tries.items()}

    def one_thread(self) -> bool:
        """The way for this update."""
        if torch.get_num_threads() == 1:
            return False
        for way in (False, True):
            if len(self.tries[way]) < self.first_tries:
                return way
        rate = self.rate
        best = rate[True] < rate[False]
        self.updates += 1
        return not best if self.updates % self.retry == 0 else best

    def record(self, one: bool, seconds: float, nbytes: int) -> None:
        """How long the way ``one`` took for ``nbytes`` of shadows."""
        if not nbytes or torch.get_num_threads() == 1:
            return
        tries = self.tries[one]
        tries.append(seconds / nbytes)
        del tries[: -self.window]


THREADS = ThreadChoice()


def _direct(shadows: list[torch.Tensor], params: list[torch.Tensor], weight: float, foreach: bool) -> None:
    if foreach:
        torch._foreach_lerp_(shadows, params, weight)
    else:
        for s, p in zip(shadows, params, strict=True):
            s.lerp_(p, weight)


@contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _lerp_staged(
    pairs, weight: float, compute: torch.device, cfg: EMA, non_blocking: bool, stream: bool, total: int | None = None
) -> None:
    dtype = pairs[0][0].dtype
    chunk = max(1, int(cfg.chunk_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
    if total is None:
        total = sum(s.numel() for s, _ in pairs)
    size = min(chunk, max(total // 64, 2**16))  # the extra peak stays under ~1.6% of the staged shadows
    stage_s = stream or any(s.device != compute for s, _ in pairs)
    pbuf = torch.empty(size, dtype=dtype, device=compute)
    sbuf = torch.empty(size, dtype=dtype, device=compute) if stage_s else None

    def flush(group):
        if not group:
            return
        pv, sv, dst = [], [], []
        offset = 0
        for s, _ in group:
            n = s.numel()
            pv.append(pbuf[offset : offset + n])
            sv.append(sbuf[offset : offset + n] if sbuf is not None else s)
            dst.append(s)
            offset += n
        srcs = [p for _, p in group]
        if cfg.foreach:
            torch._foreach_copy_(pv, srcs, non_blocking=non_blocking)
            if sbuf is not None:
                torch._foreach_copy_(sv, dst, non_blocking=non_blocking)
            torch._foreach_lerp_(sv, pv, weight)
            if sbuf is not None:
                torch._foreach_copy_(dst, sv, non_blocking=non_blocking)
        else:
            for a, b in zip(pv, srcs, strict=True):
                a.copy_(b, non_blocking=non_blocking)
            for a, b, s in zip(sv, pv, dst, strict=True):
                if sbuf is not None:
                    a.copy_(s, non_blocking=non_blocking)
                a.lerp_(b, weight)
                if sbuf is not None:
                    s.copy_(a, non_blocking=non_blocking)

    group, used = [], 0
    for s, p in pairs:
        if s.dtype != dtype or not (s.is_contiguous() and p.is_contiguous()) or s.numel() > size:
            if s.is_contiguous() and p.is_contiguous() and s.dtype == dtype:
                flat_s, flat_p = s.view(-1), p.reshape(-1)
                for start in range(0, s.numel(), size):
                    flush([(flat_s[start : start + size], flat_p[start : start + size])])
            else:  # odd layouts or dtypes: one tensor, one temporary of its size
                s.lerp_(p.to(device=s.device, dtype=s.dtype), weight)
            continue
        if used + s.numel() > size:
            flush(group)
            group, used = [], 0
        group.append((s.view(-1), p.reshape(-1)))
        used += s.numel()
    flush(group)
    if non_blocking and compute.type == "cuda":
        torch.cuda.current_stream(compute).synchronize()  # the host copies must land before anyone reads them
