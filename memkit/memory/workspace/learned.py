"""Internal buffers learned from the allocator itself, once per call signature, for kernels no formula follows.

Some CPU kernels size their scratch from things a formula cannot see from Python: oneDNN's brgemm matmul and
convolution pick their blocking from the CPU's ISA, core count and cache sizes, and allocate a scratchpad
to match (bf16/fp16 matmuls and flash attention from AVX-512 up, AMX included, every convolution). For
those ops the tracker asks a worker process to run the same op once, on tensors of the same shapes, strides
and dtype, with the same thread count, CPU and ``ONEDNN_MAX_CPU_ISA``/``ATEN_CPU_CAPABILITY`` environment,
under ``torch.profiler(profile_memory=True)``, and records how far the allocator rose above what the op
leaves behind. The answer is cached per signature, in the process and on disk (a JSON file in the user's cache
folder, ``platformdirs.user_cache_dir("memkit")`` or ``MEMKIT_CACHE_DIR``, one file per torch version and CPU:
model, flags, logical cores, kernel path), so a machine pays once per distinct op call, not once per process
(a tiny model: a few dozen calls of a few milliseconds, plus ~2 s to start the worker; full Flux in bf16: 61
signatures, ~30 s). A cache file that cannot be read or written is ignored with a warning, never an error.

Why a worker process and not the profiler in-process: only one profiler session can run at a time, and the
user (or a test) may already be profiling the tracked step. Values are never sent, only layouts.

When learning is impossible (``MEMKIT_LEARN_WORKSPACE=0``, the op's tensors exceed ``MEMKIT_LEARN_MAX_BYTES``
(2 GiB by default), an argument the worker cannot rebuild, or the worker failed), the op is not silently
counted as zero: the tracker lists it in ``timeline.meta["lower_bound_ops"]``.

Example:
    >>> from memkit.memory.workspace import learned
    >>> a = torch.randn(64, 64, dtype=torch.bfloat16)
    >>> learned.learned_bytes(torch.ops.aten.mm.default, (a, a), {})   # e.g. 25600 on an AVX-512 BF16 CPU
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import warnings

import torch

from ._learn_worker import TensorSpec

_cache: dict[tuple, int | None] = {}
_lock = threading.Lock()
_worker: subprocess.Popen | None = None
_broken: str | None = None  # why the worker cannot be used in this process
_disk: dict[str, int] | None = None  # the cache file's answers (repr of the signature -> bytes), once read
_disk_warned: set[str] = set()


class _Unlearnable(Exception):
    """An argument the worker cannot rebuild."""


def enabled() -> bool:
    """False when ``MEMKIT_LEARN_WORKSPACE=0``: unmodelled ops are then flagged as lower bounds."""
    return os.environ.get("MEMKIT_LEARN_WORKSPACE", "1") != "0"


def _max_bytes() -> int:
    return int(os.environ.get("MEMKIT_LEARN_MAX_BYTES", 2 << 30))


def _spec(value, total: list[int]):
    """A hashable, picklable stand-in for one argument; tensors become their layout."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested:
            raise _Unlearnable(f"a {value.layout} tensor")
        numel = value.untyped_storage().nbytes() // value.element_size()
        total[0] += numel * value.element_size()
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.storage_offset(), numel, value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v, total) for v in value)
    if value is None or isinstance(
        value, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return value
    raise _Unlearnable(f"an argument of type {type(value).__name__}")


def _signature(func, args, kwargs) -> tuple[tuple, tuple, dict, int]:
    total = [0]
    spec_args = tuple(_spec(a, total) for a in args)
    spec_kwargs = {k: _spec(v, total) for k, v in sorted(kwargs.items())}
    if total[0] > _max_bytes():
        raise _Unlearnable(f"{total[0]} bytes of tensors, over MEMKIT_LEARN_MAX_BYTES")
    threads = torch.get_num_threads()
    key = (str(func), spec_args, tuple(spec_kwargs.items()), threads)
    return key, spec_args, spec_kwargs, threads


def learned_bytes(func, args, kwargs) -> int | None:
    """Bytes of the internal buffers one call of ``func`` allocates on this machine's kernel path, beyond its
    outputs; None when they cannot be learned (the caller flags a lower bound)."""
    if not enabled():
        return None
    try:
        key, spec_args, spec_kwargs, threads = _signature(func, args, kwargs)
    except _Unlearnable:
        return None
    try:
        return _cache[key]
    except KeyError:
        pass
    with _lock:
        if key not in _cache:
            known = _from_disk().get(repr(key))
            if known is not None:
                _cache[key] = known
            else:
                _cache[key] = _ask(
                    func._schema.name + "." + (func._overloadname or "default"), spec_args, spec_kwargs, threads
                )
                if _cache[key] is not None:
                    _to_disk(repr(key), _cache[key])
    return _cache[key]


def cache_file() -> str:
    """The file this process keeps learned answers in: one per torch version and CPU (model, flags, logical
    cores, kernel path), in ``MEMKIT_CACHE_DIR`` or the user's cache folder.

    Example:
        >>> from memkit.memory.workspace import learned
        >>> learned.cache_file()   # e.g. ~/.cache/memkit/workspace-torch2.13.0-3f9c....json
    """
    from platformdirs import user_cache_dir

    from .cpu_path import cpu_flags, cpu_path

    root = os.environ.get("MEMKIT_CACHE_DIR") or user_cache_dir("memkit")
    machine = (torch.__version__, cpu_path(), sorted(cpu_flags()), _cpu_model(), os.cpu_count())
    digest = hashlib.sha256(repr(machine).encode()).hexdigest()[:16]
    return os.path.join(root, f"workspace-torch{torch.__version__}-{digest}.json")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _warn_once(what: str, path: str, e: Exception) -> None:
    if what not in _disk_warned:
        _disk_warned.add(what)
        warnings.warn(
            f"memkit: the workspace cache {path} cannot be {what} ({type(e).__name__}: {e}); it is ignored, and "
            "kernel buffers are learned again in each process",
            stacklevel=4,
        )


def _read_file(path: str) -> dict[str, int]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not all(isinstance(k, str) and type(v) is int for k, v in data.items()):
        raise ValueError("not a mapping of signatures to byte counts")
    return data


def _from_disk() -> dict[str, int]:
    global _disk
    if _disk is None:
        path = cache_file()
        try:
            _disk = _read_file(path) if os.path.exists(path) else {}
        except (OSError, ValueError) as e:
            _warn_once("read", path, e)
            _disk = {}
    return _disk


def _to_disk(signature: str, nbytes: int) -> None:
    """Add one answer to the cache file: merged with what other processes wrote meanwhile, replaced atomically."""
    _from_disk()[signature] = nbytes
    path = cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            merged = {**_read_file(path), **_disk}
        except (OSError, ValueError):
            merged = dict(_disk)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(merged, f)
        os.replace(tmp, path)
    except OSError as e:
        _warn_once("written", path, e)


def _ask(op: str, args, kwargs, threads: int) -> int | None:
    global _broken
    if _broken is not None:
        return None
    try:
        worker = _start()
        data = pickle.dumps((op, args, kwargs, threads), protocol=4)
        worker.stdin.write(struct.pack(">I", len(data)) + data)
        worker.stdin.flush()
        status, value = _read(worker.stdout)
    except (OSError, EOFError, pickle.PickleError) as e:
        _broken = f"the workspace worker failed ({type(e).__name__}: {e})"
        _stop()
        warnings.warn(f"memkit: {_broken}; ops it would have measured are flagged as lower bounds", stacklevel=2)
        return None
    return int(value) if status == "ok" else None


def _read(stream) -> tuple[str, object]:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError("the worker closed its pipe")
    (n,) = struct.unpack(">I", head)
    body = stream.read(n)
    if len(body) < n:
        raise EOFError("the worker closed its pipe mid-answer")
    return pickle.loads(body)


def _start() -> subprocess.Popen:
    global _worker
    if _worker is not None and _worker.poll() is None:
        return _worker
    _worker = subprocess.Popen(
        [sys.executable, "-m", "memkit.memory.workspace._learn_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    status, _ = _read(_worker.stdout)
    if status != "ready":
        raise EOFError(f"the worker answered {status!r} instead of 'ready'")
    return _worker


def _stop() -> None:
    global _worker
    worker, _worker = _worker, None
    if worker is not None and worker.poll() is None:
        try:
            worker.stdin.close()
            worker.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            worker.kill()


atexit.register(_stop)


def cache_info() -> dict[str, int]:
    """How many signatures this process knows the answer to (learned or read from the cache file), and how many
    could not be learned (``None`` answers)."""
    return {"learned": sum(v is not None for v in _cache.values()), "failed": sum(v is None for v in _cache.values())}
