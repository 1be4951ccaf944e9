"""Expandable segments (``expandable_segments:True``) for :class:`~memkit.memory.CachingAllocator`.

One segment per stream and pool reserves address space for 1 1/8 of the device and maps physical pages
(2 MiB in the small pool, ``large_segment_size_mb``, 20 MiB, in the large one) at its lowest free address as
requests need them; on OOM and ``empty_cache`` the pages no allocated block touches are unmapped. Source:
``pytorch/pytorch`` ``c10/cuda/CUDACachingAllocator.cpp`` @ ``001074d2``: ``find_expandable_block``,
``map_block``, ``try_allocate_expandable_block``, ``unmap_block`` and ``ExpandableSegment::map``/``unmap``.
"""

from __future__ import annotations

from ._allocator_config import SMALL_BUFFER
from ._allocator_pool import Block, _Pool, _Segment


class ExpandableSegments:
    """The expandable-segment half of ``CachingAllocator`` (a mixin: it uses the allocator's pools and counters).

    Example:
        >>> from memkit.memory import CachingAllocator
        >>> a = CachingAllocator("expandable_segments:True"); _ = a.malloc(30 << 20)
        >>> a.reserved_bytes >> 20  # two 20 MiB pages of the large pool
        40
    """

    def _allocate_expandable(self, pool: _Pool, stream: int, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages until a free run of ``size`` bytes exists; take it."""
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), pool):
            return None
        while c.size < size:  # invariant: c is free and mapped, c.next is unmapped
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size), pool):
                return None
            c = nxt  # map_block merged c into nxt
        pool.remove(c)
        return c

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> Block:
        """The lowest-address run of free and unmapped blocks holding ``size`` bytes, else a new segment."""
        entry = pool.unmapped.get(stream)
        for c in entry[1] if entry else ():
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            total, b = 0, c
            while total < size and b is not None and not b.allocated:
                total, b = total + b.size, b.next
            if total >= size:
                return c
        page = SMALL_BUFFER if pool.small else self._large_segment
        n = -(-self._address_space // page) * page
        seg = _Segment(stream, pool.small, self._take_addresses(n), expandable=True, page=page)
        seg.head = c = Block(seg.base, n, stream, seg, mapped=False)
        self._segs.add(seg)
        pool.insert_unmapped(c)
        return c

    def _map_block(self, to_map: Block, size: int, pool: _Pool) -> bool:
        """``map_block``: back the pages under ``to_map``'s first ``size`` bytes; False when the device is full."""
        seg = to_map.seg
        begin = (to_map.address - seg.base) // seg.page
        end = -(-(to_map.address + size - seg.base) // seg.page)
        mapped = (end - begin) * seg.page
        if mapped == 0 or (self.capacity is not None and self._reserved + mapped > self.capacity):
            return False  # cuMemCreate failed: the pages made so far in this call are released again
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.address + mapped, to_map.size - mapped, to_map.stream, seg, mapped=False)
            rest.prev, rest.next = to_map, to_map.next
            if rest.next is not None:
                rest.next.prev = rest
            to_map.next, to_map.size = rest, mapped
            pool.insert_unmapped(rest)
        for src in (to_map.prev, to_map.next):
            if src is not None and not src.allocated and src.mapped:
                self._merge(to_map, src, pool)
        pool.insert(to_map)
        self._grow(mapped)
        return True

    def _unmap_block(self, b: Block, pool: _Pool) -> None:
        """``unmap_block``: unmap the whole pages inside the free block ``b``; the partial pages stay free blocks."""
        seg = b.seg
        begin = -(-(b.address - seg.base) // seg.page)
        end = (b.address + b.size - seg.base) // seg.page
        if begin >= end:
            return
        pool.remove(b)
        start, n = seg.base + begin * seg.page, (end - begin) * seg.page
        if start > b.address:
            before = Block(b.address, start - b.address, b.stream, seg)
            before.prev, before.next = b.prev, b
            if before.prev is not None:
                before.prev.next = before
            else:
                seg.head = before
            b.prev = before
            pool.insert(before)
        if b.address + b.size > start + n:
            after = Block(start + n, b.address + b.size - start - n, b.stream, seg)
            after.prev, after.next = b, b.next
            if after.next is not None:
                after.next.prev = after
            b.next = after
            pool.insert(after)
        b.address, b.size, b.mapped = start, n, False
        for src in (b.prev, b.next):
            if src is not None and not src.allocated and not src.mapped:
                self._merge(b, src, pool)
        pool.insert_unmapped(b)
        self._reserved -= n
        self.num_device_free += 1
