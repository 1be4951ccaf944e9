"""Where :class:`memkit.Offload` keeps a group's weights while it is offloaded: CPU memory or a file per group.

A store saves a group's tensors once (``save``), gives them back (``load``, or ``prefetch``: the same, started now
and waited for later), takes changed values back (``write_back``) and is told when a group is offloaded
(``release``). The disk store maps each group's file into memory copy-on-write (nothing copied: the page cache's
pages are the weights), keeps the mapping, and gives its pages back when the group is offloaded. Files are
safetensors (readable by ``safetensors.safe_open``), written to a temporary name and renamed into place, and
checked on every load (size and header: names, dtypes, shapes, offsets; a kept mapping: the file's inode, size and
modification time). Under ``FakeTensorMode`` (``memkit.estimate``) nothing is written or read: a load only
allocates, so the estimate counts the onloaded groups.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..memory.recording import released, tag
from ..memory.tracker import off_device
from ._offload_file import _ALIGN, _DTYPES, OffloadError, _bytes_view, _check_header, _write  # noqa: F401


class _Done:
    """A finished load, shaped like a Future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _posix_mapping() -> bool:
    """Whether offload files are mapped into memory (copy-on-write) rather than read: on POSIX systems. Windows
    cannot replace a file that is mapped, which writing a changed group back does."""
    return os.name == "posix" and hasattr(mmap.mmap, "madvise")


def _advise(mapped: mmap.mmap, advice: str) -> bool:
    """``mapped.madvise(mmap.<advice>)``; False where the system lacks it or refuses."""
    try:
        mapped.madvise(getattr(mmap, advice))
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _read_ahead(mapped: mmap.mmap) -> None:
    """Ask the kernel to read a mapped file ahead (``MADV_WILLNEED``: the reads start now, asynchronously; pages in
    the page cache already cost nothing, and none is mapped, so RSS grows only when the compute touches them).
    Measured on this project's 2-core VM with the files evicted (bench/offload.py, 2026-11-24): a cold forward took
    1.47-1.58x the model in RAM with this, with ``MADV_POPULATE_READ`` (which also maps every page, from the reader
    thread) or with no hint at all, prefetch 1 or 0 alike: none of them hid the disk reads there."""
    _advise(mapped, "MADV_WILLNEED")


def _stamp(file: str | int) -> tuple[int, int, int] | None:
    """A file's (inode, size, modification time in ns), by path or open descriptor: it changes when the file is
    written or replaced (None: it cannot be read)."""
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class _Mapping:
    """A group's file mapped copy-on-write: the mapping, a uint8 tensor of all of it, the group's tensors as views
    of that, the file's stamp when mapped, and the group's bytes."""

    __slots__ = ("mapped", "whole", "views", "stamp", "nbytes")

    def __init__(self, mapped: mmap.mmap, whole: torch.Tensor, views: list[torch.Tensor], stamp, nbytes: int):
        self.mapped, self.whole, self.views, self.stamp, self.nbytes = mapped, whole, views, stamp, nbytes


class _Tagging:
    """A prefetch's future whose device tensors are told to the trackers by the thread that takes them."""

    def __init__(self, future: Future):
        self.future = future

    def result(self) -> list[torch.Tensor]:
        out = self.future.result()
        tag(out, "parameter", made="to (read ahead)")  # made on the reader thread, where no tracker sees
        return out


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

    def release(self, gid: int) -> None:
        """The group was offloaded: nothing to give back (the host tensors are the store itself)."""

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

    def release(self, gid) -> None:
        pass

    def close(self) -> None:
        self.meta.clear()


class DiskStore:
    """One safetensors file per group in a fresh folder (``tempfile.mkdtemp(prefix="memkit-offload-")`` under
    ``path``): never another model's files.

    A load maps the group's file into memory, copy-on-write (``mmap.ACCESS_COPY``), after checking its size and
    header, and gives views of the mapping: nothing is copied, the page cache's pages are the weights, and the
    data starting on a 64-byte boundary puts each tensor where torch's allocator would (so kernels take the same
    paths and results are bit for bit the model's in RAM). On the CPU the mapping is kept for the next loads, while
    the file keeps its inode, size and modification time (checked on every load; else it is mapped and checked
    again), and :meth:`release` (the group offloaded) gives its pages back (``MADV_DONTNEED``): RSS drops, the page
    cache keeps the file, and the next touch maps the pages again. Writes into a load (an optimizer step) copy the
    pages they touch and never reach the file; :meth:`write_back` writes a new file in its place and lets the old
    mapping go, never giving back its pages, so whatever still holds a view of it (autograd, the caller) keeps its
    values. Each file is written in one ``os.writev``, so the kernel can keep it in 2 MiB folios and map it with
    huge pages. A prefetch maps on the calling thread (so a memory tracker sees the load) and asks the kernel to
    read the file ahead from a background thread (``MADV_WILLNEED``): on a real disk, the reads overlap the
    compute. Where files are not mapped (Windows) and for tensors handed to the caller to keep (:meth:`read`: a
    state_dict, the weights after ``remove()``), the file is read into fresh memory. On an accelerator the
    mapping, new for each load, is the host side of the copy to the device. The folder is the process's own
    (``mkdtemp``: mode 0700): a file truncated by someone else between a load's check and the compute would fault
    on access, as with any memory-mapped file (safetensors' own loading maps files too)."""

    kind = "disk"

    def __init__(self, device: torch.device, path: str | os.PathLike | None):
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
        self.heads: dict[int, bytes] = {}  # each file's first bytes as written (length and header)
        self.bytes_read = 0
        self.bytes_written = 0
        self.mapped = 0  # loads served by mapping the file
        self.map = _posix_mapping()
        self._kept: dict[int, _Mapping] = {}  # on the CPU: each group's mapping, kept between loads
        self._pool: ThreadPoolExecutor | None = None

    # -- writing -------------------------------------------------------------------------------------------
    def save(self, gid: int, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        path = os.path.join(self.folder, f"group-{gid:04d}.safetensors")
        self.files[gid] = path
        self.layout[gid], self.heads[gid] = _write(path, names, tensors)
        self.bytes_written += os.path.getsize(path)

    def write_back(self, gid: int, tensors: Sequence[torch.Tensor]) -> None:
        names = [name for name, *_ in self.layout[gid]]
        self.layout[gid], self.heads[gid] = _write(self.files[gid], names, tensors)
        self.bytes_written += os.path.getsize(self.files[gid])
        self._kept.pop(gid, None)  # it holds the changed pages: unmapped when its last view goes, never dropped

    # -- reading -------------------------------------------------------------------------------------------
    def _open(self, gid: int):
        """The group's file, open and checked against what was written (its size, and its header: the bytes as
        written, or else parsed and compared entry by entry); returns the file and where its data starts."""
        path, layout, head = self.files[gid], self.layout[gid], self.heads[gid]
        f = open(path, "rb", buffering=0)
        try:
            expected = len(head) + max((end for *_, end in layout), default=0)
            if os.fstat(f.fileno()).st_size == expected and f.read(len(head)) == head:
                return f, len(head)
            f.seek(0)
            return f, _check_header(f, path, layout)
        except BaseException:
            f.close()
            raise

    def _fill(self, gid: int, out: list[torch.Tensor]) -> list[torch.Tensor]:
        path = self.files[gid]
        layout = self.layout[gid]
        try:
            f, start = self._open(gid)
            with f:
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
        return out

    def _map(self, gid: int) -> tuple[list[torch.Tensor], mmap.mmap]:
        """The group's tensors as views of its file mapped copy-on-write, and the mapping: the one kept from an
        earlier load while the file is the same one (its inode, size and modification time), else a new one."""
        kept = self._kept.get(gid)
        if kept is not None and kept.stamp != _stamp(self.files[gid]):
            del self._kept[gid]  # written, replaced or gone since: mapped again, checked again
            kept = None
        if kept is None:
            kept = self._map_new(gid)
            if self.device.type == "cpu":
                self._kept[gid] = kept
        with self._host_side():
            tag(kept.whole, "parameter", made="mmap")
        self.bytes_read += kept.nbytes
        self.mapped += 1
        return list(kept.views), kept.mapped

    def _map_new(self, gid: int) -> _Mapping:
        path = self.files[gid]
        try:
            f, start = self._open(gid)
            with f:
                stamp = _stamp(f.fileno())
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OffloadError:
            raise
        except (OSError, ValueError) as e:
            raise OffloadError(getattr(e, "errno", 0) or 0, f"cannot map offload file {path!r}: {e}", path) from e
        _advise(mapped, "MADV_HUGEPAGE")
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        layout = self.layout[gid]
        views = [whole[start + b : start + e].view(dtype).view(shape) for _, dtype, shape, b, e in layout]
        return _Mapping(mapped, whole, views, stamp, sum(end - begin for *_, begin, end in layout))

    def release(self, gid: int) -> None:
        """The group was offloaded: its kept mapping gives its pages back (``MADV_DONTNEED``: RSS drops, the page
        cache keeps the file, the next load maps the pages again) and the trackers record the memory freed. The
        pages are the file's own (a changed group is written back, and its mapping let go, before it is offloaded),
        so nothing is lost."""
        kept = self._kept.get(gid)
        if kept is None:
            return
        if not _advise(kept.mapped, "MADV_DONTNEED"):
            del self._kept[gid]  # then it is unmapped when its last view goes, as a mapping not kept
            return
        with self._host_side():
            released(kept.whole)

    def _host_side(self):
        """On an accelerator, what a load holds in CPU memory is the host side of the copy to the device: trackers
        count it off the device's timeline (:func:`off_device`). On the CPU it is the weights themselves."""
        return off_device() if self.device.type != "cpu" else contextlib.nullcontext()

    def _fresh(self, gid: int) -> list[torch.Tensor]:
        with self._host_side():
            out = [torch.empty(shape, dtype=dtype) for _, dtype, shape, _, _ in self.layout[gid]]
        tag(out, "parameter")
        return out

    def _to_device(self, host: list[torch.Tensor], tagged: bool = True) -> list[torch.Tensor]:
        """The host tensors copied to the device (``tagged``: told to the trackers, which only the calling thread
        may do; a prefetch's copies are told when the caller takes them)."""
        if self.device.type == "cpu":
            return host
        out = [t.to(self.device, non_blocking=True) for t in host]
        if tagged:
            tag(out, "parameter")
        return out

    def load(self, gid: int) -> list[torch.Tensor]:
        host = self._map(gid)[0] if self.map else self._fill(gid, self._fresh(gid))
        return self._to_device(host)

    def prefetch(self, gid: int) -> Future | _Tagging:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memkit-offload")
        if not self.map:
            out = self._fresh(gid)
            future = self._pool.submit(lambda: self._to_device(self._fill(gid, out), tagged=False))
        else:
            out, mapped = self._map(gid)

            def bring_in() -> list[torch.Tensor]:
                _read_ahead(mapped)
                return self._to_device(out, tagged=False)

            future = self._pool.submit(bring_in)
        return future if self.device.type == "cpu" else _Tagging(future)

    def read(self, gid: int) -> list[torch.Tensor]:
        """The group's values in fresh memory (never mapped), for the caller to keep: a state_dict's entries."""
        return self._to_device(self._fill(gid, self._fresh(gid)))

    def restore(self, gid: int, current: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """What the parameters get back on ``remove()``: the group's current values (``current``, when onloaded)
        or its file's, never on a mapping of a file about to go (that would keep the file's disk space until the
        model is freed): mapped ones are copied."""
        if current is None:
            return self.read(gid)
        if not (self.map and self.device.type == "cpu"):  # read into fresh memory, or copied to the device
            return list(current)
        with torch.no_grad():
            return [t.clone() for t in current]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._kept.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
