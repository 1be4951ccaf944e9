"""A model of PyTorch's CUDA caching allocator: replay ``malloc``/``free`` and read the *reserved* bytes.

``max_memory_allocated`` counts live blocks; a GPU runs out of memory on ``max_memory_reserved``, which adds the
cached free blocks and the unusable tails of segments. This module replays an allocation sequence through the
allocator's own rules, on the CPU, in a few microseconds a call, so an estimate can report reserved bytes and
whether a step fits on a device of a given capacity.

Source, followed function by function (names in comments are torch's): ``pytorch/pytorch``
``c10/cuda/CUDACachingAllocator.cpp`` @ ``001074d25084fdb87a799823e395a50f5ec044d3`` (``DeviceCachingAllocator``:
``malloc``, ``get_free_block``, ``alloc_block``, ``alloc_found_block``, ``should_split``, ``free_block``,
``try_merge_blocks``, ``release_available_cached_blocks``, ``release_cached_blocks``, ``garbage_collect_cached_
blocks``, ``find_expandable_block``, ``map_block``, ``unmap_block``), with the settings of torch 2.13 (see
``_allocator_config.py``). Where versions differ:

- the oversize rule (a request >= ``max_split_size`` may take a cached block less than
  ``max_non_split_rounding_mb`` larger) used the constant ``kLargeBuffer`` (20 MiB) before that option existed;
  the header comment of 001074d says "within 1MB", but its code uses 20 MiB, and so does this model;
- requests of 1-10 MiB get a ``large_segment_size_mb`` segment (20 MiB unless set; the constant ``kLargeBuffer``
  where that option does not exist: ``c10/core/AllocatorConfig.cpp`` @ 0ac71663 has it not, torch 2.13 has it);
- ``release_available_cached_blocks`` and the garbage collector skip blocks of expandable segments in a later,
  templated version of this code (seen in the source index, not pinned to a commit); 001074d asserted there
  instead. The model skips them.

Modelled: request rounding, small (<= 1 MiB, 2 MiB segments) and large pools, per-stream best fit from a
size-ordered set, splitting, merging, ``max_split_size``, expandable segments (pages of 2 MiB / 20 MiB mapped at
the lowest free address, free pages unmapped on OOM and ``empty_cache``), the garbage collector, ``empty_cache``
and the OOM path. Not modelled: CUDA graphs' private pools and ``MemPool``, ``record_stream`` (cross-stream
frees complete at once), IPC, ``cudaMallocAsync``, memory taken outside the allocator (the CUDA context,
cuBLAS workspaces: subtract them from ``capacity``). ``cudaMalloc`` addresses are handed out in increasing order,
which only breaks ties between equal-sized free blocks; an expandable segment reserves addresses for 1 1/8 x
``capacity`` (torch: x the device's total memory), which only decides when a stream needs a second one.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Literal

from ._allocator_config import MIN_BLOCK, SIZE_MAX, SMALL_BUFFER, SMALL_SIZE, parse_conf
from ._allocator_pool import SHIFT as _SHIFT
from ._allocator_pool import Block, SegmentInfo, _expandable_size, _format_size, _Pool, _Segment
from ._expandable_segments import ExpandableSegments

__all__ = ["Block", "CachingAllocator", "DeviceOutOfMemoryError", "SegmentInfo"]

_DEFAULT_ADDRESS_SPACE = 1 << 40  # expandable address space per segment when no capacity is given


class DeviceOutOfMemoryError(MemoryError):
    """The model's ``torch.OutOfMemoryError``: no cached block fits and the device cannot give a new segment.

    Example:
        >>> try:
        ...     CachingAllocator(capacity=1 << 20).malloc(4 << 20)
        ... except DeviceOutOfMemoryError as e:
        ...     print(str(e)[:47])
        CUDA out of memory. Tried to allocate 20.00 MiB
    """


class CachingAllocator(ExpandableSegments):
    """One device's caching allocator, replayed: ``malloc``/``free`` in, allocated and reserved bytes out.

    ``conf`` is a ``PYTORCH_CUDA_ALLOC_CONF`` string (a bad option raises ValueError naming it and the known
    ones). ``capacity`` is the bytes the device can give the allocator (total memory minus the CUDA context and
    other processes); without it every ``cudaMalloc`` succeeds and nothing is ever released. A request of 0 bytes
    returns ``None`` without touching the allocator, as torch does. Costs a few microseconds a call; the state is
    the blocks themselves, so memory grows with the number of live and cached blocks, not with the calls.

    Besides the byte counts: ``config`` (the parsed settings), ``capacity``, and torch's counters
    ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc`` (segments and mapped ranges made) and
    ``num_device_free``.

    Example:
        >>> a = CachingAllocator("expandable_segments:False", capacity=8 << 30)
        >>> h = a.malloc(3 << 20); a.free(h)
        >>> a.allocated_bytes, a.reserved_bytes >> 20, a.max_allocated_bytes >> 20
        (0, 20, 3)
    """

    def __init__(self, conf: str = "", capacity: int | None = None):
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be a number of bytes >= 0 or None, got {capacity!r}")
        cfg = self.config = parse_conf(conf)
        self.capacity = capacity
        fraction = cfg.per_process_memory_fraction
        if fraction is not None and capacity is None:
            raise ValueError("per_process_memory_fraction needs the device's capacity: pass capacity=...")
        # set_fraction / allowed_memory_maximum; the garbage collector runs only with a fraction set
        self._allowed = None if fraction is None else int(fraction * capacity)
        self._gc = self._allowed is not None and cfg.garbage_collection_threshold > 0.0
        self._expandable = cfg.expandable_segments
        self._plain_rounding = not any(d > 1 for d in cfg.roundup_power2_divisions)
        self._max_split, self._large_segment = cfg.max_split_size, cfg.large_segment_size
        total = capacity if capacity else _DEFAULT_ADDRESS_SPACE
        self._address_space = total + total // 8  # find_expandable_block: 1 1/8 of the device per segment
        self._small, self._large = _Pool(True), _Pool(False)
        self._segs: set[_Segment] = set()
        self._next_address = 1 << 32
        self._allocated = self._reserved = self._max_allocated = self._max_reserved = 0
        self.num_alloc_retries = self.num_ooms = self.num_device_alloc = self.num_device_free = 0

    # ---- statistics ---------------------------------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        """``memory_allocated()``: the rounded sizes of the allocated blocks.

        Example:
            >>> a = CachingAllocator(); _ = a.malloc(100); a.allocated_bytes
            512
        """
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """``memory_reserved()``: the bytes of every segment (mapped pages for expandable ones).

        Example:
            >>> a = CachingAllocator(); _ = a.malloc(100); a.reserved_bytes
            2097152
        """
        return self._reserved

    @property
    def max_allocated_bytes(self) -> int:
        """``max_memory_allocated()`` since construction or :meth:`reset_peak_stats`.

        Example:
            >>> a = CachingAllocator(); a.free(a.malloc(100)); a.max_allocated_bytes
            512
        """
        return self._max_allocated

    @property
    def max_reserved_bytes(self) -> int:
        """``max_memory_reserved()`` since construction or :meth:`reset_peak_stats`.

        Example:
            >>> a = CachingAllocator(); a.free(a.malloc(100)); a.empty_cache(); a.max_reserved_bytes
            2097152
        """
        return self._max_reserved

    def reset_peak_stats(self) -> None:
        """Peaks start again from the current bytes (``torch.cuda.reset_peak_memory_stats``).

        Example:
            >>> a = CachingAllocator(); a.free(a.malloc(100)); a.reset_peak_stats(); a.max_allocated_bytes
            0
        """
        self._max_allocated, self._max_reserved = self._allocated, self._reserved

    @property
    def segments(self) -> list[SegmentInfo]:
        """The live segments in address order, as ``torch.cuda.memory_snapshot()`` lists them.

        Example:
            >>> a = CachingAllocator(); _ = a.malloc(5 << 20)
            >>> [(s.pool, s.size >> 20, len(s.blocks)) for s in a.segments]
            [('large', 20, 2)]
        """
        out = []
        for seg in self._segs:
            pool: Literal["small", "large"] = "small" if seg.small else "large"
            b = seg.head
            while b is not None:
                if not b.mapped:
                    b = b.next
                    continue
                start, blocks = b.address, []
                while b is not None and b.mapped:
                    blocks.append((b.size, b.requested_size if b.allocated else 0, b.allocated))
                    b = b.next
                size = sum(s for s, _, _ in blocks)
                out.append(SegmentInfo(start, size, seg.stream, pool, seg.expandable, tuple(blocks)))
        return sorted(out, key=lambda s: s.address)

    # ---- malloc -------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
        """A block of at least ``nbytes`` on ``stream``: cached if one fits, else a new segment (``malloc``).

        Raises :class:`DeviceOutOfMemoryError` when ``capacity`` cannot hold a new segment even after freeing
        the cache, as torch raises ``torch.OutOfMemoryError``.

        Example:
            >>> a = CachingAllocator(); h = a.malloc(1 << 20, stream=1); (h.size, h.stream)
            (1048576, 1)
        """
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {nbytes}")
            return None
        cfg = self.config
        if self._plain_rounding:
            size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        else:
            size = cfg.round_size(nbytes)
        pool = self._small if size <= SMALL_SIZE else self._large
        block = self._get_free_block(pool, stream, size)
        if block is None:
            alloc_size = cfg.allocation_size(size)
            if self._gc:
                self._garbage_collect()
            block = (
                self._alloc_block(pool, stream, size, alloc_size, False)
                or (
                    self._release_available_cached_blocks(pool, stream, size)
                    and self._alloc_block(pool, stream, size, alloc_size, False)
                )
                or (self._release_cached_blocks() and self._alloc_block(pool, stream, size, alloc_size, True))
            )
            if not block:
                self._out_of_memory(alloc_size)
        # should_split
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self._max_split and remaining > SMALL_SIZE
        if split:  # alloc_found_block: the front becomes the new block, the original keeps the rest
            rest = block
            block = Block(rest.address, size, stream, rest.seg)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                rest.seg.head = block
            block.next, rest.prev = rest, block
            rest.address += size
            rest.size -= size
            pool.insert(rest)
        block.allocated, block.requested_size = True, nbytes
        self._allocated += block.size
        if self._allocated > self._max_allocated:
            self._max_allocated = self._allocated
        return block

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        """``get_free_block``: the smallest cached block of the stream that fits, within the oversize rules."""
        if self._gc:
            pool.gc_calls += 1
        entry = pool.free.get(stream)
        if not entry:
            return None
        keys, blocks = entry
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        if self._expandable:
            # best fit counts the unmapped space after a block as part of it; walk while the next one is smaller
            while i + 1 < len(blocks) and _expandable_size(blocks[i + 1]) < _expandable_size(blocks[i]):
                i += 1
        b = blocks[i]
        if size < self._max_split and b.size >= self._max_split:
            return None  # do not hand out an oversize block for a request that may split
        if size >= self._max_split and b.size >= size + self.config.max_non_split_rounding_size:
            return None
        del keys[i], blocks[i]
        return b

    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int, retry: bool) -> Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` (or mapped pages), or None when the device is full."""
        if retry:
            self.num_alloc_retries += 1
        if self._allowed is not None and self._reserved + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._allocate_expandable(pool, stream, size)
        if self.capacity is not None and self._reserved + alloc_size > self.capacity:
            return None
        seg = _Segment(stream, pool.small, self._take_addresses(alloc_size))
        seg.head = block = Block(seg.base, alloc_size, stream, seg)
        self._segs.add(seg)
        self._grow(alloc_size)
        return block

    def _take_addresses(self, n: int) -> int:
        address = self._next_address
        self._next_address += -(-n // SMALL_BUFFER) * SMALL_BUFFER
        return address

    def _grow(self, n: int) -> None:
        self.num_device_alloc += 1
        self._reserved += n
        if self._reserved > self._max_reserved:
            self._max_reserved = self._reserved

    def _out_of_memory(self, alloc_size: int) -> None:
        self.num_ooms += 1
        capacity = self.capacity or 0
        allowed = f"{_format_size(self._allowed)} allowed; " if self._allowed is not None else ""
        raise DeviceOutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_format_size(alloc_size)}. GPU 0 has a total capacity of "
            f"{_format_size(capacity)} of which {_format_size(max(capacity - self._reserved, 0))} is free. "
            f"{allowed}Of the allocated memory {_format_size(self._allocated)} is allocated by PyTorch, and "
            f"{_format_size(self._reserved - self._allocated)} is reserved by PyTorch but unallocated. If reserved "
            "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation. (memkit's model of the caching allocator)"
        )

    # ---- free and release ---------------------------------------------------------------------------------
    def free(self, handle: Block | None) -> None:
        """Return a block to its pool, merged with free neighbours (``free`` + ``free_block``); reserved stays.

        Example:
            >>> a = CachingAllocator(); a.free(a.malloc(100)); (a.allocated_bytes, a.reserved_bytes)
            (0, 2097152)
        """
        if handle is None:
            return
        if not handle.allocated:
            raise ValueError(f"{handle!r} is not allocated: freed twice, or a handle of another allocator")
        handle.allocated = False
        self._allocated -= handle.size
        pool = self._small if handle.seg.small else self._large
        prev, nxt = handle.prev, handle.next
        if prev is not None and not prev.allocated and prev.mapped:
            self._merge(handle, prev, pool)
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._merge(handle, nxt, pool)
        pool.insert(handle)

    def _merge(self, dst: Block, src: Block, pool: _Pool) -> None:
        """``try_merge_blocks`` once its checks passed: ``dst`` absorbs its neighbour ``src``."""
        if dst.prev is src:
            dst.address, dst.prev = src.address, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                dst.seg.head = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)

    def empty_cache(self) -> None:
        """Release every cached block that is a whole segment, and unmap free expandable pages (``emptyCache``).

        Example:
            >>> a = CachingAllocator(); a.free(a.malloc(100)); a.empty_cache(); a.reserved_bytes
            0
        """
        self._release_cached_blocks()

    def _release_block(self, b: Block, pool: _Pool) -> None:
        """``release_block``: ``cudaFree`` a cached block that spans its whole segment."""
        pool.remove(b)
        self._segs.discard(b.seg)
        self._reserved -= b.size
        self.num_device_free += 1

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` / ``release_blocks``: free unsplit segments, unmap free expandable pages."""
        for pool in (self._large, self._small):
            to_unmap = []
            for b in pool.all_free():
                if b.seg.expandable:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(b, pool)
            for b in to_unmap:
                self._unmap_block(b, pool)
                if (
                    not b.mapped and b.prev is None and b.next is None
                ):  # the whole address space is unmapped: drop the segment
                    pool.remove_unmapped(b)
                    self._segs.discard(b.seg)
        return True

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """Free one cached oversize block large enough, else the largest oversize ones until enough is freed."""
        if self._max_split == SIZE_MAX:
            return False
        entry = pool.free.get(stream)
        if not entry:
            return False
        keys, blocks = entry
        target = max(size, self._max_split)
        i = bisect_left(keys, target << _SHIFT)
        if i < len(keys) and not blocks[i].seg.expandable:
            self._release_block(blocks[i], pool)
            return True
        released = 0
        for b in reversed(blocks[:i]):  # from the largest down; newer torch skips expandable blocks
            if released >= target or b.size < self._max_split:
                break
            if not b.seg.expandable:
                self._release_block(b, pool)
                released += b.size
        return released >= target

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above ``threshold`` x allowed, free the large pool's oldest segments."""
        threshold = int(self.config.garbage_collection_threshold * self._allowed)
        if self._reserved <= threshold:
            return
        target, reclaimed = self._reserved - threshold, 0
        pool = self._large
        ages = {
            b: pool.gc_calls - b.gc
            for b in pool.all_free()
            if b.prev is None and b.next is None and not b.seg.expandable
        }
        total_age, count, freed = sum(ages.values()), len(ages), True
        while reclaimed < target and freed and count > 0:
            age_threshold, freed = total_age / count, False
            for b in pool.all_free():
                if b in ages and ages[b] >= age_threshold:
                    freed, reclaimed = True, reclaimed + b.size
                    total_age, count = total_age - ages.pop(b), count - 1
                    self._release_block(b, pool)
