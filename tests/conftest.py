import os
from typing import Any

import pytest
import torch

# pytest-xdist's workers share the machine's cores. torch's default (an intra-op thread per core) in each worker
# oversubscribes them, and OpenMP's waiting threads then slow every real-tensor test: tests/test_checkpointing.py and
# tests/test_estimate.py on 2 cores with 2 workers took 171 s with 2 threads each, 57 s with one set here (48 s with
# OMP_NUM_THREADS=1; 2026-11-26). So a worker runs with its share of the cores; tests of thread-dependent kernels
# (attention's per-thread buffers, the EMA's threaded update) set their own thread count, and
# `_deterministic_threads` restores this one after each test.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# The slow suites train every preset in many settings (offload equality over three steps, checkpointing with every
# provider, the tracker against the profiler, every input size): minutes per preset. Their cases run in `make test`
# (and CI) for these presets, the seven the suites were written with, one per code path they test; a slow case for
# any other preset is marked `extended` and runs in `make test-extended`. Every preset keeps its fast contract in
# `make test`: built at each size, shapes, gradients, parameter counts, LoRA counts against peft, its tiny estimate
# against the tracked run, block memoization.
CORE_PRESETS = frozenset({"flux", "sd3", "ltx-video", "wan", "unet", "pixart", "dit"})


# Presets whose config has a core preset's keys and code path, only other sizes (an A14B expert's config is Wan 2.1
# 14B's): their fast memoization case is the core preset's, so it runs in the extended tier too.
SIZE_VARIANTS = frozenset({"wan2.1-1.3b", "wan2.2-t2v-a14b"})


def _missing_class(preset: str) -> str | None:
    """Why the installed diffusers cannot build ``preset`` (its class came in a later release), or None."""
    import diffusers

    from memkit.presets import PRESETS

    spec = PRESETS.get(preset)
    if spec is None or hasattr(diffusers, spec.model_class):
        return None
    return f"diffusers {diffusers.__version__} has no {spec.model_class} (preset {preset}): a later release added it"


def pytest_collection_modifyitems(config, items):
    _check_fast_cases(items)
    for item in items:
        preset = getattr(getattr(item, "callspec", None), "params", {}).get("preset")
        if isinstance(preset, str):
            if why := _missing_class(preset):  # the diffusers floor's run (make test-matrix)
                item.add_marker(pytest.mark.skip(reason=why))
            slow_elsewhere = item.get_closest_marker("slow") and preset not in CORE_PRESETS
            same_path = preset in SIZE_VARIANTS and item.originalname == "test_every_preset_default_step"
            if slow_elsewhere or same_path:
                item.add_marker(pytest.mark.extended)
        if item.get_closest_marker("extended") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)  # the extended tier is slower still: `make test-fast` leaves it out
        if not _kept_fast(item):
            item.add_marker(pytest.mark.slow)


def _kept_fast(item) -> bool:
    """Whether `make test-fast` (the edit-test loop, under 3 minutes on 2 cores) keeps a parametrized case. A test
    module's ``FAST_CASES`` maps a parametrized test's name to the case ids the loop keeps, one per code path the
    test checks; the test's other cases are marked slow (after the extended tier is settled above, so they stay in
    `make test` and CI). A test the mapping does not name keeps every case."""
    keep = getattr(getattr(item, "module", None), "FAST_CASES", {}).get(getattr(item, "originalname", None))
    callspec = getattr(item, "callspec", None)
    return keep is None or callspec is None or callspec.id in keep


def _check_fast_cases(items) -> None:
    """A ``FAST_CASES`` id that names no case (a typo, a renamed parameter) would leave `make test-fast` without that
    code path unnoticed: refused, wherever a test's cases are collected together (not one node id alone)."""
    ids: dict[tuple[Any, str], set[str]] = {}
    for item in items:
        if hasattr(getattr(item, "module", None), "FAST_CASES") and hasattr(item, "callspec"):
            ids.setdefault((item.module, item.originalname), set()).add(item.callspec.id)
    for (module, name), seen in ids.items():
        missing = module.FAST_CASES.get(name, set()) - seen
        if missing and len(seen) > 1:
            raise pytest.UsageError(f"{module.__name__}.FAST_CASES[{name!r}] names {sorted(missing)}, which are not "
                                    f"among its cases {sorted(seen)}")  # fmt: skip


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Tests run with the machine's thread count restored after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _own_workspace_cache(tmp_path_factory, monkeypatch):
    """Each test has its own file of learned kernel buffers (memkit/memory/workspace/learned.py): what one test
    learned is not on disk for the next, which may be about learning itself (a failing worker, say)."""
    from memkit.memory.workspace import learned

    monkeypatch.setenv("MEMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("workspace-cache")))
    monkeypatch.setattr(learned, "_disk", None)
