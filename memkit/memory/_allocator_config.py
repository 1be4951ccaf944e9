"""``PYTORCH_CUDA_ALLOC_CONF`` parsed as torch parses it, and the request rounding it controls.

Sources (read with the library's ``read_file``; the sizes and checks below follow them line by line):

- ``pytorch/pytorch`` ``c10/core/AllocatorConfig.cpp`` @ ``0ac716637f3258efcaf7fdfb851bdd520c9c1441`` (the
  tokenizer and the parsers of ``max_split_size_mb``, ``max_non_split_rounding_mb``,
  ``garbage_collection_threshold``, ``roundup_power2_divisions``, ``expandable_segments``);
- the headers installed with torch 2.13.0 (git ``cf30153c``): ``c10/core/AllocatorConfig.h`` adds
  ``large_segment_size_mb`` (default 20 MiB) and ``max_non_split_rounding_size`` defaulting to it;
  ``c10/cuda/CUDAAllocatorConfig.h`` lists the CUDA-only keys, which change nothing this model measures;
- ``pytorch/pytorch`` ``c10/test/core/AllocatorConfig_test.cpp`` @ ``8266849b`` for the list form's meaning.

Where versions differ (older: ``0x804d8000/pytorch`` ``c10/cuda/CUDAAllocatorConfig.cpp`` @ ``3dd29c39``, a parser
of the torch 2.1 era: it knows ``expandable_segments`` but not ``max_non_split_rounding_mb``):
``max_split_size_mb`` had to be ``> 20`` (now ``>= large_segment_size_mb``, 20 by default);
``max_non_split_rounding_mb`` and ``large_segment_size_mb`` did not exist (the rounding limit was the constant
20 MiB); a list entry's divisions could not be 0; and ``>:n`` filled from the last named interval *including*
it (so did ``pytorch/pytorch`` ``c10/core/AllocatorConfig.cpp`` @ ``065861fb``), so ``[256:1,512:2,>:8]`` gave
8 divisions to 512 MiB-1 GiB (now 2).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded to a multiple of this
SMALL_SIZE = MiB  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segments (and small expandable pages)
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: default large_segment_size
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: below this a large request gets a whole large segment
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests are rounded up to this
SIZE_MAX = (1 << 64) - 1  # max_split_size's default: "no limit"
_INTERVALS = 16  # roundup_power2_divisions: one entry per power of two from 1 MiB to 32 GiB (and beyond)

#: Keys torch accepts that change nothing the model computes (pinned host memory, locking, IPC, graphs).
IGNORED_KEYS = frozenset(
    {
        "pinned_use_background_threads",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
        "pinned_reserve_segment_size_mb",
        "pinned_num_register_threads",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }
)
MODELLED_KEYS = (
    "backend",
    "expandable_segments",
    "garbage_collection_threshold",
    "large_segment_size_mb",
    "max_non_split_rounding_mb",
    "max_split_size_mb",
    "per_process_memory_fraction",
    "roundup_power2_divisions",
)
KNOWN_KEYS = tuple(sorted(set(MODELLED_KEYS) | IGNORED_KEYS))


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of one ``PYTORCH_CUDA_ALLOC_CONF`` string, in bytes (see :func:`parse_conf`).

    Example:
        >>> parse_conf("max_split_size_mb:64").max_split_size
        67108864
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = LARGE_BUFFER
    large_segment_size: int = LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None

    def divisions(self, size: int) -> int:
        """Power-of-two divisions for a request of ``size`` bytes (its interval: log2(size) - 20, clamped).

        Example:
            >>> parse_conf("roundup_power2_divisions:[64:8,>:2]").divisions(200 << 20)  # 64 MiB-128 MiB: 8
            2
        """
        return self.roundup_power2_divisions[min(max(size.bit_length() - 21, 0), _INTERVALS - 1)]

    def round_size(self, size: int) -> int:
        """The block size a request of ``size`` bytes takes (``round_size`` in the allocator).

        Example:
            >>> parse_conf("roundup_power2_divisions:4").round_size(1200 * 1024)
            1310720
        """
        if size < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.divisions(size)
        if divisions > 1 and size > MIN_BLOCK * divisions:
            return _next_division(size, divisions)
        return -(-size // MIN_BLOCK) * MIN_BLOCK

    def allocation_size(self, size: int) -> int:
        """The segment a rounded request of ``size`` bytes makes the allocator ``cudaMalloc`` when nothing cached fits.

        Example:
            >>> AllocatorConfig().allocation_size(3 << 20) >> 20
            20
        """
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self.large_segment_size
        return -(-size // ROUND_LARGE) * ROUND_LARGE


def _next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` up to the next of ``divisions`` steps between powers of 2."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    down = size & ~(step - 1)
    return size if down == size else down + step


def _tokens(conf: str) -> list[str]:
    """``ConfigTokenizer``: ``,`` ``:`` ``[`` ``]`` are tokens of their own, whitespace is dropped."""
    out, buf = [], []
    for ch in conf:
        if ch in ",:[]":
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


class _Parser:
    def __init__(self, conf: str):
        self.conf, self.tok = conf, _tokens(conf)

    def fail(self, key: str, why: str) -> ValueError:
        return ValueError(f"PYTORCH_CUDA_ALLOC_CONF option {key!r}: {why} (in {self.conf!r})")

    def at(self, i: int, key: str) -> str:
        if i >= len(self.tok):
            raise self.fail(key, "expected a value")
        return self.tok[i]

    def expect(self, i: int, token: str, key: str) -> None:
        if self.at(i, key) != token:
            raise self.fail(key, f"expected {token!r}, got {self.tok[i]!r}")

    def number(self, i: int, key: str, kind: type = int):
        text = self.at(i, key)
        try:
            value = kind(text)
        except ValueError:
            raise self.fail(key, f"{text!r} is not a number") from None
        if kind is int and value < 0:
            raise self.fail(key, f"{text!r} must not be negative")
        return value

    def megabytes(self, i: int, key: str, minimum: int, strict: bool) -> int:
        value = self.number(i, key)
        if value < minimum or (strict and value == minimum):
            raise self.fail(key, f"must be {'>' if strict else '>='} {minimum}, got {value}")
        return min(value, SIZE_MAX // MiB) * MiB

    def boolean(self, i: int, key: str) -> bool:
        text = self.at(i, key)
        if text not in ("True", "False"):
            raise self.fail(key, f"expected 'True' or 'False', got {text!r}")
        return text == "True"

    def skip(self, i: int, key: str) -> int:
        """``skipKey``: past ``key:value`` or ``key:[...]``; returns the index of the value's last token."""
        self.expect(i + 1, ":", key)
        i += 2
        if self.at(i, key) != "[":
            return i
        while i + 1 < len(self.tok) and self.tok[i + 1] != "]":
            i += 1
        self.expect(i + 1, "]", key)
        return i + 1

    def divisions(self, i: int, key: str, values: list[int]) -> int:
        """``parseRoundUpPower2Divisions``: ``n`` for every interval, or ``[size_mb:n,...,>:n]``."""
        if self.at(i, key) != "[":
            value = self.number(i, key)
            if value <= 0 or value & (value - 1):
                raise self.fail(key, f"divisions must be a power of 2, got {value}")
            values[:] = [value] * _INTERVALS
            return i
        first, last = True, 0
        while True:
            i += 1
            if self.at(i, key) == "]":
                return i
            bound = self.tok[i]
            self.expect(i + 1, ":", key)
            value = self.number(i + 2, key)
            i += 2
            if value and value & (value - 1):
                raise self.fail(key, f"divisions must be a power of 2 or 0, got {value}")
            if bound == ">":
                # Newer torch fills after the last named interval; older parsers (3dd29c39, 065861fb) from it.
                values[last + 1 :] = [value] * (_INTERVALS - last - 1)
            else:
                mb = self.number(i - 2, key)
                if mb <= 0 or mb & (mb - 1):
                    raise self.fail(key, f"interval {bound!r} must be a power of 2 (in MiB)")
                index = min(mb.bit_length() - 1, _INTERVALS - 1)
                if first:
                    values[:index] = [value] * index
                    first = False
                values[index], last = value, index
            if self.at(i + 1, key) != "]":
                self.expect(i + 1, ",", key)
                i += 1


def parse_conf(conf: str = "") -> AllocatorConfig:
    """An :class:`AllocatorConfig` from a ``PYTORCH_CUDA_ALLOC_CONF`` string; a ValueError names a bad option.

    ``per_process_memory_fraction:f`` (a CUDA key of torch 2.13, f in [0, 1]) is taken to act as
    ``torch.cuda.set_per_process_memory_fraction(f)`` does: the allocator refuses to reserve more than ``f`` x the
    device's capacity and runs ``garbage_collection_threshold``, which torch ignores without a fraction. (How
    2.13 applies the key was not read; ``setMemoryFraction``'s effect is from 001074d.)

    Example:
        >>> parse_conf("expandable_segments:True,max_split_size_mb:128").expandable_segments
        True
    """
    p, settings = _Parser(conf), {}
    divisions = [0] * _INTERVALS
    tok, i = p.tok, 0
    while i < len(tok):
        key = tok[i]
        if key in MODELLED_KEYS:
            p.expect(i + 1, ":", key)
            i += 2
        if key == "max_split_size_mb":
            large_mb = settings.get("large_segment_size", LARGE_BUFFER) // MiB
            settings["max_split_size"] = p.megabytes(i, key, large_mb, strict=False)
        elif key == "max_non_split_rounding_mb":
            large_mb = settings.get("large_segment_size", LARGE_BUFFER) // MiB
            settings["max_non_split_rounding_size"] = p.megabytes(i, key, large_mb, strict=False)
        elif key == "large_segment_size_mb":
            settings["large_segment_size"] = p.megabytes(i, key, MIN_LARGE_ALLOC // MiB, strict=True)
        elif key == "garbage_collection_threshold":
            value = p.number(i, key, float)
            if not 0.0 < value < 1.0:
                raise p.fail(key, f"must lie in (0.0, 1.0), got {value}")
            settings["garbage_collection_threshold"] = value
        elif key == "per_process_memory_fraction":
            value = p.number(i, key, float)
            if not 0.0 <= value <= 1.0:
                raise p.fail(key, f"must lie in [0.0, 1.0], got {value}")
            settings["per_process_memory_fraction"] = value
        elif key == "roundup_power2_divisions":
            i = p.divisions(i, key, divisions)
        elif key == "expandable_segments":
            settings["expandable_segments"] = p.boolean(i, key)
        elif key == "backend":
            if p.at(i, key) != "native":
                raise p.fail(key, f"only the native caching allocator is modelled, got {tok[i]!r}")
        elif key in IGNORED_KEYS:
            i = p.skip(i, key)
        else:
            raise ValueError(
                f"unknown PYTORCH_CUDA_ALLOC_CONF option {key!r} in {conf!r}; known options: {', '.join(KNOWN_KEYS)}"
            )
        if i + 1 < len(tok):
            p.expect(i + 1, ",", key)
            i += 1
        i += 1
    large = settings.get("large_segment_size", LARGE_BUFFER)
    if settings.get("max_split_size", SIZE_MAX) < large:
        raise p.fail("max_split_size_mb", f"must be >= large_segment_size_mb ({large // MiB})")
    return AllocatorConfig(roundup_power2_divisions=tuple(divisions), **settings)
