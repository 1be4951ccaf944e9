"""What the snapshot reader and writer agree on (memkit/memory/_snapshot_schema.py): the marker frame and the
frame text, checked on their own (the round trips through whole snapshots are in test_snapshot.py)."""

import gc

from hypothesis import given
from hypothesis import strategies as st

from memkit.memory._snapshot_schema import frame_line, gc_paused, is_marker, marker_frame, parse_marker, stack_of
from memkit.memory.events import CATEGORIES, PHASES

WORD = st.text(st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=20)  # no spaces


def test_the_marker_frame_has_the_documented_shape():
    cat, phase = CATEGORIES.index("activation"), PHASES.index("forward")
    assert marker_frame(cat, phase, "aten.mm.default") == {
        "filename": "memkit",
        "line": 0,
        "name": "category=activation phase=forward op=aten.mm.default",
    }
    assert marker_frame(cat, phase, None) == {
        "filename": "memkit",
        "line": 0,
        "name": "category=activation phase=forward",
    }
    assert is_marker(marker_frame(cat, phase, None)) and not is_marker({"filename": "model.py"})
    assert parse_marker(marker_frame(cat, phase, "a=b=c")) == (cat, phase, "a=b=c")  # an op may hold "="


@given(st.integers(0, len(CATEGORIES) - 1), st.integers(0, len(PHASES) - 1), st.none() | WORD)
def test_a_marker_reads_back_as_written(category, phase, op):
    assert parse_marker(marker_frame(category, phase, op)) == (category, phase, op)


def test_an_absent_or_unknown_category_or_phase_reads_as_minus_one():
    assert parse_marker({"filename": "memkit"}) == (-1, -1, None)
    assert parse_marker({"filename": "memkit", "name": "category=weights phase=sideways"}) == (-1, -1, None)
    assert parse_marker({"filename": "memkit", "name": "phase=backward"}) == (-1, PHASES.index("backward"), None)


def test_frame_line_is_file_line_name_or_the_name_alone():
    assert frame_line({"filename": "model.py", "line": 12, "name": "forward"}) == "model.py:12 forward"
    assert frame_line({"filename": "model.py", "name": "forward"}) == "model.py:0 forward"  # no line: 0
    for no_file in ({"filename": "", "name": "forward"}, {"filename": "none", "name": "forward"}, {"name": "forward"}):
        assert frame_line(no_file) == "forward"
    assert frame_line({}) == ""


def test_stack_of_gives_torch_frames_innermost_first():
    text = "train.py:5 main\nmodel.py:12 forward"
    assert stack_of(text) == [
        {"filename": "model.py", "line": 12, "name": "forward"},
        {"filename": "train.py", "line": 5, "name": "main"},
    ]
    assert stack_of("<unknown native frame>") == [{"filename": "none", "line": 0, "name": "<unknown native frame>"}]
    assert stack_of(None) == [] and stack_of("") == []


FILE = WORD.filter(lambda f: f != "none")  # "none" is how torch writes a frame without a file


@given(st.lists(st.tuples(FILE, st.integers(0, 10**6), WORD).map("{0[0]}:{0[1]} {0[2]}".format) | WORD, max_size=6))
def test_stack_of_is_the_inverse_of_frame_line(lines):
    text = "\n".join(lines)
    assert "\n".join(frame_line(f) for f in reversed(stack_of(text))) == text


def test_gc_paused_pauses_the_collector_and_restores_its_state():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
