"""The default estimate is the step that repeats: the first step and the steady step are both measured, and the
answer is the larger peak. Checked against real CPU steps tracked one by one (steps 1, 2 and 3), to the byte."""

from __future__ import annotations

import json

import pytest
import torch
from oracles import Wide, real_steps
from oracles import wide_inputs as inputs

import memkit


def test_the_default_measures_the_first_and_the_steady_step_to_the_byte():
    first, second, third = (tl.peak_bytes for tl in real_steps(3))
    assert second == third  # the steady step repeats
    assert second > first  # the optimizer state alive in the backward: the first step misses it
    tl = memkit.estimate(Wide, inputs, device="cpu", dtype=torch.float32)
    assert tl.meta["measured"] == "first and steady"
    assert tl.meta["first_step_peak_bytes"] == first
    assert tl.meta["steady_peak_bytes"] == second
    assert tl.peak_bytes == second  # the larger of the two


def test_the_steady_step_carries_the_state_the_first_created():
    first, steady = real_steps(2)
    tl = memkit.estimate(Wide, inputs, device="cpu", dtype=torch.float32)
    start = tl.meta["step_starts"][1]
    # what is live when the steady step begins: weights, the optimizer's state (2x the weights), the inputs
    state = tl.bytes_by_category_at(start - 1)
    assert state["optimizer_state"] == steady.baseline_by_category["optimizer_state"] > 0
    assert state["gradient"] == steady.baseline_by_category["gradient"] == 0  # zero_grad(set_to_none=True)
    assert tl.peak_between(0, start) == first.peak_bytes


def test_explicit_steps_measure_only_the_last():
    first, second, third = (tl.peak_bytes for tl in real_steps(3))
    for n, want, which in ((1, first, "first"), (2, second, "steady"), (3, third, "steady")):
        tl = memkit.estimate(Wide, inputs, device="cpu", dtype=torch.float32, steps=n)
        assert tl.peak_bytes == want
        assert tl.meta["measured"] == which
        assert tl.meta["first_step_peak_bytes"] == (want if n == 1 else None)
        assert tl.meta["steady_peak_bytes"] == (want if n > 1 else None)


def test_a_first_step_that_is_the_larger_is_the_answer():
    # no weight-sized state, a big first-update transient: SGD with momentum creates its buffers in the first
    # update, after the backward's gradients exist, and keeps them, so both steps peak in the update; the first
    # step's peak is never below the steady one's, and the answer is the larger whichever it is
    first, second = (tl.peak_bytes for tl in real_steps(2, optimizer="sgd"))
    tl = memkit.estimate(Wide, inputs, device="cpu", dtype=torch.float32, optimizer="sgd")
    assert (tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"]) == (first, second)
    assert tl.peak_bytes == max(first, second)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["pixart", "flux"])
def test_presets_first_and_steady_step_equal_real_steps(preset):
    def model_fn():
        return memkit.load_model(preset, size="tiny")

    first, second = real_steps(2, model_fn, lambda m: memkit.make_inputs(m))
    tl = memkit.estimate(preset, size="tiny", device="cpu", dtype=torch.float32)
    assert tl.meta["first_step_peak_bytes"] == first.peak_bytes
    assert tl.meta["steady_peak_bytes"] == second.peak_bytes
    assert tl.peak_bytes == max(first.peak_bytes, second.peak_bytes)


def test_inference_is_one_pass_and_refuses_a_first_step():
    tl = memkit.estimate("dit", size="tiny", mode="inference", device="cpu", dtype=torch.float32)
    assert tl.meta["measured"] == "inference"
    assert tl.meta["steps"] == 1
    assert tl.meta["first_step_peak_bytes"] == tl.meta["steady_peak_bytes"] == tl.peak_bytes
    with pytest.raises(ValueError, match="steps=1 asks for the first training step"):
        memkit.estimate("dit", size="tiny", mode="inference", steps=1)


@pytest.mark.parametrize("steps", [0, -1, 1.5, "2", True])
def test_bad_steps_name_the_argument(steps):
    with pytest.raises(ValueError, match="steps must be None .* or an int >= 1"):
        memkit.estimate("dit", size="tiny", steps=steps)


def test_the_defaults_are_the_command_line_s():
    tl = memkit.estimate("dit", size="tiny")
    assert (tl.meta["device"], tl.meta["dtype"], tl.meta["optimizer"]) == ("cuda", "bfloat16", "adamw")
    assert tl.meta["measured"] == "first and steady"
    assert tl.meta["bytes"] == "allocated"
    inference = memkit.estimate("dit", size="tiny", mode="inference")
    assert inference.meta["optimizer"] is None


def test_the_same_estimate_again_is_a_copy_of_the_first():
    memkit.estimation.clear_cache()
    a = memkit.estimate("dit", size="tiny")
    b = memkit.estimate("dit", size="tiny")
    assert (a.meta["cached"], b.meta["cached"]) == (False, True)
    assert b.peak_bytes == a.peak_bytes and len(b) == len(a)
    assert (b.column("bytes") == a.column("bytes")).all()
    b.meta["label"] = "mine"
    assert memkit.estimate("dit", size="tiny").meta.get("label") != "mine"  # nothing a caller does leaks back
    other = memkit.estimate("dit", size="tiny", optimizer="sgd")
    assert not other.meta["cached"]
    ckpt = memkit.estimate("dit", size="tiny", optimizations=[memkit.Checkpointing()])
    assert not ckpt.meta["cached"] and len(ckpt) != len(a)
    assert memkit.estimate("dit", size="tiny", optimizations=[memkit.Checkpointing()]).meta["cached"]


def test_the_playground_estimates_both_steps_on_a_gpu_by_default():
    from memkit.widgets.state import PlaygroundState

    state = PlaygroundState(preset="dit", estimate_size="tiny")
    assert state.steps is None and state.dtype == "bfloat16"
    result = state.estimate()
    assert result.ok, result.message
    tl = result.comparison.results["baseline"].timeline
    assert (tl.meta["device"], tl.meta["optimizer"], tl.meta["measured"]) == ("cuda", "adamw", "first and steady")
    table = result.comparison.table(unit="B")
    assert table.loc["baseline", "first step (B)"] == tl.meta["first_step_peak_bytes"]
    assert table.loc["baseline", "steady step (B)"] == tl.meta["steady_peak_bytes"]
    assert table.loc["baseline", "peak (B)"] == max(tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"])
    state.steps = 1  # the first step alone: one peak, no per-step columns
    one = state.estimate().comparison
    assert one.results["baseline"].timeline.meta["measured"] == "first"
    assert "steady step (B)" not in one.table(unit="B").columns
    state.mode = "inference"  # steps say which training step: an inference pass is one alike
    assert state.estimate().comparison.results["baseline"].timeline.meta["measured"] == "inference"


def test_the_playground_s_steps_control_offers_first_and_steady():
    pg = memkit.Playground(preset="dit")
    assert pg.controls["steps"].value is None
    assert dict(pg.controls["steps"].options)["first + steady"] is None


def test_the_command_line_reports_both_steps(capsys):
    from memkit.cli import main

    assert main(["estimate", "dit", "--size", "tiny", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    tl = memkit.estimate("dit", size="tiny")
    assert (result["first_step_peak_bytes"], result["steady_peak_bytes"]) == (
        tl.meta["first_step_peak_bytes"],
        tl.meta["steady_peak_bytes"],
    )
    assert result["peak_bytes"] == max(result["first_step_peak_bytes"], result["steady_peak_bytes"])
    assert (result["measured"], result["bytes"], result["steps"]) == ("first and steady", "allocated", 2)
    assert main(["estimate", "dit", "--size", "tiny", "--unit", "B"]) == 0
    out = capsys.readouterr().out
    assert "first step (B)" in out and f"{tl.meta['steady_peak_bytes']:,}" in out and "steady step (B)" in out
    assert main(["estimate", "dit", "--size", "tiny", "--steps", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert (one["measured"], one["steady_peak_bytes"]) == ("first", None)
    assert one["first_step_peak_bytes"] == one["peak_bytes"] == tl.meta["first_step_peak_bytes"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps takes an int >= 1"),
        (["--inference", "--steps", "1"], "--steps 1 asks for the first training step"),
    ],
)
def test_the_command_line_refuses_bad_steps(capsys, argv, message):
    from memkit.cli import main

    assert main(["estimate", "dit", "--size", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_playground_shows_a_setting_it_estimated_before_at_once():
    from memkit.widgets.state import PlaygroundState

    memkit.estimation.clear_cache()
    state = PlaygroundState(preset="dit", estimate_size="tiny")
    state.optimizations["checkpointing"].enabled = True
    first = state.estimate().comparison
    again = state.estimate().comparison
    for name in ("baseline", *state.build_variants()):
        a, b = first.results[name].timeline, again.results[name].timeline
        assert (a.meta["cached"], b.meta["cached"]) == (False, True)
        assert b.peak_bytes == a.peak_bytes and len(b) == len(a) and b.meta["label"] == name
    # the one cache of the process: the library call with the same settings is answered from it
    assert memkit.estimate("dit", size="tiny").meta["cached"]
    state.batch_size = 2  # another setting: estimated anew
    assert not state.estimate().comparison.results["baseline"].timeline.meta["cached"]
