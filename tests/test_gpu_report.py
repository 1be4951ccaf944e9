"""The GPU suite's plumbing, on a CPU machine: ``tests/gpu`` skipped in one line (and still collectable), the CUDA
part of a tracked window, and ``bench/gpu_report.py`` writing its table below GPU.md's marker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu._cuda_run import cuda_window

import memkit
from bench import gpu_report

ROOT = Path(__file__).resolve().parents[1]


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    paths = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": paths, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA prints")
def test_without_cuda_tests_gpu_is_skipped_in_one_line():
    run = _pytest("tests/gpu", "-q", "-rs")
    assert run.returncode == 0, run.stdout + run.stderr
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1
    assert "tests/gpu: no CUDA device (torch.cuda.is_available() is False; torch " in skipped[0]
    assert "1 skipped" in run.stdout


@pytest.mark.slow
@pytest.mark.extended  # CI time (18 s, a subprocess collecting tests/gpu); make test-gpu collects them on a GPU
def test_the_gpu_tests_import_and_collect_on_a_cpu_machine():
    run = _pytest("tests/gpu", "-q", "--collect-only", MEMKIT_GPU_COLLECT="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(memkit.PRESETS) + 2} tests collected" in run.stdout


def test_cuda_window_is_what_the_cuda_events_add_to_the_start():
    model = memkit.load_model("dit", dtype=torch.bfloat16)
    inputs = memkit.make_inputs(model)
    for device, expected in ((None, lambda tl: (0, 0)), ("cuda", None)):
        with memkit.track(model, inputs=inputs, alloc_granularity=512, device=device, cuda_history=False) as tl:
            memkit.train_step(model, inputs)
        model.zero_grad(set_to_none=True)
        if expected is None:  # every event counted as the device's: the window's own peak and end
            assert cuda_window(tl) == (tl.peak_bytes - tl.baseline_bytes, tl.end_bytes - tl.baseline_bytes)
            assert cuda_window(tl)[0] > 0
        else:  # CPU events only
            assert cuda_window(tl) == expected(tl)
    assert cuda_window(memkit.Timeline()) == (0, 0)


RECORD = {
    "test": "test_x",
    "outcome": "passed",
    "time": "2026-11-26T10:00:00Z",
    "gpu": "NVIDIA H100 80GB HBM3",
    "gpu_bytes": 85_000_000_000,
    "capability": "9.0",
    "torch": "2.13.0+cu128",
    "cuda": "12.8",
    "diffusers": "0.42.1",
    "preset": "flux",
    "what": "estimate",
    "allocated": [1_010, 1_000],
    "reserved": None,
}


def test_the_report_writes_one_row_per_pair_below_the_marker(tmp_path):
    results = tmp_path / "run.jsonl"
    results.write_text(json.dumps(RECORD) + "\n\n")
    md = tmp_path / "GPU.md"
    md.write_text(f"# head\n\n{gpu_report.MARKER}\n\nNot yet run on a GPU.\n")
    assert gpu_report.main([str(results), "--out", str(md)]) == 0
    text = md.read_text()
    assert text.startswith(f"# head\n\n{gpu_report.MARKER}\n\nRun 2026-11-26T10:00:00Z to 2026-11-26T10:00:00Z on ")
    assert "Not yet run" not in text
    assert "gpu NVIDIA H100 80GB HBM3, capability 9.0, torch 2.13.0+cu128, cuda 12.8, diffusers 0.42.1." in text
    assert "| test_x | flux | estimate | 1,010 / 1,000 | +10 (+1.00%) |  |  | passed |" in text
    gpu_report.main([str(results), "--out", str(md)])
    assert md.read_text() == text  # written again, the same


def test_without_results_the_report_changes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_report, "RESULTS", tmp_path / "none")
    md = tmp_path / "GPU.md"
    md.write_text(f"{gpu_report.MARKER}\n\nNot yet run on a GPU.\n")
    assert gpu_report.main(["--out", str(md)]) == 0
    assert md.read_text() == f"{gpu_report.MARKER}\n\nNot yet run on a GPU.\n"
    assert "no GPU results in" in capsys.readouterr().out


def test_a_file_without_the_marker_is_refused(tmp_path):
    md = tmp_path / "GPU.md"
    md.write_text("# head\n")
    with pytest.raises(ValueError, match="has no marker line"):
        gpu_report.write("section", md)
