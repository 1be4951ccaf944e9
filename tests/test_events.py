"""The event schema (memkit/memory/events.py): allocator rounding, category codes, the interner, EventLog."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from memkit.memory.events import (
    ALLOC,
    CATEGORIES,
    COLUMNS,
    CUDA_BLOCK,
    FREE,
    EventLog,
    _Interner,
    check_category,
    round_alloc,
)

# ---- round_alloc ---------------------------------------------------------------------------------------------


def test_round_alloc_docstring_example():
    assert (round_alloc(1000, CUDA_BLOCK), round_alloc(1000, None)) == (1024, 1000)


@pytest.mark.parametrize("granularity", [None, 0])
def test_round_alloc_without_granularity_is_unchanged(granularity):
    assert round_alloc(1000, granularity) == 1000
    array = np.array([0, 1, 513])
    assert round_alloc(array, granularity) is array


def test_round_alloc_exact_multiples_and_empty_allocations():
    assert round_alloc(512, 512) == 512
    assert round_alloc(1024, 512) == 1024
    assert round_alloc(513, 512) == 1024
    assert round_alloc(1, 512) == 512
    assert round_alloc(0, 512) == 512  # 0 bytes still take a block


@given(nbytes=st.integers(0, 2**40), granularity=st.integers(1, 2**20))
def test_round_alloc_is_the_smallest_multiple_of_at_least_one_block(nbytes, granularity):
    rounded = round_alloc(nbytes, granularity)
    assert isinstance(rounded, int)
    assert rounded % granularity == 0
    assert rounded >= max(nbytes, granularity)
    assert rounded - granularity < max(nbytes, 1)  # one block less would be too small


@given(values=st.lists(st.integers(0, 2**40), min_size=1, max_size=20), granularity=st.integers(1, 4096))
def test_round_alloc_on_an_array_matches_each_int(values, granularity):
    rounded = round_alloc(np.array(values, dtype=np.int64), granularity)
    assert isinstance(rounded, np.ndarray)
    assert rounded.tolist() == [round_alloc(v, granularity) for v in values]


# ---- check_category ------------------------------------------------------------------------------------------


def test_check_category_returns_the_stacking_order_index():
    assert [check_category(c) for c in CATEGORIES] == list(range(len(CATEGORIES)))


def test_check_category_names_the_allowed_categories():
    with pytest.raises(ValueError) as info:
        check_category("weights")
    assert str(info.value) == f"category must be one of {list(CATEGORIES)}, got 'weights'"


# ---- _Interner -----------------------------------------------------------------------------------------------


def test_interner_codes_are_first_seen_order_and_stable():
    interner = _Interner()
    assert [interner(s) for s in ("a", "b", "a", "c", "b")] == [0, 1, 0, 2, 1]
    assert interner.items == ["a", "b", "c"]


def test_interner_starts_from_given_items():
    interner = _Interner(["x", "y", "x"])
    assert interner.items == ["x", "y"]
    assert interner("y") == 1 and interner("z") == 2
    assert _Interner(None).items == [] and _Interner([]).items == []


# ---- EventLog ------------------------------------------------------------------------------------------------

NAMES = [name for name, _ in COLUMNS]


def test_empty_log_has_every_column_empty_with_its_dtype():
    cols = EventLog().columns()
    assert list(cols) == NAMES
    for name, dtype in COLUMNS:
        assert cols[name].dtype == dtype and len(cols[name]) == 0


def test_columns_hold_the_rows_in_order_with_their_dtypes():
    log = EventLog()
    log.rows.append((0.5, ALLOC, 2**40, 5, 0, 0, 3, -1, 7))
    log.rows.append((1.5, FREE, 2**40, 5, 1, 1, -1, 2, 7))
    cols = log.columns()
    assert list(cols) == NAMES
    for name, dtype in COLUMNS:
        assert cols[name].dtype == dtype
    assert cols["time"].tolist() == [0.5, 1.5]
    assert cols["action"].tolist() == [ALLOC, FREE]
    assert cols["bytes"].tolist() == [2**40, 2**40]  # int64: sizes past 4 GiB survive
    assert cols["category"].tolist() == [5, 5]
    assert cols["phase"].tolist() == [0, 1]
    assert cols["device"].tolist() == [0, 1]
    assert cols["op"].tolist() == [3, -1]
    assert cols["frame"].tolist() == [-1, 2]
    assert cols["storage"].tolist() == [7, 7]


def test_rows_of_the_wrong_width_are_refused_not_truncated():
    log = EventLog(rows=[(0.0, ALLOC, 8, 0, 0, 0, -1, -1, 1), (0.0, FREE, 8)])
    with pytest.raises((ValueError, IndexError)):
        log.columns()


def test_retags_rewrite_the_category_of_earlier_events_only():
    act, grad, opt = (CATEGORIES.index(c) for c in ("activation", "gradient", "optimizer_state"))
    log = EventLog()
    for storage in range(3):
        log.rows.append((float(storage), ALLOC, 64, act, 0, 0, -1, -1, storage))
    log.retags += [(0, grad), (2, opt)]
    assert log.columns()["category"].tolist() == [grad, act, opt]
    assert [row[3] for row in log.rows] == [act, act, act]  # the rows themselves are left as written


def test_a_later_retag_of_the_same_event_wins():
    act, grad, opt = (CATEGORIES.index(c) for c in ("activation", "gradient", "optimizer_state"))
    log = EventLog(rows=[(0.0, ALLOC, 64, act, 0, 0, -1, -1, 1)], retags=[(0, grad), (0, opt)])
    assert log.columns()["category"].tolist() == [opt]


def test_logs_do_not_share_their_lists():
    a, b = EventLog(), EventLog()
    a.rows.append((0.0, ALLOC, 8, 0, 0, 0, -1, -1, 1))
    a.devices("cpu")
    assert b.rows == [] and b.devices.items == []
