"""Where :class:`memkit.Offload` keeps a group's weights while it is offloaded: CPU memory or a file per group.

A store saves a group's tensors once (``save``), gives them back (``load``, or ``prefetch``: the same, started now
and waited for later), and takes changed values back (``write_back``). The disk store reads into a small pool of
reused buffers (:class:`_Buffers`), so steady-state forwards allocate no weight memory. Files are safetensors
(readable by ``safetensors.safe_open``), written to a temporary name and renamed into place, and checked on every
read (header, names, dtypes, shapes, file size). Under ``FakeTensorMode`` (``memkit.estimate``) nothing is written
or read: a load only allocates, so the estimate counts the onloaded groups.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..memory.tracker import off_device, tag

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ALIGN = 8  # safetensors pads its header to 8 bytes
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it buffers are never reused


class OffloadError(OSError):
    """An offload file could not be written or read; the message names the file and what the model is left as."""


class _Done:
    """A finished load, shaped like a Future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, shared (bf16 has no numpy dtype: view it as bytes first)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _holders(t: torch.Tensor) -> int:
    """References to the storage behind ``t``: one per tensor or view using it, one for its Python object."""
    return _use_count(t.untyped_storage()._cdata)


_ALIGN = 64  # bytes: each tensor carved out of a buffer starts on a cache line (and any dtype's alignment)


def _carve(key: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> tuple[list[tuple[int, int]], int]:
    """Where each tensor of a group's layout lies in a flat buffer (start, bytes), and the bytes the buffer needs."""
    spans, at = [], 0
    for dtype, shape in key:
        n = math.prod(shape) * dtype.itemsize
        spans.append((at, n))
        at += -(-n // _ALIGN) * _ALIGN
    return spans, at


class _Buffers:
    """Reused read buffers for the disk store: ``capacity`` (``prefetch + 1``: the group computing and those read
    ahead) flat byte buffers of the largest group's size (``nbytes``), least recently used first; a group's tensors
    are carved out of one of them (views, each aligned to 64 bytes), whatever its layout, so blocks and the small
    layers outside them share the same few buffers. A buffer is handed out again only when nothing but the pool
    holds its storage: its use count is back to what it was when the pool made it. So not while the reader thread
    fills it, a group computes with it, or autograd (a layer that saves its weight outside the offloader's
    saved-tensor hooks), an optimizer or the caller keeps a tensor aliasing it: reusing it then would silently
    change their values. When every buffer is held so (or a group holding a parameter of its own stays in use
    while its layers load, at leaf level), the group reads into fresh memory of its own size, freed when it is
    dropped (``fresh`` counts those)."""

    def __init__(self, capacity: int, nbytes: int = 0):
        self.capacity = capacity if _use_count is not None else 0
        self.nbytes = nbytes
        self.sets: list[tuple[torch.Tensor, int]] = []  # (flat uint8 buffer, its use count when free)
        self.lock = threading.Lock()
        self.reused = 0
        self.allocated = 0  # pool buffers made (at most capacity)
        self.fresh = 0  # reads into memory of their own, outside the pool

    def take(self, key: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> list[torch.Tensor]:
        spans, need = _carve(key)
        with self.lock:
            for i, (buf, free) in enumerate(self.sets):
                if buf.numel() >= need and _holders(buf) <= free:
                    self.sets.append(self.sets.pop(i))
                    self.reused += 1
                    return _views(buf, key, spans)
            if len(self.sets) < self.capacity:
                buf = torch.empty(max(need, self.nbytes), dtype=torch.uint8)
                self.sets.append((buf, _holders(buf)))
                self.allocated += 1
            else:
                buf = torch.empty(need, dtype=torch.uint8)
                self.fresh += 1
            return _views(buf, key, spans)

    def clear(self) -> None:
        with self.lock:
            self.sets.clear()


def _views(buf: torch.Tensor, key, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The layout's tensors on ``buf``'s storage: new tensors (never the pool's own), so every holder is counted."""
    return [buf[at : at + n].view(dtype).view(shape) for (dtype, shape), (at, n) in zip(key, spans, strict=True)]


class CudaStreams:
    """The one CUDA-only piece: prefetch copies on a side stream, an event after them, and the compute stream
    waiting for that event before it uses the weights (which are recorded on it, so the allocator does not reuse
    their memory while the side stream may still write it). ``cuda`` is ``torch.cuda`` (tests pass a stand-in)."""

    def __init__(self, cuda, device: torch.device):
        self.cuda, self.device = cuda, device
        self.side = cuda.Stream(device=device)

    def copy_in(self, host: Sequence[torch.Tensor]) -> _Pending:
        with self.cuda.stream(self.side):
            out = [h.to(self.device, copy=True, non_blocking=True) for h in host]
            event = self.cuda.Event()
            event.record(self.side)
        return _Pending(self, out, event)


class _Pending:
    """Copies issued on the side stream; ``result()`` makes the compute stream wait for them."""

    def __init__(self, streams: CudaStreams, out: list[torch.Tensor], event):
        self.streams, self.out, self.event = streams, out, event

    def result(self) -> list[torch.Tensor]:
        current = self.streams.cuda.current_stream(self.streams.device)
        current.wait_event(self.event)
        for t in self.out:
            t.record_stream(current)
        return self.out


class HostStore:
    """Weights kept in CPU memory: the original CPU tensors themselves, or pinned copies of accelerator ones;
    a load copies them to the device (non-blocking from pinned memory on CUDA, prefetches on a side stream)."""

    kind = "cpu"

    def __init__(self, device: torch.device):
        self.device = device
        self.host: dict[int, list[torch.Tensor]] = {}
        self.streams = CudaStreams(torch.cuda, device) if device.type == "cuda" else None

    def save(self, gid: int, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        if self.device.type == "cpu":
            self.host[gid] = list(tensors)  # they are host memory already: keep them, copy on each load
            return
        with off_device():
            copies = [t.detach().to("cpu", copy=True) for t in tensors]
            if torch.cuda.is_available():
                copies = [c.pin_memory() for c in copies]
        self.host[gid] = copies

    def load(self, gid: int) -> list[torch.Tensor]:
        cuda = self.device.type == "cuda"
        out = [h.to(self.device, copy=True, non_blocking=cuda) for h in self.host[gid]]
        tag(out, "parameter")
        return out

    def prefetch(self, gid: int) -> _Done | _Pending:
        if self.streams is None:
            return _Done(self.load(gid))
        pending = self.streams.copy_in(self.host[gid])
        tag(pending.out, "parameter")
        return pending

    def read(self, gid: int) -> list[torch.Tensor]:
        """The real values, for a state_dict: the host tensors (copies of them, so nobody writes into them)."""
        return [h.detach().clone() for h in self.host[gid]]

    def write_back(self, gid: int, tensors: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for h, t in zip(self.host[gid], tensors, strict=True):
                h.copy_(t)

    def restore(self, gid: int, current: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """What the parameters get back on ``remove()``: the host tensors (the originals, on the CPU), updated
        from ``current`` when the group is onloaded."""
        if current is not None:
            self.write_back(gid, current)
        if self.device.type == "cpu":
            return self.host[gid]
        return self.load(gid)

    def close(self) -> None:
        self.host.clear()


class FakeDiskStore:
    """``to="disk"`` inside an estimate (fake tensors hold no data): nothing is written, a load allocates."""

    kind = "disk"

    def __init__(self, device: torch.device):
        self.device = device
        self.meta: dict[int, list[tuple[torch.Size, torch.dtype]]] = {}
        self.nbytes = 0

    def save(self, gid, names, tensors) -> None:
        self.meta[gid] = [(t.shape, t.dtype) for t in tensors]
        self.nbytes += sum(t.numel() * t.element_size() for t in tensors)

    def load(self, gid: int) -> list[torch.Tensor]:
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.meta[gid]]
        tag(out, "parameter")
        return out

    def prefetch(self, gid: int) -> _Done:
        return _Done(self.load(gid))

    read = load

    def write_back(self, gid, tensors) -> None:
        pass

    def restore(self, gid, current):
        return current if current is not None else self.load(gid)

    def close(self) -> None:
        self.meta.clear()


class DiskStore:
    """One safetensors file per group in a fresh folder (``tempfile.mkdtemp(prefix="memkit-offload-")`` under
    ``path``): never another model's files. Reads run on one background thread for prefetches, into buffers
    taken on the calling thread (so a memory tracker sees them as they are made) from a pool of ``buffers`` groups'
    worth (the largest group's bytes each) that are reused once nobody holds them (:class:`_Buffers`), by blocks
    and the layers outside them alike. On an accelerator the pool's buffers are
    the host side of the copy (pageable memory: the copy has read them when ``to()`` returns)."""

    kind = "disk"

    def __init__(self, device: torch.device, path: str | os.PathLike | None, buffers: int = 2):
        self.device = device
        parent = os.fspath(path) if path is not None else None
        try:
            if parent is not None:
                os.makedirs(parent, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix="memkit-offload-", dir=parent)
        except OSError as e:
            where = parent or tempfile.gettempdir()
            raise OffloadError(
                e.errno, f"Offload(to='disk'): cannot create a folder for the offload files in {where!r}: "
                f"{e.strerror or e}; the model is unchanged", where,
            ) from e  # fmt: skip
        self.files: dict[int, str] = {}
        self.layout: dict[int, list[tuple[str, torch.dtype, tuple[int, ...], int, int]]] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.buffers = _Buffers(buffers)
        self._pool: ThreadPoolExecutor | None = None

    # -- writing -------------------------------------------------------------------------------------------
    def save(self, gid: int, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        path = os.path.join(self.folder, f"group-{gid:04d}.safetensors")
        self.files[gid] = path
        self.layout[gid] = _write(path, names, tensors)
        self.buffers.nbytes = max(self.buffers.nbytes, _carve(self._key(gid))[1])
        self.bytes_written += os.path.getsize(path)

    def write_back(self, gid: int, tensors: Sequence[torch.Tensor]) -> None:
        names = [name for name, *_ in self.layout[gid]]
        self.layout[gid] = _write(self.files[gid], names, tensors)
        self.bytes_written += os.path.getsize(self.files[gid])

    # -- reading -------------------------------------------------------------------------------------------
    def _key(self, gid: int) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
        return tuple((dtype, shape) for _, dtype, shape, _, _ in self.layout[gid])

    def _alloc(self, gid: int, reuse: bool = True) -> list[torch.Tensor]:
        if reuse:
            out = self.buffers.take(self._key(gid))
        else:  # for the caller to keep (a state_dict, the weights after remove()): never a pool buffer
            out = [torch.empty(shape, dtype=dtype) for dtype, shape in self._key(gid)]
        tag(out, "parameter")
        return out

    def _fill(self, gid: int, out: list[torch.Tensor]) -> list[torch.Tensor]:
        path = self.files[gid]
        layout = self.layout[gid]
        try:
            with open(path, "rb", buffering=0) as f:
                start = _check_header(f, path, layout)
                for (_, _, _, begin, end), t in sorted(zip(layout, out, strict=True), key=lambda r: r[0][3]):
                    f.seek(start + begin)
                    view, got = _bytes_view(t), 0
                    while got < end - begin:
                        n = f.readinto(view[got:])
                        if not n:
                            raise OffloadError(0, f"{path} ended early: it is truncated", path)
                        got += n
        except OffloadError:
            raise
        except OSError as e:
            raise OffloadError(e.errno, f"cannot read offload file {path!r}: {e.strerror or e}", path) from e
        self.bytes_read += sum(end - begin for *_, begin, end in layout)
        if self.device.type != "cpu":
            out = [t.to(self.device, non_blocking=True) for t in out]
        return out

    def load(self, gid: int) -> list[torch.Tensor]:
        return self._fill(gid, self._alloc(gid))

    def prefetch(self, gid: int) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memkit-offload")
        out = self._alloc(gid)
        return self._pool.submit(self._fill, gid, out)

    def read(self, gid: int) -> list[torch.Tensor]:
        return self._fill(gid, self._alloc(gid, reuse=False))

    def restore(self, gid: int, current: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        return list(current) if current is not None else self.read(gid)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.buffers.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def _write(path: str, names: Sequence[str], tensors: Sequence[torch.Tensor]):
    """Write ``tensors`` as a safetensors file at ``path`` atomically (a temporary name, then ``os.replace``);
    returns each tensor's (name, dtype, shape, begin, end) in the given order. Widest dtypes first, so every
    tensor starts aligned to its element size. On failure no file is left and an OffloadError names ``path``."""
    cpu = []
    with off_device():
        for t in tensors:
            t = t.detach()
            cpu.append(t.to("cpu").contiguous() if t.device.type != "cpu" else t.contiguous())
    order = sorted(range(len(cpu)), key=lambda i: -cpu[i].element_size())
    header, layout, offset = {}, [None] * len(cpu), 0
    for i in order:
        t = cpu[i]
        if t.dtype not in _DTYPES:
            raise ValueError(f"Offload(to='disk') cannot store dtype {t.dtype} ({names[i]})")
        n = t.numel() * t.element_size()
        header[names[i]] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        layout[i] = (names[i], t.dtype, tuple(t.shape), offset, offset + n)
        offset += n
    header["__metadata__"] = {"format": "pt", "writer": "memkit.Offload"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for i in order:
                if cpu[i].numel():
                    f.write(_bytes_view(cpu[i]))
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OffloadError(
            e.errno, f"cannot write offload file {path!r}: {e.strerror or e}; the weights stay in memory", path
        ) from e
    return layout


def _check_header(f, path: str, layout) -> int:
    """Check an open offload file against the layout it was written with; returns where the data starts."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise OffloadError(0, f"{path} is truncated ({size} bytes, no safetensors header)", path)
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise OffloadError(0, f"{path} is truncated or corrupt: header of {n} bytes in a {size}-byte file", path)
    try:
        header = json.loads(f.read(n))
    except ValueError:
        raise OffloadError(0, f"{path} is corrupt: its header is not valid JSON", path) from None
    expected = 8 + n + max((end for *_, end in layout), default=0)
    if size != expected:
        raise OffloadError(0, f"{path} is truncated or corrupt: {size} bytes, expected {expected}", path)
    for name, dtype, shape, begin, end in layout:
        entry = header.get(name) if isinstance(header, dict) else None
        want = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
        if entry != want:
            raise OffloadError(0, f"{path} is corrupt: entry {name!r} is {entry}, expected {want}", path)
    return 8 + n
