"""The caching-allocator model against the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (@ 001074d2) and torch
2.13's allocator config. Every expected value is derived by hand from those rules in the comment beside it.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memkit.memory import CachingAllocator, DeviceOutOfMemoryError

KiB, MiB = 1 << 10, 1 << 20


def sizes(a):
    return [s.size for s in a.segments]


# ---- rounding ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("nbytes", "block"), [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024)])
def test_requests_round_up_to_512_bytes(nbytes, block):
    # round_size: < kMinBlockSize (512) -> 512, else the next multiple of 512
    a = CachingAllocator()
    assert a.malloc(nbytes).size == block
    assert a.allocated_bytes == block


def test_roundup_power2_divisions_single_value():
    conf = "roundup_power2_divisions:4"
    # 5 MiB + 1 lies between 4 and 8 MiB; 4 divisions -> steps of 1 MiB -> 6 MiB (plain rounding: 5 MiB + 512)
    assert block_size(conf, 5 * MiB + 1) == 6 * MiB
    # 1200 KiB: between 1 and 2 MiB, steps of 256 KiB -> 1280 KiB (the source's own example)
    assert block_size(conf, 1200 * KiB) == 1280 * KiB
    # a power of two is kept as is; at most 512 x divisions bytes round to 512: 2000 -> 2048 either way, 1500 -> 1536
    assert block_size(conf, 4 * MiB) == 4 * MiB
    assert block_size(conf, 1500) == 1536
    # 600 B <= 512 x 4: plain rounding gives 1024 (power-of-2 steps of 128 above 512 would give 640)
    assert block_size(conf, 600) == 1024


def block_size(conf, nbytes):
    """The block a fresh allocator hands out for one request (fresh, so no cached block is reused whole)."""
    return CachingAllocator(conf).malloc(nbytes).size


def test_roundup_power2_divisions_per_interval():
    # [1:2,4:8]: interval index = log2(MiB); 1 -> index 0 (sizes < 2 MiB) gets 2, 4 -> index 2 ([4, 8) MiB) gets 8,
    # index 1 ([2, 4) MiB) and 3.. keep 0 (plain 512-byte rounding)
    conf = "roundup_power2_divisions:[1:2,4:8]"
    assert block_size(conf, 1536 * KiB + 1) == 2 * MiB  # floor 1 MiB, step 512 KiB
    assert block_size(conf, 3 * MiB + 1) == 3 * MiB + 512  # index 1: no divisions
    assert block_size(conf, 5 * MiB + 1) == 5 * MiB + 512 * KiB  # floor 4 MiB, step 512 KiB
    assert block_size(conf, 9 * MiB + 1) == 9 * MiB + 512  # index 3: no divisions


def test_roundup_power2_divisions_greater_than_fills_after_the_last_interval():
    # [256:1,512:2,>:8]: index 8 (256 MiB) = 1 and everything below, index 9 (512 MiB-1 GiB) = 2; ">" fills from
    # index 10 on (older parsers filled from index 9, giving 512 MiB-1 GiB 8 divisions)
    conf = "roundup_power2_divisions:[256:1,512:2,>:8]"
    assert block_size(conf, 600 * MiB) == 768 * MiB  # floor 512 MiB, 2 divisions: step 256 MiB
    assert block_size(conf, 1536 * MiB + 1) == 1664 * MiB  # floor 1 GiB, 8 divisions: step 128 MiB
    assert block_size(conf, 300 * MiB) == 300 * MiB  # index 8: 1 division, plain rounding


# ---- pools and segment sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nbytes", "pool", "segment"),
    [
        (1 * MiB, "small", 2 * MiB),  # <= kSmallSize (1 MiB): small pool, kSmallBuffer (2 MiB) segment
        (1 * MiB + 1, "large", 20 * MiB),  # > 1 MiB and < 10 MiB: one kLargeBuffer (20 MiB) segment
        (10 * MiB - 512, "large", 20 * MiB),
        (10 * MiB, "large", 10 * MiB),  # >= kMinLargeAlloc: rounded up to kRoundLarge (2 MiB)
        (11 * MiB, "large", 12 * MiB),
    ],
)
def test_pool_and_segment_size(nbytes, pool, segment):
    a = CachingAllocator()
    a.malloc(nbytes)
    assert [(s.pool, s.size) for s in a.segments] == [(pool, segment)]
    assert a.reserved_bytes == segment


def test_large_segment_size_option():
    # torch 2.13: large_segment_size_mb replaces kLargeBuffer for 1-10 MiB requests
    a = CachingAllocator("large_segment_size_mb:32")
    a.malloc(3 * MiB)
    assert sizes(a) == [32 * MiB]


# ---- reuse ---------------------------------------------------------------------------------------------------
def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    hs = [a.malloc(n * MiB) for n in (16, 12, 14)]  # >= 10 MiB: one exact segment each
    address_of_14 = hs[2].address
    for h in hs:
        a.free(h)
    h = a.malloc(13 * MiB)
    # smallest cached block >= 13 MiB is the 14 MiB one; the 1 MiB left is not > kSmallSize, so it is not split
    assert (h.size, h.address) == (14 * MiB, address_of_14)
    assert a.reserved_bytes == 42 * MiB


def test_small_blocks_split_when_512_bytes_remain():
    a = CachingAllocator()
    a.malloc(1 * MiB)  # 2 MiB segment: [1 MiB][1 MiB free]
    a.malloc(1 * MiB - 512)  # takes the free 1 MiB block; 512 left >= kMinBlockSize: split
    assert [len(s.blocks) for s in a.segments] == [3]
    b = CachingAllocator()
    b.malloc(1 * MiB)
    b.malloc(1 * MiB)  # nothing left: no split
    assert [len(s.blocks) for s in b.segments] == [2]


def test_large_blocks_split_only_when_more_than_1_mib_remains():
    a = CachingAllocator()
    a.free(a.malloc(5 * MiB))  # a 20 MiB segment, whole again after the free
    h = a.malloc(19 * MiB)  # takes the 20 MiB block; 1 MiB left is not > kSmallSize: handed out whole
    assert (h.size, a.allocated_bytes) == (20 * MiB, 20 * MiB)
    b = CachingAllocator()
    b.free(b.malloc(5 * MiB))
    h = b.malloc(19 * MiB - 512)  # 1 MiB + 512 left > kSmallSize: split
    assert (h.size, [len(s.blocks) for s in b.segments]) == (19 * MiB - 512, [2])


def test_free_merges_neighbours_and_empty_cache_releases_whole_segments():
    a = CachingAllocator()
    x, y, z = (a.malloc(512 * KiB) for _ in range(3))  # one 2 MiB segment: [x][y][z][512 KiB free]
    a.free(x)
    a.free(z)  # z merges with the free tail: [x free][y][1 MiB free]
    assert a.segments[0].blocks == ((512 * KiB, 0, False), (512 * KiB, 512 * KiB, True), (1 * MiB, 0, False))
    a.empty_cache()  # the segment is split (y lives): nothing released
    assert a.reserved_bytes == 2 * MiB
    a.free(y)  # merges both neighbours: one 2 MiB block
    assert [len(s.blocks) for s in a.segments] == [1]
    a.empty_cache()
    assert (a.reserved_bytes, a.segments, a.max_reserved_bytes) == (0, [], 2 * MiB)


def test_empty_cache_keeps_segments_with_live_blocks():
    a = CachingAllocator()
    a.malloc(5 * MiB)  # 20 MiB segment, split
    a.free(a.malloc(12 * MiB))  # 12 MiB segment, free and whole
    a.empty_cache()
    assert sizes(a) == [20 * MiB]


# ---- max_split_size ------------------------------------------------------------------------------------------
def test_oversize_blocks_are_not_split_for_smaller_requests():
    a = CachingAllocator("max_split_size_mb:40")
    a.free(a.malloc(100 * MiB))
    a.malloc(30 * MiB)  # < max_split_size: the cached 100 MiB block (>= max_split_size) is refused
    assert sorted(sizes(a)) == [30 * MiB, 100 * MiB]
    b = CachingAllocator()  # without the limit the 100 MiB block is split: 30 MiB + 70 MiB
    b.free(b.malloc(100 * MiB))
    b.malloc(30 * MiB)
    assert (sizes(b), [len(s.blocks) for s in b.segments]) == ([100 * MiB], [2])


@pytest.mark.parametrize(
    ("conf", "request_mib", "reused"),
    [
        ("max_split_size_mb:40", 85, True),  # 100 < 85 + 20 (max_non_split_rounding, 20 MiB by default)
        ("max_split_size_mb:40", 80, False),  # 100 >= 80 + 20: refused, a new 80 MiB segment
        ("max_split_size_mb:40,max_non_split_rounding_mb:30", 80, True),  # 100 < 80 + 30
    ],
)
def test_oversize_blocks_serve_requests_within_the_rounding_limit(conf, request_mib, reused):
    a = CachingAllocator(conf)
    a.free(a.malloc(100 * MiB))
    h = a.malloc(request_mib * MiB)
    assert h.size == (100 * MiB if reused else request_mib * MiB)
    assert len(a.segments[0].blocks) == 1  # an oversize request never splits its block


# ---- streams -------------------------------------------------------------------------------------------------
def test_streams_do_not_share_cached_blocks():
    a = CachingAllocator()
    a.free(a.malloc(512 * KiB, stream=0))
    h = a.malloc(512 * KiB, stream=1)  # stream 0's cached block is not for stream 1: a new 2 MiB segment
    assert (h.stream, sorted((s.stream, s.size) for s in a.segments)) == (1, [(0, 2 * MiB), (1, 2 * MiB)])
    a.malloc(512 * KiB, stream=0)  # same stream: reused
    assert a.reserved_bytes == 4 * MiB


# ---- expandable segments -------------------------------------------------------------------------------------
def test_expandable_segment_grows_in_20_mib_pages():
    a = CachingAllocator("expandable_segments:True")
    x = a.malloc(30 * MiB)  # large pool: 2 pages of 20 MiB mapped, [30 alloc][10 free]
    assert (a.reserved_bytes, sizes(a)) == (40 * MiB, [40 * MiB])
    y = a.malloc(15 * MiB)  # the free 10 MiB plus one more page: [30][15][15 free], still one segment
    assert (a.reserved_bytes, sizes(a)) == (60 * MiB, [60 * MiB])
    assert [b[0] for b in a.segments[0].blocks] == [30 * MiB, 15 * MiB, 15 * MiB]
    a.free(y)  # [30][30 free]
    a.empty_cache()  # the one whole free page (40-60 MiB) is unmapped; 30-40 MiB stays mapped
    assert a.reserved_bytes == 40 * MiB
    a.free(x)
    a.empty_cache()  # everything unmapped: the segment is gone
    assert (a.reserved_bytes, a.segments) == (0, [])
    b = CachingAllocator()  # without expandable segments: 30 MiB + 16 MiB (15 MiB rounded to 2 MiB)
    b.malloc(30 * MiB)
    b.malloc(15 * MiB)
    assert b.reserved_bytes == 46 * MiB


def test_expandable_unmaps_only_whole_free_pages():
    a = CachingAllocator("expandable_segments:True")
    x = a.malloc(30 * MiB)
    a.malloc(15 * MiB)  # pages 0-2 mapped: [0-30 x][30-45 y][45-60 free]
    a.free(x)
    # empty_cache: x's free range 0-30 MiB holds one whole page (0-20): unmapped; 20-30 shares page 1 with y and
    # stays; the free 45-60 MiB lies inside page 2 with y: nothing to unmap there
    a.empty_cache()
    assert (a.reserved_bytes, sizes(a)) == (40 * MiB, [40 * MiB])
    assert [b[0] for b in a.segments[0].blocks] == [10 * MiB, 15 * MiB, 15 * MiB]


def test_expandable_small_pool_grows_in_2_mib_pages():
    a = CachingAllocator("expandable_segments:True")
    for _ in range(3):
        a.malloc(1 * MiB)  # 1 MiB each; the third maps a second 2 MiB page right after the first
    assert (a.reserved_bytes, [(s.pool, s.size) for s in a.segments]) == (4 * MiB, [("small", 4 * MiB)])


# ---- out of memory -------------------------------------------------------------------------------------------
def test_oom_frees_the_cache_and_retries():
    a = CachingAllocator(capacity=64 * MiB)
    a.free(a.malloc(40 * MiB))
    a.malloc(50 * MiB)  # 40 + 50 > 64: release_cached_blocks frees the 40 MiB segment, the retry fits
    assert (a.reserved_bytes, a.num_alloc_retries, sizes(a)) == (50 * MiB, 1, [50 * MiB])


def test_oom_first_frees_one_large_enough_oversize_block():
    a = CachingAllocator("max_split_size_mb:20", capacity=100 * MiB)
    hs = [a.malloc(60 * MiB), a.malloc(30 * MiB)]
    for h in hs:
        a.free(h)
    # 35 MiB -> 36 MiB segment; cached 60 >= 35 + 20 is refused; 90 + 36 > 100; the smallest cached block
    # >= 35 MiB (the 60 MiB one) alone is released, the 30 MiB one stays
    a.malloc(35 * MiB)
    assert (sorted(sizes(a)), a.num_alloc_retries) == ([30 * MiB, 36 * MiB], 0)


def test_oom_frees_oversize_blocks_from_the_largest_until_enough():
    a = CachingAllocator("max_split_size_mb:20", capacity=100 * MiB)
    hs = [a.malloc(40 * MiB), a.malloc(30 * MiB), a.malloc(24 * MiB)]
    for h in hs:
        a.free(h)
    # 50 MiB: no cached block >= 50; 94 + 50 > 100; release 40 (40 < 50), then 30 (70 >= 50), keep 24
    a.malloc(50 * MiB)
    assert sorted(sizes(a)) == [24 * MiB, 50 * MiB]


def test_oom_raises_like_torch():
    a = CachingAllocator(capacity=64 * MiB)
    a.malloc(40 * MiB)
    with pytest.raises(DeviceOutOfMemoryError, match=r"Tried to allocate 30\.00 MiB\. GPU 0 has a total capacity of"):
        a.malloc(30 * MiB)  # 40 + 30 > 64 and nothing is cached
    assert (a.num_ooms, a.num_alloc_retries, a.reserved_bytes) == (1, 1, 40 * MiB)
    assert issubclass(DeviceOutOfMemoryError, MemoryError)


def test_per_process_memory_fraction_limits_reserved():
    a = CachingAllocator("per_process_memory_fraction:0.5", capacity=100 * MiB)
    a.malloc(40 * MiB)
    with pytest.raises(DeviceOutOfMemoryError, match="50.00 MiB allowed"):
        a.malloc(20 * MiB)  # 40 + 20 > 0.5 x 100


def test_garbage_collection_frees_the_oldest_cached_segments():
    a = CachingAllocator("garbage_collection_threshold:0.5,per_process_memory_fraction:1.0", capacity=100 * MiB)
    x = a.malloc(20 * MiB)  # large-pool searches: 1
    y = a.malloc(20 * MiB)  # 2
    a.free(x)  # x cached at search 2
    z = a.malloc(22 * MiB)  # 3; x (20) does not fit; 40 <= 50 MiB threshold: no collection
    a.free(y)  # cached at 3
    a.free(z)  # cached at 3
    # 4th search finds nothing >= 30 MiB; 62 > 50: ages x 2, y 1, z 1, mean 4/3: only x is freed (reclaims
    # 20 >= 12), then the 30 MiB segment: 62 - 20 + 30
    a.malloc(30 * MiB)
    assert (a.reserved_bytes, sorted(sizes(a))) == (72 * MiB, [20 * MiB, 22 * MiB, 30 * MiB])


# ---- configuration -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("conf", "names"),
    [
        ("max_split_size:64", ["max_split_size", "max_split_size_mb"]),  # unknown key, known ones listed
        ("max_split_size_mb:19", ["max_split_size_mb", ">= 20"]),
        ("max_split_size_mb:20,large_segment_size_mb:25", ["max_split_size_mb"]),
        ("max_split_size_mb", ["max_split_size_mb"]),
        ("max_split_size_mb:lots", ["max_split_size_mb"]),
        ("max_non_split_rounding_mb:10", ["max_non_split_rounding_mb"]),
        ("large_segment_size_mb:10", ["large_segment_size_mb", "> 10"]),
        ("garbage_collection_threshold:1.0", ["garbage_collection_threshold"]),
        ("roundup_power2_divisions:3", ["roundup_power2_divisions"]),
        ("roundup_power2_divisions:[3:4]", ["roundup_power2_divisions"]),
        ("roundup_power2_divisions:[64:8", ["roundup_power2_divisions"]),
        ("expandable_segments:true", ["expandable_segments", "True"]),
        ("backend:cudaMallocAsync", ["backend"]),
        ("expandable_segments:True;max_split_size_mb:64", ["expandable_segments"]),
    ],
)
def test_bad_conf_names_the_option(conf, names):
    with pytest.raises(ValueError) as err:
        CachingAllocator(conf)
    for name in names:
        assert name in str(err.value)


def test_conf_accepts_torch_spellings():
    a = CachingAllocator(
        " max_split_size_mb : 64 , roundup_power2_divisions:[64:8,>:1], pinned_use_background_threads:True,"
        "backend:native,release_lock_on_cudamalloc:True,expandable_segments:False,"
    )
    assert a.config.max_split_size == 64 * MiB
    assert a.config.roundup_power2_divisions[:7] == (8,) * 7 and a.config.roundup_power2_divisions[7:] == (1,) * 9


# ---- invariants ----------------------------------------------------------------------------------------------
_ops = st.lists(
    st.tuples(st.booleans(), st.integers(1, 48 * MiB), st.integers(0, 1), st.integers(0, 1000)), max_size=60
)


_confs = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:20",
    "expandable_segments:True,max_split_size_mb:20",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    "roundup_power2_divisions:[1:4,>:2],max_split_size_mb:32",
]


@settings(max_examples=120, deadline=None)
@given(ops=_ops, conf=st.sampled_from(_confs), capacity=st.sampled_from([None, 160 * MiB]))
def test_invariants_hold_on_any_sequence(ops, conf, capacity):
    if capacity is None and "fraction" in conf:
        capacity = 1 << 40
    a, live = CachingAllocator(conf, capacity=capacity), []
    for is_free, nbytes, stream, pick in ops:
        if is_free and live:
            a.free(live.pop(pick % len(live)))
        else:
            try:
                live.append(a.malloc(nbytes, stream=stream))
            except DeviceOutOfMemoryError:
                assert capacity is not None
        if capacity is not None:
            assert a.reserved_bytes <= capacity
        segs = a.segments
        assert a.allocated_bytes == sum(h.size for h in live) == sum(s.allocated_size for s in segs)
        assert a.reserved_bytes == sum(s.size for s in segs)
        for s in segs:
            free_flags = [allocated for _, _, allocated in s.blocks]
            assert all(x or y for x, y in zip(free_flags, free_flags[1:], strict=False))  # free blocks merged
        assert a.max_allocated_bytes >= a.allocated_bytes and a.max_reserved_bytes >= a.reserved_bytes
    for h in live:
        a.free(h)
    a.empty_cache()
    assert (a.allocated_bytes, a.reserved_bytes, a.segments) == (0, 0, [])


def test_docstring_examples_hold():
    import doctest

    from memkit.memory import _allocator_config, _allocator_pool, _expandable_segments, caching_allocator

    for module in (caching_allocator, _allocator_pool, _expandable_segments, _allocator_config):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
