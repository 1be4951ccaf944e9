"""CUDA allocator history (memkit/memory/cuda.py) on CPU: the real machine says why it can't record; a stand-in
for torch.cuda's private history API checks what memkit asks of it when it can."""

import pytest
import torch

from memkit.memory import CudaHistory, CudaHistoryError, Timeline, cuda_history_available
from memkit.memory.cuda import cuda_snapshot, record_cuda_history

ON_CUDA = torch.cuda.is_available()


class FakeAllocator:
    """What ``torch.cuda.memory`` offers on a CUDA build: history switched on and off, and a snapshot."""

    def __init__(self, snapshot=None):
        self.calls: list[dict] = []
        self.snapshot = snapshot or {"segments": [], "device_traces": [[]]}

    def record(self, enabled="all", **kwargs):
        self.calls.append({"enabled": enabled, **kwargs})

    def take_snapshot(self):
        return self.snapshot


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch as a CUDA build with a device would look to memkit: the device, the API, the compiled hook."""
    allocator = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", allocator.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", allocator.take_snapshot)
    monkeypatch.setattr(torch._C, "_cuda_record_memory_history", object(), raising=False)
    return allocator


# ---- where it can't run: a clear reason, never torch's AttributeError ---------------------------------------


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU machine's answer")
def test_on_this_cpu_machine_history_is_unavailable_and_says_why():
    assert cuda_history_available() is False
    build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
    for call in (record_cuda_history, cuda_snapshot):
        with pytest.raises(CudaHistoryError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"CUDA allocator history needs a CUDA device; this torch {torch.__version__} has")
        assert build in message
        assert message.endswith(". Use memkit.track(), which measures exact storages on any device.")


def test_a_cuda_build_without_a_visible_device_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(CudaHistoryError, match="has no CUDA device is visible"):
        record_cuda_history()
    assert not cuda_history_available()


def test_a_cpu_only_build_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(CudaHistoryError, match="has a CPU-only build"):
        cuda_snapshot()


@pytest.mark.parametrize("missing", ["_record_memory_history", "_snapshot"])
def test_a_torch_without_the_private_api_names_the_missing_function(fake_cuda, monkeypatch, missing):
    monkeypatch.delattr(torch.cuda.memory, missing)
    assert cuda_history_available() is False
    for call in (record_cuda_history, cuda_snapshot):
        with pytest.raises(CudaHistoryError) as info:
            call()
        assert f"this torch {torch.__version__} has no torch.cuda.memory.{missing}. Use memkit.track()" in str(
            info.value
        )
    assert fake_cuda.calls == []


def test_a_private_api_that_is_not_callable_counts_as_missing(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", None)
    assert cuda_history_available() is False
    with pytest.raises(CudaHistoryError, match=r"has no torch\.cuda\.memory\._snapshot"):
        record_cuda_history()


def test_a_torch_built_without_the_allocator_history_says_so(fake_cuda, monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_record_memory_history")
    assert cuda_history_available() is False
    with pytest.raises(CudaHistoryError, match="was built without the CUDA allocator's history"):
        record_cuda_history()
    assert fake_cuda.calls == []


# ---- arguments are checked first, on any machine ------------------------------------------------------------


@pytest.mark.parametrize("max_entries", [0, -5, 1.5, True, "100", None])
def test_max_entries_must_be_a_positive_int(max_entries):
    with pytest.raises(ValueError, match=rf"max_entries must be a positive int, got {max_entries!r}$"):
        record_cuda_history(max_entries)


@pytest.mark.parametrize("stacks", ["cpp", "", "Python", None])
def test_stacks_must_be_python_or_all(stacks):
    with pytest.raises(ValueError, match=rf"stacks must be 'python' or 'all', got {stacks!r}$"):
        record_cuda_history(stacks=stacks)


# ---- where it runs ------------------------------------------------------------------------------------------


def test_history_is_available_where_a_device_and_the_api_are(fake_cuda):
    assert cuda_history_available() is True


def test_record_starts_full_history_with_the_given_stacks_and_limit(fake_cuda):
    handle = record_cuda_history(max_entries=1, stacks="all")
    assert isinstance(handle, CudaHistory) and handle.active
    assert fake_cuda.calls == [{"enabled": "all", "context": "all", "stacks": "all", "max_entries": 1}]


def test_record_defaults_to_python_stacks_and_100k_entries(fake_cuda):
    record_cuda_history()
    assert fake_cuda.calls == [{"enabled": "all", "context": "all", "stacks": "python", "max_entries": 100_000}]


def test_remove_stops_recording_once(fake_cuda):
    handle = record_cuda_history()
    handle.remove()
    handle.remove()
    assert not handle.active
    assert fake_cuda.calls[1:] == [{"enabled": None}]
    assert repr(handle) == "CudaHistory(active=False)"


def test_history_as_a_context_manager_stops_at_exit_even_on_error(fake_cuda):
    with pytest.raises(KeyError):
        with record_cuda_history(max_entries=10) as handle:
            assert handle.active and repr(handle) == "CudaHistory(active=True)"
            assert len(fake_cuda.calls) == 1
            raise KeyError("inside")
    assert not handle.active
    assert fake_cuda.calls[1:] == [{"enabled": None}]


def test_cuda_snapshot_reads_the_allocators_snapshot_as_a_timeline(fake_cuda):
    base = 0x7F0000000000
    fake_cuda.snapshot = {
        "segments": [],
        "device_traces": [
            [
                {"action": "alloc", "addr": base, "size": 1000, "stream": 0, "time_us": 1},
                {"action": "free_completed", "addr": base, "size": 1000, "stream": 0, "time_us": 2},
            ]
        ],
    }
    tl = cuda_snapshot(default_category="activation", alloc_granularity=512)
    assert isinstance(tl, Timeline)
    assert tl.peak_bytes - tl.baseline_bytes == 1024  # read_snapshot's keyword arguments were passed on
    assert tl.peak_by_category()["activation"] == 1024
    assert tl.end_bytes == tl.baseline_bytes


def test_a_torch_without_torch_cuda_memory_names_what_is_missing(fake_cuda, monkeypatch):
    monkeypatch.delattr(torch.cuda, "memory")
    assert cuda_history_available() is False
    with pytest.raises(CudaHistoryError, match=r"has no torch\.cuda\.memory\._record_memory_history"):
        record_cuda_history()
