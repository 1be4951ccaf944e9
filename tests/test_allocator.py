"""memkit.memory.allocator_window: the CPU allocator's own peak and end over a window, from torch.profiler."""

import gc
import sys

import pytest
import torch
from _cpu_estimate import estimate_cpu

import memkit
from memkit.memory import allocator_window


def test_an_allocation_freed_inside_the_window_is_its_peak():
    with allocator_window() as window:
        x = torch.empty(2**24, dtype=torch.uint8)  # 16 MiB, freed before the window ends
        del x
    assert window.peak_bytes >= 2**24
    assert window.peak_bytes < 2**24 + 2**16  # nothing else of note
    assert abs(window.end_bytes) < 2**16
    assert window.allocations >= 1


def test_what_outlives_the_window_is_its_end():
    with allocator_window() as window:
        kept = torch.zeros(2**20, dtype=torch.uint8)
    assert window.end_bytes >= kept.nbytes
    assert window.peak_bytes >= window.end_bytes


def test_the_window_is_filled_only_when_it_closes():
    with allocator_window() as window:
        _ = torch.ones(1024)
        assert window.peak_bytes == 0
    assert window.peak_bytes >= 4096


def test_it_equals_the_tracker_for_a_training_step():
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model)
    opt = torch.optim.AdamW(model.parameters())
    memkit.train_step(model, inputs, opt)  # a steady step: its optimizer state exists
    gc.collect()
    with allocator_window() as window:
        with memkit.track(model, optimizer=opt, inputs=inputs) as tl:
            memkit.train_step(model, inputs, opt)
    assert window.peak_bytes == tl.peak_bytes - tl.baseline_bytes
    assert window.end_bytes == tl.end_bytes - tl.baseline_bytes


def test_an_estimate_allocates_a_tiny_fraction_of_its_parameters():
    with allocator_window() as window:
        tl = estimate_cpu("flux", size="small", progress=False)
    assert tl.baseline_by_category["parameter"] > 100 * 2**20
    assert window.peak_bytes < 2**20


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="device must be"):
        with allocator_window(device="tpu"):
            pass


def test_the_profiler_says_nothing_on_stderr_but_the_block_still_can(capfd):
    with allocator_window():
        print("from the block", file=sys.stderr)
    err = capfd.readouterr().err
    assert err.strip() == "from the block"
