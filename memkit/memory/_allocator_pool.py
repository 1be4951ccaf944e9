"""The allocator's data: blocks, segments and the per-stream sorted free lists of a pool.

A pool keeps its free blocks of each stream in one sorted list of int keys ``(size << 64) | address`` (the order
of torch's ``BlockComparatorSize`` within a stream), so best fit is one ``bisect``; unmapped blocks of
expandable segments are kept by address (``BlockComparatorAddress``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Literal

SHIFT = 64  # free-list key: (size << 64) | address, one int per block, so bisect compares ints


class Block:
    """One block of a segment: the handle :meth:`CachingAllocator.malloc` returns (valid until freed).

    ``address`` and ``size`` (rounded) change as free neighbours merge; ``requested_size`` is what was asked for.

    Example:
        >>> from memkit.memory import CachingAllocator
        >>> CachingAllocator().malloc(1000).size
        1024
    """

    __slots__ = ("address", "size", "requested_size", "stream", "allocated", "mapped", "prev", "next", "seg", "gc")

    def __init__(self, address: int, size: int, stream: int, seg: _Segment, mapped: bool = True):
        self.address, self.size, self.stream, self.seg, self.mapped = address, size, stream, seg, mapped
        self.requested_size, self.allocated, self.prev, self.next, self.gc = 0, False, None, None, 0

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"Block({state}, size={self.size}, address={self.address:#x}, stream={self.stream})"


class _Segment:
    """A ``cudaMalloc`` (or one expandable segment's address space): its first block and where it lies."""

    __slots__ = ("head", "stream", "small", "expandable", "base", "page")

    def __init__(self, stream: int, small: bool, base: int, expandable: bool = False, page: int = 0):
        self.head, self.stream, self.small, self.base = None, stream, small, base
        self.expandable, self.page = expandable, page


@dataclass(frozen=True)
class SegmentInfo:
    """A live segment as ``torch.cuda.memory_snapshot()`` reports it (an expandable one: each mapped range).

    ``blocks`` are ``(size, requested_size, allocated)`` in address order.

    Example:
        >>> from memkit.memory import CachingAllocator
        >>> a = CachingAllocator(); _ = a.malloc(1000)
        >>> a.segments[0].size, a.segments[0].pool, a.segments[0].blocks[0]
        (2097152, 'small', (1024, 1000, True))
    """

    address: int
    size: int
    stream: int
    pool: Literal["small", "large"]
    expandable: bool
    blocks: tuple[tuple[int, int, bool], ...] = field(default=())

    @property
    def allocated_size(self) -> int:
        """Bytes of this segment's allocated blocks.

        Example:
            >>> from memkit.memory import CachingAllocator
            >>> a = CachingAllocator(); _ = a.malloc(1000); a.segments[0].allocated_size
            1024
        """
        return sum(size for size, _, allocated in self.blocks if allocated)


class _Pool:
    """``BlockPool``: free mapped blocks per stream sorted by (size, address); unmapped ones sorted by address."""

    __slots__ = ("small", "free", "unmapped", "gc_calls")

    def __init__(self, small: bool):
        self.small, self.gc_calls = small, 0
        self.free: dict[int, tuple[list[int], list[Block]]] = {}
        self.unmapped: dict[int, tuple[list[int], list[Block]]] = {}

    def insert(self, b: Block) -> None:
        b.gc = self.gc_calls  # insert_into_blocks: the block's age for the garbage collector starts now
        keys, blocks = self.free.get(b.stream) or self.free.setdefault(b.stream, ([], []))
        k = (b.size << SHIFT) | b.address
        i = bisect_left(keys, k)
        keys.insert(i, k)
        blocks.insert(i, b)

    def remove(self, b: Block) -> None:
        keys, blocks = self.free[b.stream]
        i = bisect_left(keys, (b.size << SHIFT) | b.address)
        del keys[i], blocks[i]

    def insert_unmapped(self, b: Block) -> None:
        keys, blocks = self.unmapped.get(b.stream) or self.unmapped.setdefault(b.stream, ([], []))
        i = bisect_left(keys, b.address)
        keys.insert(i, b.address)
        blocks.insert(i, b)

    def remove_unmapped(self, b: Block) -> None:
        keys, blocks = self.unmapped[b.stream]
        i = bisect_left(keys, b.address)
        del keys[i], blocks[i]

    def all_free(self) -> list[Block]:
        """Every free mapped block in ``std::set`` order: by stream, then size, then address."""
        return [b for stream in sorted(self.free) for b in self.free[stream][1]]


def _format_size(n: int) -> str:
    """torch's ``format_size``: two decimals, the unit switching above each power of 1024."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


def _expandable_size(b: Block) -> int:
    """A free block's size plus the unmapped space right after it, into which it can grow."""
    n = b.next
    return b.size + (n.size if n is not None and not n.mapped else 0)
