"""Timeline's contract on hand-made columns, checked against a pure-Python replay of the events (no tracker)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memkit.memory import CATEGORIES, PHASES, Timeline
from memkit.memory.events import ALLOC, COLUMNS, FREE
from memkit.units import format_bytes

# ---- a reference: replay the events one by one -------------------------------------------------------------


class Replay:
    """Live bytes in total and by category after each event, and the storages alive, the slow obvious way."""

    def __init__(self, cols, baseline):
        self.total, self.by_category, self.alive = [], [], []
        live = dict.fromkeys(CATEGORIES, 0) | baseline
        alive = {}
        for action, nbytes, category, storage in zip(
            cols["action"], cols["bytes"], cols["category"], cols["storage"], strict=True
        ):
            name = CATEGORIES[category]
            if action == ALLOC:
                live[name] += nbytes
                alive[storage] = len(self.total)
            else:
                live[name] -= nbytes
                alive.pop(storage, None)
            self.total.append(sum(live.values()))
            self.by_category.append(dict(live))
            self.alive.append(sorted(alive.values()))
        self.baseline = sum(baseline.values())

    @property
    def peak(self):
        return max([self.baseline, *self.total])

    @property
    def peak_index(self):
        if self.peak == self.baseline:
            return -1
        return next(i for i, v in enumerate(self.total) if v == self.peak)


def spans(phases, times):
    out = []
    for i, p in enumerate(phases):
        if out and out[-1][0] == PHASES[p]:
            continue
        if out:
            out[-1][2] = times[i]
        out.append([PHASES[p], times[i], times[i]])
    if out:
        out[-1][2] = times[-1]
    return [tuple(s) for s in out]


# ---- a hand-made window --------------------------------------------------------------------------------------

FWD, BWD, OPT_P, EMA_P = (PHASES.index(p) for p in ("forward", "backward", "optimizer", "ema"))
ACT, TMP, GRAD, OPT, EMA = (
    CATEGORIES.index(c) for c in ("activation", "temporary", "gradient", "optimizer_state", "ema")
)
BASELINE = {"parameter": 1000, "optimizer_state": 200}
ROWS = [  # time, action, bytes, category, phase, device, op, frame, storage
    (0.0, ALLOC, 300, ACT, FWD, 0, 0, 0, 1),
    (0.1, ALLOC, 400, TMP, FWD, 0, 1, -1, 2),
    (0.2, FREE, 400, TMP, FWD, 0, -1, -1, 2),
    (0.3, ALLOC, 400, GRAD, BWD, 1, 0, 1, 3),
    (0.4, ALLOC, 100, TMP, BWD, 1, 1, -1, 4),  # the peak: first of two equal maxima
    (0.5, FREE, 100, TMP, BWD, 1, -1, -1, 4),
    (0.6, ALLOC, 100, ACT, BWD, 0, 0, -1, 5),  # the same total again, by other categories
    (0.7, FREE, 300, ACT, OPT_P, 0, -1, -1, 1),
    (0.8, FREE, 200, OPT, OPT_P, 0, -1, -1, 99),  # a storage from before the window
    (0.9, ALLOC, 50, EMA, EMA_P, 0, -1, -1, 6),
]
DEVICES, OPS, FRAMES = ["cuda:0", "cuda:1"], ["aten.mm.default", "aten.add.Tensor"], ["a.py:1 f", "b.py:2 g"]


def columns(rows=ROWS):
    return {name: [r[i] for r in rows] for i, (name, _) in enumerate(COLUMNS)}


def hand(**kwargs):
    return Timeline(columns(), baseline_by_category=BASELINE, devices=DEVICES, ops=OPS, frames=FRAMES, **kwargs)


REF = Replay(columns(), BASELINE)


def test_the_hand_window_has_two_equal_maxima():  # guards the fixture: first-max tests need a tie
    assert REF.total.count(REF.peak) == 2 and REF.by_category[4] != REF.by_category[6]


def test_totals_follow_the_events():
    tl = hand()
    assert len(tl) == len(ROWS)
    assert tl.live_bytes.dtype == np.int64 and tl.live_bytes.tolist() == REF.total
    assert tl.signed_bytes.tolist() == [r[2] if r[1] == ALLOC else -r[2] for r in ROWS]
    assert tl.baseline_bytes == REF.baseline and tl.baseline_by_category == dict.fromkeys(CATEGORIES, 0) | BASELINE
    assert tl.end_bytes == REF.total[-1]
    assert tl.time.tolist() == [r[0] for r in ROWS]


def test_the_peak_is_the_first_maximum():
    tl = hand()
    assert tl.peak_bytes == REF.peak
    assert tl.peak_index == REF.peak_index == 4
    assert tl.peak_time == ROWS[REF.peak_index][0]
    assert tl.peak_phase == PHASES[ROWS[REF.peak_index][4]]
    assert tl.peak_by_category() == REF.by_category[REF.peak_index]
    assert sum(tl.peak_by_category().values()) == tl.peak_bytes


def test_bytes_by_category_at_each_event():
    tl = hand()
    assert tl.bytes_by_category_at(-1) == dict.fromkeys(CATEGORIES, 0) | BASELINE
    for i in range(len(ROWS)):
        assert tl.bytes_by_category_at(i) == REF.by_category[i], i
    with pytest.raises(IndexError, match=r"\[-1, 9\]"):
        tl.bytes_by_category_at(len(ROWS))


def test_live_by_category_is_each_categorys_series():
    tl = hand()
    series = tl.live_by_category()
    assert list(series) == list(CATEGORIES)
    for name in CATEGORIES:
        assert series[name].tolist() == [b[name] for b in REF.by_category], name
    np.testing.assert_array_equal(sum(series.values()), tl.live_bytes)


def test_phase_spans_are_the_runs_of_one_phase():
    tl = hand()
    assert tl.phase_spans() == spans([r[4] for r in ROWS], [r[0] for r in ROWS])
    assert [p for p, _, _ in tl.phase_spans()] == ["forward", "backward", "optimizer", "ema"]


def test_top_allocations_at_the_peak():
    tl = hand()
    top = tl.top_allocations()
    expected = sorted(REF.alive[REF.peak_index], key=lambda i: -ROWS[i][2])
    assert [a["index"] for a in top] == expected
    assert [a["bytes"] for a in top] == sorted((ROWS[i][2] for i in expected), reverse=True)
    assert [a["index"] for a in tl.top_allocations(2)] == expected[:2]
    first = top[0]
    row = ROWS[first["index"]]
    assert first == {
        "index": first["index"],
        "bytes": row[2],
        "category": CATEGORIES[row[3]],
        "phase": PHASES[row[4]],
        "time": row[0],
        "device": DEVICES[row[5]],
        "op": OPS[row[6]] if row[6] >= 0 else None,
        "frame": FRAMES[row[7]] if row[7] >= 0 else None,
    }
    with pytest.raises(ValueError, match="n must be >= 1"):
        tl.top_allocations(0)


def test_top_allocations_at_an_event_counts_that_event():
    tl = hand()
    for at in range(len(ROWS)):
        assert sorted(a["index"] for a in tl.top_allocations(100, at=at)) == REF.alive[at], at
    # the storage allocated at event 4 is freed at event 5: listed at 4, gone at 5
    assert 4 in [a["index"] for a in tl.top_allocations(100, at=4)]
    assert 4 not in [a["index"] for a in tl.top_allocations(100, at=5)]
    assert tl.top_allocations(at=-1) == []


def test_summary_and_pandas():
    tl = hand()
    assert tl.summary() == {
        "events": len(ROWS),
        "baseline_bytes": REF.baseline,
        "peak_bytes": REF.peak,
        "end_bytes": REF.total[-1],
        "peak_time": ROWS[REF.peak_index][0],
        "peak_phase": PHASES[ROWS[REF.peak_index][4]],
        "peak_by_category": REF.by_category[REF.peak_index],
    }
    df = tl.to_pandas()
    assert list(df.columns) == ["time", "action", "bytes", "category", "phase", "device", "op", "live_bytes"]
    assert df["action"].tolist() == ["alloc" if r[1] == ALLOC else "free" for r in ROWS]
    assert df["category"].tolist() == [CATEGORIES[r[3]] for r in ROWS]
    assert df["phase"].tolist() == [PHASES[r[4]] for r in ROWS]
    assert df["device"].tolist() == [DEVICES[r[5]] for r in ROWS]
    assert df["op"].tolist() == [OPS[r[6]] if r[6] >= 0 else "" for r in ROWS]
    assert df["bytes"].tolist() == [r[2] for r in ROWS] and df["live_bytes"].tolist() == REF.total


def test_repr_names_label_events_baseline_and_peak():
    text = repr(hand(meta={"label": "step"}))
    assert text == (
        f"Timeline('step', events={len(ROWS)}, baseline={format_bytes(REF.baseline)}, peak={format_bytes(REF.peak)})"
    )
    assert repr(hand()).startswith("Timeline(events=")


def test_a_window_that_never_rises_has_no_peak_event():
    frees = [r for r in ROWS if r[1] == FREE and r[8] == 99]
    tl = Timeline(columns(frees), baseline_by_category=BASELINE, devices=DEVICES)
    assert tl.peak_index == -1 and tl.peak_bytes == tl.baseline_bytes == REF.baseline
    assert (tl.peak_time, tl.peak_phase) == (0.0, "other")
    assert tl.peak_by_category() == dict.fromkeys(CATEGORIES, 0) | BASELINE
    assert tl.top_allocations() == []
    assert tl.end_bytes == REF.baseline - frees[0][2]


def test_an_empty_timeline():
    tl = Timeline(baseline_by_category={"input": 7})
    assert len(tl) == 0 and tl.live_bytes.tolist() == []
    assert (tl.baseline_bytes, tl.peak_bytes, tl.end_bytes, tl.peak_index) == (7, 7, 7, -1)
    assert tl.phase_spans() == [] and tl.top_allocations() == []
    assert tl.summary()["events"] == 0 and len(tl.to_pandas()) == 0


def test_op_and_frame_columns_are_optional():
    cols = columns()
    del cols["op"], cols["frame"]
    tl = Timeline(cols, baseline_by_category=BASELINE, devices=DEVICES)
    assert tl.column("op").tolist() == [-1] * len(ROWS) and tl.column("frame").tolist() == [-1] * len(ROWS)
    assert tl.top_allocations(1)[0]["op"] is None


@pytest.mark.parametrize("required", [name for name, _ in COLUMNS if name not in ("op", "frame")])
def test_a_missing_column_is_named(required):
    cols = columns()
    del cols[required]
    with pytest.raises(ValueError, match=f"columns is missing '{required}'"):
        Timeline(cols)


def test_bad_lengths_and_categories_are_named():
    cols = columns()
    cols["phase"] = cols["phase"][:-1]
    with pytest.raises(ValueError, match=rf"column 'phase' has {len(ROWS) - 1} rows, expected {len(ROWS)}"):
        Timeline(cols)
    with pytest.raises(ValueError, match=r"unknown categories \['weights'\]"):
        Timeline(columns(), baseline_by_category={"weights": 1})
    with pytest.raises(KeyError, match="no column 'size'"):
        hand().column("size")


# ---- properties over random windows -----------------------------------------------------------------------------


@st.composite
def windows(draw):
    """Random valid windows: frees only of live storages or of storages from before the window."""
    before = draw(st.lists(st.tuples(st.integers(1, 1000), st.integers(0, len(CATEGORIES) - 1)), max_size=3))
    baseline = dict.fromkeys(CATEGORIES, 0)
    for nbytes, cat in before:
        baseline[CATEGORIES[cat]] += nbytes
    waiting = [(10_000 + i, n, c) for i, (n, c) in enumerate(before)]
    live, rows, next_key = {}, [], 0
    for t, (kind, nbytes, cat, phase) in enumerate(
        draw(
            st.lists(
                st.tuples(st.integers(0, 2), st.integers(0, 1000), st.integers(0, 7), st.integers(0, 4)),
                max_size=50,
            )
        )
    ):
        if kind == 0 or not (live or waiting):
            live[next_key] = (nbytes, cat)
            rows.append((t / 10, ALLOC, nbytes, cat, phase, 0, -1, -1, next_key))
            next_key += 1
        elif kind == 1 and waiting:
            key, n, c = waiting.pop()
            rows.append((t / 10, FREE, n, c, phase, 0, -1, -1, key))
        elif live:
            key = sorted(live)[nbytes % len(live)]
            n, c = live.pop(key)
            rows.append((t / 10, FREE, n, c, phase, 0, -1, -1, key))
    return columns(rows), baseline


@settings(max_examples=150, deadline=None)
@given(windows(), st.data())
def test_any_window_agrees_with_the_replay(window, data):
    cols, baseline = window
    tl = Timeline(cols, baseline_by_category=baseline, devices=["cpu"])
    ref = Replay(cols, baseline)
    assert tl.live_bytes.tolist() == ref.total
    assert tl.peak_bytes == max([sum(baseline.values()), *ref.total])
    assert tl.peak_index == ref.peak_index
    assert sum(tl.peak_by_category().values()) == tl.peak_bytes
    if ref.peak_index >= 0:
        assert tl.peak_by_category() == ref.by_category[ref.peak_index]
    assert tl.end_bytes == (ref.total[-1] if ref.total else ref.baseline)
    assert tl.phase_spans() == spans(cols["phase"], cols["time"])
    if ref.total:
        at = data.draw(st.integers(0, len(ref.total) - 1))
        assert tl.bytes_by_category_at(at) == ref.by_category[at]
        assert sorted(a["index"] for a in tl.top_allocations(100, at=at)) == ref.alive[at]


def test_codes_out_of_range_and_indices_out_of_bounds_are_refused():

    def columns(**override):
        cols = {name: np.zeros(2, dtype) for name, dtype in COLUMNS}
        cols["bytes"][:] = 8
        cols["action"][:] = [0, 1]
        cols.update({k: np.asarray(v) for k, v in override.items()})
        return cols

    for name, bad in (("category", [0, len(CATEGORIES)]), ("phase", [5, 0]), ("action", [0, 2]), ("category", [-1, 0])):
        with pytest.raises(ValueError, match=f"column '{name}' holds code"):
            Timeline(columns(**{name: bad}))
    tl = Timeline(columns())
    for at in (-2, 2):
        with pytest.raises(IndexError, match="at must be in"):
            tl.top_allocations(at=at)
        with pytest.raises(IndexError, match="index must be in"):
            tl.bytes_by_category_at(at)


def test_peak_step_names_the_step_each_peak_is_in():
    from memkit.memory.timeline import peak_step

    both = {"measured": "first and steady", "first_step_peak_bytes": 3, "steady_peak_bytes": 5,
            "first_step_peak_reserved_bytes": 9, "steady_peak_reserved_bytes": 8}  # fmt: skip
    assert peak_step(both) == "steady step"  # allocated: the steady one is larger
    assert peak_step(both, reserved=True) == "first step"  # reserved: the first one is
    assert peak_step({**both, "steady_peak_bytes": 3}) == "first = steady step"
    assert peak_step({"measured": "first and steady"}) == "first and steady steps"  # peaks not given
    assert peak_step({"measured": "steady", "steps": 3}) == "step 3"
    assert peak_step({"measured": "first", "steps": 1}) == "first step"
    assert peak_step({"measured": "inference"}) == "inference pass"
