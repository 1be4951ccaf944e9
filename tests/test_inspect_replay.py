"""``memkit inspect FILE --replay``: each segment a real snapshot's allocator made, beside the model's.

The snapshots are the corpus of tests/test_caching_allocator_real.py (five public snapshots, their sources in that
file's docstring) and its hand-written expandable-segments snapshot; the counts expected are read from the corpus's
traces, not from the command's output.
"""

import json
import pickle
import re
import subprocess
import sys

import pytest
from test_caching_allocator_real import (
    CORPUS,
    IDS,
    WITH_SEGMENTS,
    WITH_SEGMENTS_IDS,
    expandable_snapshot,
    mutated,
    segments_made,
    traced,
)

from memkit.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _write(path, snapshot: dict):
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    return str(path)


def _row(out: str, index: int) -> str:
    """The table row of trace entry ``index``."""
    return next(line for line in out.splitlines() if re.match(rf"\s+{index}\s+segment_", line))


@pytest.mark.parametrize("snapshot", CORPUS, ids=IDS)
def test_the_corpus_replays_all_the_same(capsys, tmp_path, snapshot):
    path = _write(tmp_path / "s.pickle", snapshot)
    made = {d: segments_made(snapshot, d) for d in traced(snapshot)}
    code, out, err = _run(capsys, "inspect", path, "--replay")
    assert code == 0, err
    summaries = [line for line in out.splitlines() if re.match(r"device \d+: \d+ of", line)]
    assert summaries == [f"device {d}: {len(n)} of {len(n)} segments the same" for d, n in made.items()]
    assert sum(line.endswith("  yes") for line in out.splitlines()) == sum(map(len, made.values()))
    assert "NO" not in out
    code, out, _ = _run(capsys, "inspect", path, "--replay", "--json")
    devices = json.loads(out)["devices"]
    assert code == 0 and list(devices) == [str(d) for d in made]
    for d, sizes in made.items():
        device = devices[str(d)]
        assert device["matched"] == device["total"] == len(sizes) and device["reason"] is None
        real, model = ([e[key] for e in device["events"]] for key in ("bytes", "model_bytes"))
        assert real == model == sizes


@pytest.mark.parametrize("snapshot", WITH_SEGMENTS, ids=WITH_SEGMENTS_IDS)
def test_a_changed_segment_exits_1_and_marks_its_row(capsys, tmp_path, snapshot):
    changed, index = mutated(snapshot)
    path, n = _write(tmp_path / "s.pickle", changed), len(segments_made(snapshot))
    code, out, _ = _run(capsys, "inspect", path, "--replay")
    assert code == 1
    device_0 = out[: out.index("device 0: ", out.index("device 0: ") + 1)]  # device 0's header to its summary
    assert _row(device_0, index).rstrip().endswith("NO")
    assert sum(line.rstrip().endswith("yes") for line in device_0.splitlines()) == n - 1
    assert f"device 0: {n - 1} of {n} segments the same" in out
    code, out, _ = _run(capsys, "inspect", path, "--replay", "--json")
    data = json.loads(out)
    assert code == 1 and data["same"] is False
    assert [e["index"] for e in data["devices"]["0"]["events"] if not e["same"]] == [index]


def test_a_snapshot_without_a_trace_exits_2_with_one_line_and_no_traceback(tmp_path):
    path = _write(tmp_path / "segments.pickle", {"segments": CORPUS[0]["segments"], "device_traces": []})
    done = subprocess.run(
        [sys.executable, "-m", "memkit", "inspect", path, "--replay"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("memkit inspect: error: replay needs a trace")
    assert "torch.cuda.memory._record_memory_history()" in done.stderr


def test_expandable_segments_are_replayed_as_segment_map(capsys, tmp_path):
    path = _write(tmp_path / "expandable.pickle", expandable_snapshot())
    code, out, err = _run(capsys, "inspect", path, "--replay")
    assert code == 0, err
    assert "alloc conf: 'expandable_segments:True', recorded" in out
    assert "segment_alloc" not in out and out.count("segment_map") == 3
    assert out.rstrip().endswith("device 0: 3 of 3 segments the same")
    code, out, _ = _run(capsys, "inspect", path, "--replay", "--alloc-conf", "")
    assert code == 1 and "device 0: 0 of 3 segments the same" in out
    assert _row(out, 0).split()[-4:] == ["30.00", "MiB", "(segment_alloc)", "NO"]  # the model's action is shown


def test_a_state_that_cannot_be_rebuilt_says_why_and_exits_1(capsys, tmp_path):
    snapshot = expandable_snapshot()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][4:]
    code, out, _ = _run(capsys, "inspect", _write(tmp_path / "s.pickle", snapshot), "--replay")
    assert code == 1
    assert "not replayed: the trace did not map every expandable segment's pages" in out
    assert "device 0: 0 of 1 segments the same (not replayed)" in out


def test_bad_combinations_exit_2(capsys, tmp_path):
    path = _write(tmp_path / "s.pickle", CORPUS[0])
    for argv, message in [
        (["--replay", "--html", str(tmp_path / "t.html")], "does not go with --replay"),
        (["--alloc-conf", "expandable_segments:True"], "--alloc-conf is for --replay"),
        (["--replay", "--alloc-conf", "no_such_option:1"], "no_such_option"),
    ]:
        code, _, err = _run(capsys, "inspect", path, *argv)
        assert code == 2 and err.startswith("memkit inspect: error:") and message in err, argv


def test_replay_starts_without_torch(tmp_path):
    path = _write(tmp_path / "s.pickle", CORPUS[0])
    code = (
        "import sys, contextlib, io\n"
        "from memkit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['inspect', {path!r}, '--replay']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
