"""Wrapped numbers (``x / 2.0``) that autograd saves live as long as the node keeps them, to the byte.

The argument parser's 0-dim tensor for a Python number is kept by ``DivBackward0``/``MulBackward0`` until
backward releases the node's variables (or, with ``retain_graph=True``, until the graph is dropped).
"""

import pytest
import torch
from oracles import tracked_and_profiled

import memkit

N = 1000


def assert_exact(fn, **track_kwargs):
    tl, (prof_peak, prof_end) = tracked_and_profiled(fn, **track_kwargs)
    assert (tl.peak_bytes - tl.baseline_bytes, tl.end_bytes - tl.baseline_bytes) == (prof_peak, prof_end)
    return tl


@pytest.fixture
def x():
    torch.set_num_threads(1)
    return torch.randn(N, requires_grad=True)


def test_saved_divisor_lives_until_backward_releases_it(x):
    kept = {}

    def step():
        y = x / 2.0  # DivBackward0 saves the float64 2.0
        kept["y"] = y  # y outlives the window, so the backward's peak holds it and the divisor
        y.sum().backward()

    tl = assert_exact(step, inputs={"x": x})
    # the 8-byte divisor is freed in the backward, not when the division returned
    df = tl.to_pandas()
    saved = df[tl.column("storage") < -1]  # a saved number's rows carry a key of their own
    assert saved.bytes.tolist() == [8, 8] and saved.action.tolist() == ["alloc", "free"]
    assert saved.phase.tolist() == ["other", "backward"]


def test_retain_graph_keeps_the_divisor_until_the_graph_is_dropped(x):
    kept = {}

    def step():
        y = x / 2.0
        y.sum().backward(retain_graph=True)
        kept["y"] = y  # the graph, and its saved divisor, outlive the window

    tl = assert_exact(step, inputs={"x": x})
    end = tl.end_bytes - tl.baseline_bytes
    assert end == 2 * 4 * N + 8  # y, x.grad and the divisor
    del kept["y"]  # and the graph dies with y
    x.grad = None


def test_retain_graph_then_drop_frees_the_divisor_in_the_window(x):
    def step():
        y = x / 2.0
        y.sum().backward(retain_graph=True)
        z = y * 3.0  # saved as well, dropped with y's graph below
        del y, z

    tl = assert_exact(step, inputs={"x": x})
    assert tl.end_bytes - tl.baseline_bytes == 4 * N  # x.grad only


def test_multiplier_and_reflected_division_are_saved(x):
    kept = {}

    def step():
        a = x * 3.0  # MulBackward0 saves other
        b = 2.0 / (x + 1.0)  # x.reciprocal() * 2.0: MulBackward0 again
        kept["ab"] = (a, b)
        (a.sum() + b.sum()).backward()

    assert_exact(step, inputs={"x": x})


def test_output_dropped_before_backward_frees_the_divisor_with_the_graph(x):
    def step():
        y = x / 2.0
        del y  # the node and its saved divisor die here
        torch.empty(N)  # any later allocation sees the divisor gone

    tl = assert_exact(step, inputs={"x": x})
    assert tl.end_bytes == tl.baseline_bytes


def test_nothing_is_saved_under_no_grad_or_without_requires_grad(x):
    def step():
        with torch.no_grad():
            y = x / 2.0
        z = x.detach() / 2.0
        del y, z

    tl = assert_exact(step, inputs={"x": x})
    assert 8 not in tl.to_pandas().query("action == 'alloc'").bytes.tolist()


@pytest.mark.parametrize("preset", ["dit", "pixart"])
def test_training_step_at_256px_equals_profiler(preset):
    # diffusers' attention divides by rescale_output_factor (x / 1.0) in every block: DiT 2, PixArt 4 divisors
    # saved until the backward reaches them, which is where the peak is at 256 px
    torch.set_num_threads(1)
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model, height=256, width=256)
    opt = torch.optim.AdamW(model.parameters())
    memkit.train_step(model, inputs, opt)
    tl = assert_exact(lambda: memkit.train_step(model, inputs, opt), model=model, optimizer=opt, inputs=inputs)
    assert tl.meta["lower_bound_ops"] == []
