"""The splice of block memoization (``memkit/_splice.py``) on hand-made probe events, without an estimate: a probe
of 4 blocks standing for a list of 6, each block keeping one activation from the forward to the backward. The full
model's events follow from the rules in ``memkit._splice``'s docstring (going up, the third probe block repeats for
the middle blocks left out; going down, the second), written out here by hand. ``tests/test_memo.py`` checks real
estimates byte for byte."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from memkit import _splice
from memkit._memo import _AGG, Unsupported
from memkit.memory.events import ALLOC, CATEGORY_CODE, FREE, PHASE_CODE

ACT, PARAM = CATEGORY_CODE["activation"], CATEGORY_CODE["parameter"]
FWD, BWD, OTHER = PHASE_CODE["forward"], PHASE_CODE["backward"], PHASE_CODE["other"]
SIZE, FULL = 4, 6  # probe blocks, full blocks: kept are full blocks 0, 1, 4, 5
BYTES = [16, 32, 32, 64]  # each probe block's activation (the first and last differ from the middle ones)


def row(t, action, n, key, phase=FWD, category=ACT):
    return (t, action, n, category, phase, 0, 1, -1, key)


def tagger(tags, *, base=None, grown=None, n=FULL, size=SIZE, epochs=None):
    """A stand-in for memkit._memo_tagger.Tagger: what the splice reads of it."""
    base = base or {}
    return SimpleNamespace(
        tags=tags,
        lists=[("blocks", n, [None] * size)],
        period=1,
        epochs=epochs if epochs is not None else list(range(len(tags))),
        base_owner={key: owner for key, (owner, _, _) in base.items()},
        base={key: SimpleNamespace(nbytes=nb, category=c) for key, (_, nb, c) in base.items()},
        grown=grown or {},
        kept={},
        kept_events=0,
        tracker=SimpleNamespace(_round=lambda n: -(-n // 512) * 512),
    )


def probe_step():
    """An input (key 50) made outside the blocks, each block's activation (key 100 + b) made going up and freed
    going down, then the input freed."""
    rows, tags = [row(0.0, ALLOC, 8, 50)], [None]
    for b in range(SIZE):
        rows.append(row(1.0 + b, ALLOC, BYTES[b], 100 + b))
        tags.append((0, b))
    for b in reversed(range(SIZE)):
        rows.append(row(10.0 + b, FREE, BYTES[b], 100 + b, BWD))
        tags.append((0, b))
    rows.append(row(20.0, FREE, 8, 50, BWD))
    tags.append(None)
    return rows, tags


def pairs(rows) -> list[int]:
    """For each event, the index of the allocation a free pairs with (-1 for an allocation)."""
    live, out = {}, []
    for i, r in enumerate(rows):
        if r[1] == ALLOC:
            live[r[8]] = i
            out.append(-1)
        else:
            out.append(live.pop(r[8]))
    return out


def test_a_sweep_up_and_down_repeats_a_middle_block_for_each_left_out():
    rows, tags = probe_step()
    out, baseline, source = _splice.splice(tagger(tags), rows, [], {"parameter": 0})
    # going up full blocks 2 and 3 repeat probe block 2 (full block 4 is probe block 2 itself); going down, full
    # blocks 3 and 2 repeat probe block 1, and full block 1 is probe block 1
    assert source == [0, 1, 2, 3, 3, 3, 4, 5, 6, 7, 7, 7, 8, 9]
    assert [r[2] for r in out] == [8, 16, 32, 32, 32, 32, 64, 64, 32, 32, 32, 32, 16, 8]
    assert [r[1] for r in out] == [ALLOC] * 7 + [FREE] * 7
    assert pairs(out) == [-1] * 7 + [6, 5, 4, 3, 2, 1, 0]  # each block frees its own, in reverse
    assert [r[0] for r in out] == [rows[i][0] for i in source]  # probe times (made monotonic by columns())
    assert [r[4] for r in out] == [FWD] * 7 + [BWD] * 7
    assert baseline == {"parameter": 0}


def test_a_retagged_allocation_carries_its_new_category():
    rows, tags = probe_step()
    out, _, _ = _splice.splice(tagger(tags), rows, [(0, PARAM)], {"parameter": 0})  # the input, retagged
    assert [r[3] for r in out] == [PARAM] + [ACT] * 13  # a free keeps its own row's category


def test_the_baseline_grows_by_each_middle_block_left_out():
    rows, tags = probe_step()
    base = {1000 + b: ((0, b), 48 if b in (1, 2) else 40, PARAM) for b in range(SIZE)}
    _, baseline, _ = _splice.splice(tagger(tags, base=base), rows, [], {"parameter": 176})
    assert baseline == {"parameter": 176 + (FULL - SIZE) * 48}
    base[1002] = ((0, 2), 52, PARAM)
    with pytest.raises(Unsupported, match="hold different state before the step"):
        _splice.splice(tagger(tags, base=base), rows, [], {"parameter": 180})


def test_a_free_of_a_middle_blocks_baseline_storage_is_each_blocks_own():
    # each block frees its parameter-sized baseline storage (key 1000 + b) in the backward
    rows, tags = [], []
    for b in reversed(range(SIZE)):
        rows.append(row(1.0, FREE, 40, 1000 + b, BWD, PARAM))
        tags.append((0, b))
    base = {1000 + b: ((0, b), 40, PARAM) for b in range(SIZE)}
    out, _, source = _splice.splice(tagger(tags, base=base), rows, [], {"parameter": 160})
    keys = [r[8] for r in out]
    assert source == [0, 1, 2, 2, 2, 3]
    # full blocks 5, 4, 1 and 0 are the probe's blocks 3, 2, 1, 0: the probe's own storages
    assert keys[:2] == [1003, 1002] and keys[4:] == [1001, 1000]
    assert len(set(keys)) == FULL and all(k < 0 for k in keys[2:4])  # blocks 3 and 2: one fresh key each


def test_events_that_do_not_split_into_sweeps_are_refused():
    rows, tags = probe_step()
    with pytest.raises(Unsupported, match="without a tag"):
        _splice.splice(tagger(tags[:-1]), rows, [], {})
    agg = list(tags)
    agg[0] = _AGG
    with pytest.raises(Unsupported, match="event 0 reads storages of several blocks at once"):
        _splice.splice(tagger(agg), rows, [], {})
    lone = [None, (0, 2), None]  # a middle block's events alone
    with pytest.raises(Unsupported, match="belong to block 2 of 'blocks' alone"):
        _splice.splice(tagger(lone), [row(0.0, ALLOC, 8, 1), row(1.0, ALLOC, 8, 2), row(2.0, ALLOC, 8, 3)], [], {})
    skipping = [(0, 0), (0, 2), (0, 3)]  # block 1 missing: not a sweep
    with pytest.raises(Unsupported, match=r"go through blocks \[0, 2, 3\] of list 'blocks'"):
        _splice.splice(tagger(skipping), [row(float(i), ALLOC, 8, i) for i in range(3)], [], {})


def test_the_first_or_last_blocks_events_alone_stay_where_they_are():
    rows = [row(0.0, ALLOC, 8, 1), row(1.0, ALLOC, 24, 2), row(2.0, FREE, 24, 2), row(3.0, FREE, 8, 1)]
    for b in (0, SIZE - 1):
        out, _, source = _splice.splice(tagger([None, (0, b), (0, b), None]), rows, [], {})
        assert source == [0, 1, 2, 3] and pairs(out) == [-1, -1, 1, 0]


# ---- the helpers ------------------------------------------------------------------------------------------------


def test_untagged_events_between_neighbour_blocks_belong_to_the_next():
    t0, t1, t2 = (0, 0), (0, 1), (0, 2)
    assert _splice._filled([t0, None, None, t1], [FWD] * 4) == [t0, t1, t1, t1]
    assert _splice._filled([t0, None, t2], [FWD] * 3) == [t0, None, t2]  # not neighbours
    assert _splice._filled([t0, None, (1, 1)], [FWD] * 3) == [t0, None, (1, 1)]  # another list
    assert _splice._filled([t0, None, t1], [FWD, BWD, FWD]) == [t0, None, t1]  # another phase
    assert _splice._filled([t0, None, t1], [FWD, FWD, BWD]) == [t0, None, t1]
    assert _splice._filled([_AGG, None, t1], [FWD] * 3) == [_AGG, None, t1]
    assert _splice._filled([t1, None, _AGG], [FWD] * 3) == [t1, None, _AGG]
    assert _splice._filled([None, t1], [FWD] * 2) == [None, t1]  # nothing before
    assert _splice._filled([t1, None], [FWD] * 2) == [t1, None]  # nothing after


def test_spliced_events_free_each_storage_once_and_after_it_is_made():
    _splice._check_pairs([row(0, ALLOC, 8, 1), row(1, FREE, 8, 1), row(2, FREE, 8, 7), row(3, ALLOC, 8, 1)])
    _splice._check_pairs([row(0, ALLOC, 8, -1), row(0, ALLOC, 8, -1), row(1, FREE, 8, -1)])  # kernel buffers
    with pytest.raises(Unsupported, match="spliced event 1 allocates a storage that is alive"):
        _splice._check_pairs([row(0, ALLOC, 8, 1), row(1, ALLOC, 8, 1)])
    with pytest.raises(Unsupported, match="spliced event 2 frees a storage that is not alive"):
        _splice._check_pairs([row(0, ALLOC, 8, 1), row(1, FREE, 8, 1), row(2, FREE, 8, 1)])
    with pytest.raises(Unsupported, match="spliced event 1 frees a storage that is not alive"):
        _splice._check_pairs([row(0, FREE, 8, 5), row(1, FREE, 8, 5)])  # a baseline storage freed twice


def test_columns_have_the_event_dtypes_and_times_never_go_back():
    cols = _splice.columns([row(1.0, ALLOC, 8, 1), row(0.5, FREE, 8, 1), row(2.0, ALLOC, 4, 2)])
    assert cols["time"].tolist() == [1.0, 1.0, 2.0]
    assert cols["bytes"].tolist() == [8, 8, 4] and cols["storage"].dtype == np.int64
    assert cols["action"].dtype == np.int8 and cols["action"].tolist() == [ALLOC, FREE, ALLOC]
    empty = _splice.columns([])
    assert all(len(c) == 0 for c in empty.values()) and empty["time"].dtype == np.float64


def test_a_sweep_maps_each_full_block_to_the_probe_block_it_repeats():
    up = _splice._Sweep(0, 0, [[0]] * 4, [0, 1, 2, 3], 6, 1)
    assert [up.role(J) for J in range(6)] == [0, 1, 2, 2, 2, 3]
    assert [up.repeated(J) for J in range(6)] == [False, False, True, True, True, False]
    assert list(up.blocks()) == list(range(6)) and not up.down
    down = _splice._Sweep(0, 0, [[0]] * 4, [3, 2, 1, 0], 6, 1)
    assert [down.role(J) for J in range(6)] == [0, 1, 1, 1, 2, 3]
    assert list(down.blocks()) == [5, 4, 3, 2, 1, 0] and down.down
    lone = _splice._Sweep(0, 0, [[], [], [], [0]], [3], 6, 1)
    assert lone.role(2) == 3 and not lone.repeated(2) and list(lone.blocks()) == [5]
    assert (lone.absolute(0), lone.absolute(3)) == (0, 5)
    with pytest.raises(Unsupported, match="uses its middle block 1"):
        lone.absolute(1)
    whole = _splice._Sweep(0, 0, [[0]] * 4, [0, 1, 2, 3], 4, 1)  # a list no longer than its probe
    assert not any(whole.repeated(J) for J in range(4))
    periodic = _splice._Sweep(0, 0, [[0]] * 9, list(range(9)), 13, 2)  # the probe of 13 for a period of 2
    assert [periodic.role(J) for J in range(13)] == [0, 1, 2, 3, 4, 5, 6, 5, 6, 5, 6, 7, 8]


def test_the_full_baseline_repeats_the_middle_blocks_storages():
    base = {10: ((0, 0), 40, PARAM), 11: ((0, 1), 48, PARAM), 12: ((0, 1), 8, PARAM), 13: ((0, 2), 48, PARAM)}
    t = tagger([], base=base)
    blocks = [(5, 100, 0), (10, 40, 0), (11, 48, 0), (12, 8, 0), (13, 48, 1)]
    out = _splice.spliced_baseline(t, blocks)
    fresh = [(k, n, d) for k, n, d in out if k < -(1 << 40)]
    assert out[:4] == blocks[:4] and out[-1] == blocks[-1]  # block 1's storages, then two more blocks' right after
    assert [(n, d) for _, n, d in fresh] == [(48, 0), (8, 0)] * (FULL - SIZE)
    assert len({k for k, _, _ in fresh}) == 4


def test_an_emas_buffer_grows_to_the_full_models_rounded():
    base = {20: ((0, 1), 1000, PARAM)}
    t = tagger([], base=base, grown={20: (1000, 600), 21: (70, 30)})  # 21: not a baseline storage
    assert _splice._grown(t) == {20: 2048}  # 1600 B rounded up to 512
    out = _splice.spliced_baseline(t, [(20, 1000, 0)])
    assert out[0] == (20, 2048, 0) and [n for _, n, _ in out[1:]] == [2048] * (FULL - SIZE)
