"""What a snapshot's stacks say: the allocation's site (frame text) and, when no marker gives it, its phase.

torch lists frames innermost first. A Python frame's file ends in ``.py`` (or is ``<stdin>``-like); everything
else (``??``, ``libtorch_cuda.so``, ``thread48.o``) is native. The site is the innermost Python frames; a stack
without any (the autograd engine's threads record C++ only) shows its innermost *meaningful* C++ frames, past
the unwinder, the caching allocator, ``empty`` and thread start-up, or :data:`NO_SITE` when nothing else is
there. The phase is read from frames that name it (``backward`` and the autograd engine, ``torch/optim``, an
optimizer file's ``step`` and ``_foreach_`` ops, diffusers' EMA ``step``, a module's ``forward``), else left
unknown ("other").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import repeat
from operator import itemgetter

import numpy as np

from ._snapshot_schema import frame_line, is_marker, parse_marker
from .events import PHASE_CODE

STACK_FRAMES = 8  # innermost frames kept as a Timeline frame text, as the tracker keeps
NO_SITE = "(no Python frame; its C++ frames are allocator and thread internals only)"

_PY_SUFFIXES = (".py", ".pyw", ".pyx", ".pyi")
# C++ frames that say nothing about who allocated: the unwinder, the allocator, empty(), thread start-up
_PLUMBING = re.compile(
    r"unwind|CapturedTraceback|gather_context|CachingAllocator|c10::cuda::|c10::(Storage|TensorImpl|make_intrusive"
    r"|intrusive_ptr|Allocator)|(^|::)_?empty|at::detail::|execute_native_thread_routine|start_thread|^_?_?clone"
    r"|^_start$|__libc_start|^\?\?$|^$"
)
_PROFILER_NAME = re.compile(r"^(.*)\((\d+)\): (.*)$")  # torch.profiler's frames: "file.py(12): name"
_BACKWARD_CPP = re.compile(r"torch::autograd::(Engine|generated::|Node::|CppNode|PyNode)|Backward\d*::apply")
_BACKWARD_PY = frozenset(("backward", "_engine_run_backward", "run_backward", "unpack_hook", "recompute_fn"))
_FORWARD_PY = frozenset(("forward", "_call_impl", "_wrapped_call_impl"))
_MIX = np.random.default_rng(0x6D656D6B6974).integers(1, 2**63, size=16, dtype=np.uint64) | np.uint64(1)


def is_python(frame: Mapping) -> bool:
    """A Python frame: a ``.py`` file, ``<stdin>``-like, or a name-only line (memkit's and the profiler's)."""
    filename = str(frame.get("filename", ""))
    return filename.endswith(_PY_SUFFIXES) or filename.startswith("<") or filename == "none"


def _file_and_name(frame: Mapping) -> tuple[str, str]:
    filename, name = str(frame.get("filename", "")), str(frame.get("name", ""))
    if filename == "none" and (m := _PROFILER_NAME.match(name)):
        return m[1], m[3]
    return filename, name


def _is_optimizer(filename: str, name: str) -> bool:
    """A frame of an optimizer: a file under an ``optim/`` package (torch's, bitsandbytes'), or a ``step`` in a
    file named for one (accelerate's ``optimizer.py``, transformers' ``optimization.py``)."""
    path = filename.replace("\\", "/")
    return "/optim/" in path or (name == "step" and "optim" in path.rsplit("/", 1)[-1])


def phase_of(frames: list) -> int:
    """The phase code that the frames name (-1: none does). Backward wins (a checkpoint's recompute runs
    forwards inside it), then EMA, the optimizer and forward."""
    found = set()
    for f in frames:
        filename, name = _file_and_name(f)
        python = is_python(f)
        if (python and name in _BACKWARD_PY and ("torch" in filename or "checkpoint" in filename)) or (
            not python and _BACKWARD_CPP.search(name)
        ):
            return PHASE_CODE["backward"]
        if python and name == "step" and filename.endswith("training_utils.py"):
            found.add("ema")
        elif (python and _is_optimizer(filename, name)) or "_foreach_" in name:
            found.add("optimizer")
        elif python and name in _FORWARD_PY:
            found.add("forward")
    for phase in ("ema", "optimizer", "forward"):
        if phase in found:
            return PHASE_CODE[phase]
    return -1


def site_text(frames: list) -> str:
    """The frame text (outermost first) of a stack without memkit's marker; "" when it has no frames."""
    python = [f for f in frames if is_python(f)]
    if python:
        return "\n".join(frame_line(f) for f in reversed(python[:STACK_FRAMES]))
    if not frames:
        return ""
    meaningful = [f for f in frames if not _PLUMBING.search(str(f.get("name", "")))][:STACK_FRAMES]
    return "\n".join(frame_line(f) for f in reversed(meaningful)) if meaningful else NO_SITE


class Frames:
    """Decodes stacks into (category, phase, op, frame text) codes, once per distinct stack."""

    def __init__(self, ops: list[str], texts: list[str]):
        self.ops, self.texts = ops, texts
        self._op_index = {o: i for i, o in enumerate(ops)}
        self._text_index = {t: i for i, t in enumerate(texts)}

    def codes(self, stacks: list, *, with_text: bool = True) -> np.ndarray:
        """(n, 4) int array of category (-1: none), phase (-1), op (-1) and frame text (-1) codes.

        Stacks are told apart by their first ``STACK_FRAMES + 1`` frames (all of them when native frames
        come first, ``stacks="all"``), their depth and their outermost frame. ``with_text=False`` (frees) reads
        memkit's marker alone: no text, and no phase from frames, since torch often logs a free with the stack
        of its allocation.
        """
        n = len(stacks)
        if n == 0:
            return np.full((0, 4), -1, dtype=np.int64)
        if not all(map(isinstance, stacks, repeat((list, tuple)))):  # None (context=None) or a malformed stack
            stacks = [s if isinstance(s, (list, tuple)) else () for s in stacks]
        native = (isinstance(f, Mapping) and not is_python(f) and not is_marker(f) for s in stacks[:200] for f in s)
        cut = (None if any(native) else STACK_FRAMES + 1) if with_text else 1
        # memkit and torch's profiler conversion share one list between the entries of the same stack
        list_ids = np.fromiter(map(id, stacks), dtype=np.uint64, count=n)
        _, first, inverse = np.unique(list_ids, return_index=True, return_inverse=True)
        if len(first) > n // 4:
            # Torch shares the frame dicts instead: the ids of the frames we look at identify a stack. Hash
            # them column by column in numpy; a Python loop per entry would cost more than the unpickling.
            full = np.fromiter(map(len, stacks), dtype=np.int64, count=n)
            lens = np.minimum(full, cut) if cut else full
            key = full.astype(np.uint64) * _MIX[0]
            columns = list(range(int(lens.max())))
            for p in [*columns, -1] if with_text else columns:  # -1: the outermost frame, telling threads apart
                rows = np.flatnonzero(lens > p) if p >= 0 else np.flatnonzero(full > 0)
                sub = stacks if len(rows) == n else list(map(stacks.__getitem__, rows.tolist()))
                col = np.fromiter(map(id, map(itemgetter(p), sub)), dtype=np.uint64, count=len(rows))
                col *= _MIX[(p + 1) % len(_MIX)]
                col ^= col >> np.uint64(29)
                key[rows] += col
            _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        table = np.array([self.decode(stacks[i], with_text) for i in first.tolist()], dtype=np.int64)
        return table[inverse.reshape(-1)]

    def decode(self, stack, with_text: bool = True) -> tuple[int, int, int, int]:
        category = phase = op = -1
        real = []
        for f in stack or ():
            if not isinstance(f, Mapping):
                continue
            if is_marker(f):
                category, phase, op_name = parse_marker(f)
                if op_name is not None:
                    op = self._intern(op_name, self.ops, self._op_index)
            else:
                real.append(f)
        if phase < 0 and with_text:
            phase = phase_of(real)
        text = site_text(real) if with_text else ""
        return category, phase, op, self._intern(text, self.texts, self._text_index) if text else -1

    @staticmethod
    def _intern(item: str, items: list[str], index: dict[str, int]) -> int:
        code = index.get(item)
        if code is None:
            code = index[item] = len(items)
            items.append(item)
        return code
