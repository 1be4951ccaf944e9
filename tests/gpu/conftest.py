"""The GPU suite (``make test-gpu``): memkit's figures held against the CUDA caching allocator's own counters on a
real device.

Without CUDA no module here is imported (``make test`` on a CPU machine pays nothing): the first one collected
holds a single skipped item, the others none, so ``pytest -v`` and ``-rs`` show one line saying why.
``MEMKIT_GPU_COLLECT=1`` imports and collects them anyway: ``MEMKIT_GPU_COLLECT=1 pytest tests/gpu --collect-only``
checks on a CPU machine that they collect (running them there fails: they need the device).

Each test hands its figures to the ``gpu_record`` fixture: one JSON line per pair (memkit's figure, the GPU's) in
``bench/gpu_results/<UTC time>.jsonl`` (gitignored), with the GPU, the torch, CUDA and diffusers versions and the
test's outcome, written after the test whether it passed or not; ``python -m bench.gpu_report`` turns the newest
file into the table of ``bench/GPU.md``.
"""

from __future__ import annotations

import gc
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "gpu_results"
_BUILD = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device visible"
WHY = f"tests/gpu: no CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, {_BUILD})"
SKIPPED = not torch.cuda.is_available() and os.environ.get("MEMKIT_GPU_COLLECT") != "1"
_SHOWN = pytest.StashKey[bool]()


class _NoCuda(pytest.Item):
    def runtest(self):
        pytest.skip(WHY)


class _Unimported(pytest.Module):
    def collect(self):
        if self.session.stash.get(_SHOWN, False):
            return []
        self.session.stash[_SHOWN] = True
        return [_NoCuda.from_parent(self, name="no_cuda")]


def pytest_pycollect_makemodule(module_path, parent):
    if SKIPPED:
        return _Unimported.from_parent(parent, path=module_path)
    return None


_OUTCOME = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_OUTCOME] = report.outcome
    return report


@pytest.fixture(scope="session")
def _results_file() -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.jsonl"


def _machine() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    import diffusers

    return {
        "gpu": props.name,
        "gpu_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "",
    }


@pytest.fixture
def gpu_record(request, _results_file):
    """``gpu_record(preset, what, allocated=(memkit's, real), reserved=(memkit's, real))``: figures (bytes) to write
    with this test's outcome once it has run; None where a figure is not measured."""
    rows = []

    def record(preset: str, what: str, *, allocated=None, reserved=None) -> None:
        rows.append({"preset": preset, "what": what, "allocated": allocated, "reserved": reserved})

    yield record
    if rows:
        common = {
            "test": request.node.originalname,
            "outcome": request.node.stash.get(_OUTCOME, "error"),
            "time": f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
            **_machine(),
        }
        with _results_file.open("a") as f:
            for row in rows:
                f.write(json.dumps({**common, **row}) + "\n")


@pytest.fixture(autouse=True)
def _free_the_device():
    """Each test starts where the last one's model, optimizer and cached segments are gone."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
