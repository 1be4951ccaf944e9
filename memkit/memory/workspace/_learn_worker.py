"""The worker process behind :mod:`memkit.memory.workspace.learned`: runs one op on tensors shaped like the
tracked call's, under ``torch.profiler(profile_memory=True)``, and answers how far the CPU allocator rose
above what the op leaves behind (its internal buffers).

Protocol (stdin/stdout, binary): each request and answer is a 4-byte big-endian length and a pickle.
A request is ``(op, args, kwargs, threads)`` with tensors replaced by :class:`TensorSpec`; the answer is
``("ok", bytes)`` or ``("error", message)``. Only memkit's own parent process talks to it.

Run as ``python -m memkit.memory.workspace._learn_worker``.
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import NamedTuple


class TensorSpec(NamedTuple):
    """What the worker needs to rebuild a tensor argument: its layout and dtype, not its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_numel: int
    dtype: object  # torch.dtype


def _resolve(op: str):
    import torch

    name, _, overload = op.partition(".")
    namespace, _, opname = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), opname)
    return getattr(packet, overload or "default")


def _tensor(spec: TensorSpec):
    import torch

    base = torch.empty(max(spec.storage_numel, 1), dtype=spec.dtype)
    if base.is_floating_point() or base.is_complex():
        base.uniform_(-1, 1)
    else:
        base.zero_()
    return base.as_strided(spec.shape, spec.stride, spec.offset)


def _rebuild(value):
    if isinstance(value, TensorSpec):
        return _tensor(value)
    if isinstance(value, tuple):
        return tuple(_rebuild(v) for v in value)
    if isinstance(value, list):
        return [_rebuild(v) for v in value]
    return value


def measure(op: str, args, kwargs, threads: int) -> int:
    """Peak minus end of the CPU allocator's bytes over one call of ``op`` (0 when it allocates nothing
    beyond its outputs)."""
    import torch

    from memkit.memory.allocator import allocator_window

    torch.set_num_threads(threads)
    func = _resolve(op)
    args, kwargs = _rebuild(args), {k: _rebuild(v) for k, v in kwargs.items()}
    with allocator_window() as window:
        out = func(*args, **kwargs)
    del out
    return window.peak_bytes - window.end_bytes


def _read(stream) -> object | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return pickle.loads(stream.read(n))


def _write(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=4)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers may reach the parent's pipe
    import torch  # noqa: F401  (loaded before the first request, so its time is not a request's)

    _write(stdout, ("ready", 0))
    while (request := _read(stdin)) is not None:
        try:
            answer = ("ok", measure(*request))
        except Exception as e:  # the parent falls back to a flagged lower bound
            answer = ("error", f"{type(e).__name__}: {e}")
        _write(stdout, answer)


if __name__ == "__main__":  # run the package's copy, so unpickled TensorSpecs are this module's class
    from memkit.memory.workspace._learn_worker import main as _main

    _main()
