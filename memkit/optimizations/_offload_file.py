"""The offload files: safetensors written atomically and aligned, and their headers checked when read back."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import torch

from ..memory.tracker import off_device

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


class OffloadError(OSError):
    """An offload file could not be written or read; the message names the file and what the model is left as."""


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, shared (bf16 has no numpy dtype: view it as bytes first)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_ALIGN = 64  # bytes: where a file's data starts, and so every tensor whose bytes are a multiple of it


def _write(path: str, names: Sequence[str], tensors: Sequence[torch.Tensor]):
    """Write ``tensors`` as a safetensors file at ``path`` atomically (a temporary name, then ``os.replace``);
    returns each tensor's (name, dtype, shape, begin, end) in the given order, and the file's first bytes (its
    header's length and the header). The data starts on a 64-byte boundary. Tensors whose bytes are a multiple of
    64 come first (each starts on a 64-byte boundary, as torch's allocator places tensors), then the rest widest
    dtype first (each aligned to its element size). On failure no file is left and an OffloadError names
    ``path``."""
    cpu = []
    with off_device():
        for t in tensors:
            t = t.detach()
            cpu.append(t.to("cpu").contiguous() if t.device.type != "cpu" else t.contiguous())
    nbytes = [t.numel() * t.element_size() for t in cpu]
    order = sorted(range(len(cpu)), key=lambda i: (nbytes[i] % _ALIGN != 0, -cpu[i].element_size()))
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
    raw += b" " * (-(8 + len(raw)) % _ALIGN)  # the data starts on a cache line
    head = struct.pack("<Q", len(raw)) + raw
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            _write_all(f, [head, *(_bytes_view(cpu[i]) for i in order if cpu[i].numel())])
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OffloadError(
            e.errno, f"cannot write offload file {path!r}: {e.strerror or e}; the weights stay in memory", path
        ) from e
    return layout, head


def _write_all(f, chunks: list) -> None:
    """Write the bytes-like ``chunks`` to the new file ``f``, one after another, in as few system calls as can be
    (``os.writev``): the kernel sees one long write and fills the page cache with large folios, up to 2 MiB, which
    it then maps with huge pages (separate writes leave small folios at each one's start; measured on this VM, a
    PixArt-small block's file: 16 of its 16 MiB mapped with 2 MiB pages, against 4 MiB). Where there is no
    ``writev`` (Windows): one ``write`` each."""
    writev = getattr(os, "writev", None)
    if writev is None:
        for c in chunks:
            f.write(c)
        return
    f.flush()
    views = [v for v in (memoryview(c).cast("B") for c in chunks) if len(v)]
    limit = os.sysconf("SC_IOV_MAX")
    while views:
        n = writev(f.fileno(), views[:limit])
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:  # a short write stopped inside a chunk: go on from there
            views[0] = views[0][n:]


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
