"""memkit.compare and memkit.Comparison on tiny synthetic models: seconds for the whole file.

The models here are a few parameters wide, so every expectation is computed in the test itself, from the
timelines memkit returns (the table's memory columns), or from plain torch (outputs, gradients, the tolerance
rule ``max|Δ| <= tolerance * max(1, max|baseline|)``). Deliberately wrong optimizations move one thing at a
time by an exact power of two: the output (a parameter shifted while applied), one gradient (a grad hook), or
the parameters after the step (``after_step``).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import pytest
import torch

import memkit
import memkit.comparison as comparison
from memkit.handle import Handle, apply_all
from memkit.memory.events import CATEGORIES
from memkit.memory.timeline import Timeline
from memkit.presets import PRESETS

DELTA = 2.0**-10  # every shift: exact in float32 next to the values used here


@pytest.fixture(autouse=True)
def _no_learning_worker(monkeypatch):
    # The CPU ops of these models need no learned scratch; no worker process is started for them.
    monkeypatch.setenv("MEMKIT_LEARN_WORKSPACE", "0")


class Toy(torch.nn.Module):
    """``out = a * x + b`` (plus an empty parameter's sum, 0), with a frozen parameter that never gets a grad."""

    def __init__(self, a=(1.0, -2.0, 0.5, 0.25), b=(0.5, -0.25, 0.125, 0.0)):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a))
        self.b = torch.nn.Parameter(torch.tensor(b))
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.a * x + self.b + self.empty.sum()


X = {"x": torch.ones(4)}


class ShiftParam:
    """Adds ``delta`` to a parameter while applied: the output, the gradients and the parameters move."""

    def __init__(self, name, delta):
        self.name, self.delta = name, delta

    def apply(self, model):
        p = model.get_parameter(self.name)
        with torch.no_grad():
            p.add_(self.delta)

        def undo():
            with torch.no_grad():
                p.sub_(self.delta)

        return Handle(undo, name=f"shift {self.name}")

    def __str__(self):
        return f"shift({self.name})"


class ShiftGrad:
    """Adds ``delta`` to one parameter's gradient: only that gradient moves (and, with an update, the param)."""

    def __init__(self, name, delta):
        self.name, self.delta = name, delta

    def apply(self, model):
        hook = model.get_parameter(self.name).register_hook(lambda g: g + self.delta)
        return Handle(hook.remove, name=f"grad {self.name}")


class ShiftAfterStep:
    """Adds ``delta`` to a parameter after each step: only the parameters after the step move."""

    def __init__(self, name, delta):
        self.name, self.delta = name, delta

    def apply(self, model):
        p = model.get_parameter(self.name)

        def after_step():
            with torch.no_grad():
                p.add_(self.delta)

        return Handle(lambda: None, name=f"after {self.name}", after_step=after_step)


class Owns:
    """Holds a buffer of ``numel`` float32 in ``category`` while applied, declared through its handle."""

    def __init__(self, numel, category="ema"):
        self.numel, self.category = numel, category

    def apply(self, model):
        buffer = torch.zeros(self.numel)
        return Handle(lambda: None, name="owns", owned={self.category: [buffer]})

    def __str__(self):
        return "owns"


def run(variants, model_fn=Toy, **kwargs):
    kwargs = {"inputs": X, "repeats": 0, "progress": False} | kwargs
    return memkit.compare(model_fn, variants, **kwargs)


def message(excinfo) -> str:
    return str(excinfo.value)


# ---- plain torch: what the comparison should find ---------------------------------------------------------


def training_grads(model, inputs):
    out = model(**inputs)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def scale(t):
    return max(1.0, t.abs().max().item())


# ---- the tolerance rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("b_scale", [0.25, 8.0])
def test_output_tolerance_is_relative_to_the_larger_of_one_and_the_baseline(b_scale):
    b = tuple(b_scale * v for v in (1.0, -0.5, 0.25, 0.0))
    model_fn = lambda: Toy(a=(0.0, 0.0, 0.0, 0.0), b=b)  # noqa: E731 - out = b
    base_out = Toy(a=(0.0,) * 4, b=b)(**X).detach()
    shifted = Toy(a=(0.0,) * 4, b=tuple(v + DELTA for v in b))(**X).detach()
    d = (shifted - base_out).abs().max().item()
    allowed = scale(base_out)  # 1 for b_scale 0.25, 8 for 8
    assert d == DELTA
    for tolerance, expected in ((d / allowed, True), (d / allowed * 1.01, True), (d / allowed * 0.99, False)):
        cmp = run({"shift": [ShiftParam("b", DELTA)]}, model_fn, mode="inference", tolerance=tolerance)
        result = cmp.results["shift"]
        assert result.max_abs_d_output == d
        assert result.max_abs_d_grad == 0.0 and result.max_abs_d_param == 0.0  # inference: output only
        assert result.passed is expected, (b_scale, tolerance)
        assert cmp.results["baseline"].passed is True
        assert cmp.table().loc["shift", "pass"] == expected


@pytest.mark.parametrize("a_scale", [0.5, 16.0])
def test_gradient_tolerance_is_per_parameter_against_its_own_baseline_gradient(a_scale):
    # grad a = 2/n * out * x, grad b = 2/n * out: the hook moves a's gradient only.
    make = lambda: Toy(a=(a_scale, -a_scale, a_scale / 2, 0.0), b=(0.0,) * 4)  # noqa: E731
    _, grads = training_grads(make(), X)
    assert set(grads) == {"a", "b", "empty"}
    allowed = scale(grads["a"])
    # the output's and b's own scales are not the one that decides: a's gradient is
    for tolerance, expected in (
        (DELTA / allowed, True),
        (DELTA / allowed * 1.01, True),
        (DELTA / allowed * 0.99, False),
    ):
        cmp = run({"grad": [ShiftGrad("a", DELTA)]}, make, tolerance=tolerance)
        r = cmp.results["grad"]
        assert r.max_abs_d_output == 0.0 and r.max_abs_d_param == 0.0
        assert r.max_abs_d_grad == DELTA
        assert r.passed is expected, (a_scale, tolerance)


def test_one_failing_gradient_fails_the_variant_whichever_parameter_it_is():
    tolerance = DELTA / 2
    for name in ("a", "b"):
        r = run({"g": [ShiftGrad(name, DELTA)]}, tolerance=tolerance).results["g"]
        assert r.max_abs_d_grad == DELTA and r.passed is False, name
    # the largest difference over all parameters is reported, whichever comes first
    for first, second in ((4 * DELTA, DELTA), (DELTA, 4 * DELTA)):
        r = run({"g": [ShiftGrad("a", first), ShiftGrad("b", second)]}, tolerance=1.0).results["g"]
        assert r.max_abs_d_grad == 4 * DELTA and r.passed is True


@pytest.mark.parametrize("a_scale", [0.5, 8.0])
def test_parameters_after_the_step_are_compared_with_the_same_rule(a_scale):
    make = lambda: Toy(a=(a_scale, 0.0, 0.0, 0.0), b=(0.0,) * 4)  # noqa: E731
    allowed = max(1.0, a_scale)
    for tolerance, expected in ((DELTA / allowed, True), (DELTA / allowed * 0.99, False)):
        cmp = run({"after": [ShiftAfterStep("a", DELTA)]}, make, tolerance=tolerance)
        r = cmp.results["after"]
        assert r.max_abs_d_output == 0.0 and r.max_abs_d_grad == 0.0
        assert r.max_abs_d_param == DELTA
        assert r.passed is expected, (a_scale, tolerance)
    # a failing gradient is not rescued by parameters that match (training without an update)
    r = run({"g": [ShiftGrad("a", DELTA)]}, make, tolerance=DELTA / 64 / allowed).results["g"]
    assert r.max_abs_d_param == 0.0 and r.passed is False
    # in inference nothing is updated, so parameters are not compared at all
    r = run({"after": [ShiftAfterStep("a", 1.0)]}, make, mode="inference", tolerance=1e-6).results["after"]
    assert r.max_abs_d_param == 0.0 and r.passed is True


def test_with_an_optimizer_the_updated_parameters_are_compared():
    step = memkit.Step(optimizer="sgd")
    cmp = run({"same": [], "after": [ShiftAfterStep("b", DELTA)]}, step=step, tolerance=DELTA / 2)
    assert cmp.results["same"].max_abs_d_param == 0.0 and cmp.results["same"].passed is True
    assert cmp.results["after"].max_abs_d_param == DELTA and cmp.results["after"].passed is False
    table = cmp.table()
    assert table["max |Δparam|"].tolist() == [0.0, 0.0, DELTA]
    assert table["pass"].tolist() == [True, True, False]


def test_a_check_exactly_at_the_tolerance_passes_and_above_it_fails():
    tolerance = 0.25
    cmp = run(
        {
            "at": memkit.Variant(check=lambda m, h: {"c": tolerance}),
            "above": memkit.Variant(check=lambda m, h: {"c": np.nextafter(tolerance, 1.0)}),
            "tensor": memkit.Variant(check=lambda m, h: {"c": torch.tensor(0.125)}),
        },
        tolerance=tolerance,
    )
    assert cmp.results["at"].passed is True and cmp.results["above"].passed is False
    assert cmp.results["tensor"].checks == {"c": 0.125} and type(cmp.results["tensor"].checks["c"]) is float
    assert cmp.table()["c"].tolist()[1:] == [tolerance, np.nextafter(tolerance, 1.0), 0.125]
    # a check failing with differences in tolerance fails; differences failing with a passing check fail too
    both = {"shift": memkit.Variant(optimizations=[ShiftParam("b", 1.0)], check=lambda m, h: {"c": 0.0})}
    assert run(both, tolerance=tolerance).results["shift"].passed is False


# ---- what compare runs ---------------------------------------------------------------------------------------


def test_every_variant_starts_from_the_baselines_weights_and_inputs():
    models, weights, biases, seen_by_inputs = [], [], [], []

    def model_fn():
        models.append(torch.nn.Linear(4, 3))  # random weights: different at each call
        weights.append(models[-1].weight.detach().clone())
        biases.append(models[-1].bias.detach().clone())
        return models[-1]

    def inputs(model):
        seen_by_inputs.append(model)
        return {"input": torch.arange(8.0).reshape(2, 4)}

    def check(model, handle):
        return {"weight |Δ|": (model.weight - weights[0]).abs().max().item()}

    variants = {"v1": memkit.Variant(check=check), "v2": []}
    cmp = memkit.compare(
        model_fn, variants, inputs=inputs, step=memkit.Step(optimizer="sgd"), tolerance=1.0, progress=False
    )
    assert len(models) == 3 and seen_by_inputs == [models[0]]  # inputs built once, from the first model
    seen_by_inputs.clear()
    assert not torch.equal(weights[0], weights[1])  # the factory itself gave other weights
    # the check runs after the compared step's update: SGD (lr 1e-3) moved the baseline's weights by lr * grad
    first = torch.nn.Linear(4, 3)
    with torch.no_grad():
        first.weight.copy_(weights[0])
        first.bias.copy_(biases[0])
    first(**inputs(first)).pow(2).mean().backward()
    moved = 1e-3 * first.weight.grad.abs().max().item()
    assert cmp.results["v1"].checks["weight |Δ|"] == pytest.approx(moved, rel=1e-3)
    for name in ("v1", "v2"):
        r = cmp.results[name]
        assert r.max_abs_d_output == 0.0 and r.max_abs_d_grad == 0.0 and r.max_abs_d_param == 0.0
        assert r.passed is True


def test_steps_run_per_variant_and_the_time_is_the_median_of_the_untracked_ones():
    models = []

    def model_fn():
        models.append(Toy())
        return models[-1]

    for repeats in (0, 1, 3):
        models.clear()
        t0 = time.perf_counter()
        cmp = run({"v": []}, model_fn, repeats=repeats)
        wall = time.perf_counter() - t0
        # the compared step, `repeats` timed ones, the tracked one
        assert [m.calls for m in models] == [repeats + 2, repeats + 2]
        for r in cmp.results.values():
            if repeats == 0:
                assert math.isnan(r.seconds)
            else:
                assert 0 < r.seconds < wall
        table = cmp.table()
        base_s, v_s = cmp.results["baseline"].seconds, cmp.results["v"].seconds
        assert table["step (s)"].tolist() == pytest.approx([base_s, v_s], nan_ok=True)
        if repeats:
            assert table.loc["v", "time vs baseline"] == v_s / base_s


class Noisy(torch.nn.Module):
    """Adds uniform noise in the forward (like dropout) and records each draw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.draws = []

    def forward(self, x):
        noise = torch.rand(4)
        self.draws.append(noise)
        return self.w * x + noise


def test_random_numbers_of_the_compared_step_come_from_the_seed_and_leave_the_global_stream_alone():
    models = []

    def model_fn():
        models.append(Noisy())
        return models[-1]

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    cmp = run({"same": []}, model_fn, seed=7, repeats=1)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(7))
    for m in models:
        assert torch.equal(m.draws[0], expected)  # the compared step: seeded with `seed`
    assert cmp.results["same"].max_abs_d_output == 0.0 and cmp.results["same"].passed is True
    # the compared step drew in a forked stream; the timed and tracked steps drew from the global one
    g = torch.Generator()
    g.set_state(before)
    stream = [torch.rand(4, generator=g) for _ in range(4)]
    assert torch.equal(models[0].draws[1], stream[0]) and torch.equal(models[0].draws[2], stream[1])
    assert torch.equal(models[1].draws[1], stream[2]) and torch.equal(models[1].draws[2], stream[3])


def test_a_variant_carries_its_own_step_and_its_check_sees_its_model_and_handle():
    seen = []

    def check(model, handle):
        seen.append((model.b.detach().clone(), handle.name))
        return {"b moved": (model.b - Toy().b).detach().abs().max()}  # a tensor: made a float

    sgd = memkit.Step(optimizer="sgd")
    base_step = memkit.Step()
    variants = {
        "checked": memkit.Variant(optimizations=[ShiftParam("b", DELTA)], check=check),
        "sgd": memkit.Variant(step=sgd),
        "short": (ShiftParam("a", 0.0),),  # the short form: a sequence of optimizations
    }
    cmp = run(variants, step=base_step, tolerance=1.0)
    assert list(cmp.results) == ["baseline", "checked", "sgd", "short"]
    assert len(seen) == 1 and seen[0][1] == "shift b"
    assert torch.equal(seen[0][0], Toy().b.detach() + DELTA)  # the check ran with the optimization applied
    assert cmp.results["checked"].checks == {"b moved": DELTA}
    assert cmp.results["sgd"].step is sgd
    assert cmp.results["baseline"].step is base_step and cmp.results["checked"].step is base_step
    assert cmp.results["short"].optimizations == list(variants["short"])
    assert cmp.results["checked"].optimizations == list(variants["checked"].optimizations)
    assert isinstance(cmp.results["checked"].optimizations, list)
    # the baseline took no update: the SGD variant's parameters moved, its output and gradients did not
    r = cmp.results["sgd"]
    assert r.max_abs_d_output == 0.0 and r.max_abs_d_grad == 0.0 and r.max_abs_d_param > 0
    # with SGD (lr 1e-3, first step p -= lr * grad) the largest move is lr * the largest gradient
    _, grads = training_grads(Toy(), X)
    lr_grad = max(g.abs().max().item() for g in grads.values() if g.numel())
    assert r.max_abs_d_param == pytest.approx(1e-3 * lr_grad, rel=1e-3)
    table = cmp.table()
    assert "max |Δparam|" in table.columns and "b moved" in table.columns


def test_tracked_memory_is_the_steps_own_as_tracking_it_alone_finds():
    owner = Owns(1000)
    step = memkit.Step()
    cmp = run({"owns": [owner], "plain": []}, step=step)

    def alone(optimizations):
        model = Toy()
        with apply_all(model, optimizations) as handle:
            runner = step.bind(model, handle)
            with memkit.track(inputs=X, **runner.tracked_objects()) as tl:
                runner.run(X)
        return tl

    for name, opts in (("baseline", []), ("owns", [owner]), ("plain", [])):
        tl, ref = cmp.results[name].timeline, alone(opts)
        assert tl.meta["label"] == name
        assert tl.peak_bytes == ref.peak_bytes and tl.peak_by_category() == ref.peak_by_category()
        assert tl.baseline_by_category == ref.baseline_by_category
        assert tl.baseline_by_category["gradient"] == 0  # gradients of the earlier steps were freed
        assert tl.baseline_by_category["input"] == X["x"].nbytes
    assert cmp.results["owns"].timeline.baseline_by_category["ema"] == 4000
    assert cmp.results["owns"].timeline.peak_bytes - cmp.results["plain"].timeline.peak_bytes == 4000


def test_with_an_optimizer_the_tracked_step_is_a_steady_one():
    cmp = run({"v": []}, step=memkit.Step(optimizer="adamw"), repeats=0)
    n_trainable = sum(p.numel() for p in Toy().parameters() if p.requires_grad)
    for r in cmp.results.values():
        assert r.timeline.baseline_by_category["optimizer_state"] >= 2 * 4 * n_trainable  # exp_avg, exp_avg_sq


def test_default_inputs_and_presets_are_built_with_the_seed(monkeypatch):
    loaded, made = [], []

    def fake_load_model(name, **kwargs):
        loaded.append((name, kwargs))
        return Toy()

    def fake_make_inputs(model, **kwargs):
        made.append((model, kwargs))
        return dict(X)

    monkeypatch.setattr(comparison, "load_model", fake_load_model)
    monkeypatch.setattr(comparison, "make_inputs", fake_make_inputs)
    preset = sorted(PRESETS)[0]
    cmp = memkit.compare(preset, {"v": []}, seed=3, repeats=0, progress=False)
    assert loaded == [(preset, {"size": "tiny", "seed": 3})] * 2
    assert len(made) == 1 and isinstance(made[0][0], Toy) and made[0][1] == {"seed": 3}
    assert cmp.results["v"].passed is True
    made.clear()
    memkit.compare(Toy, {}, repeats=0, progress=False)  # the default seed is 0
    assert made[0][1] == {"seed": 0}


def test_the_progress_bar_names_the_runs_and_goes_away(capsys):
    run({"v": []}, progress=True)
    err = capsys.readouterr().err
    assert "compare" in err and "baseline" in err and "v" in err
    assert not err.endswith("\n")  # leave=False: the bar is cleared, not left on its own line
    run({"v": []}, progress=False)
    assert capsys.readouterr().err == ""


def test_variant_names_are_strings_in_the_order_given():
    cmp = run({2: [], "a": [], 1: []})
    assert list(cmp.results) == ["baseline", "2", "a", "1"]
    assert [r.name for r in cmp.results.values()] == ["baseline", "2", "a", "1"]
    assert list(cmp.table().index) == ["baseline", "2", "a", "1"]


def test_mode_and_step():
    cmp = run({"v": []}, mode="inference")
    assert cmp.mode == "inference" and cmp.results["v"].step == memkit.Step(mode="inference")
    assert cmp.tolerance == 1e-4 and cmp.baseline == "baseline"
    cmp = run({"v": []}, step=memkit.Step(mode="inference"))  # mode left at its default: the step decides
    assert cmp.mode == "inference"
    cmp = run({"v": []}, mode="inference", step=memkit.Step(mode="inference"), tolerance=0.5)
    assert cmp.mode == "inference" and cmp.tolerance == 0.5
    assert "max |Δgrad|" not in cmp.table().columns
    cmp = run({"v": []})
    assert cmp.mode == "training" and cmp.results["v"].step == memkit.Step()


# ---- errors ------------------------------------------------------------------------------------------------


def test_bad_arguments_are_named():
    with pytest.raises(TypeError) as e:
        memkit.compare(Toy, {}, step="adamw")
    assert message(e) == "step must be a memkit.Step or None, got str"
    with pytest.raises(ValueError) as e:
        memkit.compare(Toy, {}, mode="inference", step=memkit.Step())
    assert message(e) == "mode='inference' contradicts step.mode='training': give one of them"
    with pytest.raises(TypeError) as e:
        memkit.compare(Toy, [ShiftParam("a", 1.0)])
    assert message(e) == "variants must map a name to a list of optimizations, e.g. {'ckpt': [Checkpointing()]}"
    with pytest.raises(ValueError) as e:
        memkit.compare(Toy, {"baseline": []})
    assert message(e) == "variants must not be named 'baseline': that name is the unoptimized reference"
    with pytest.raises(ValueError) as e:
        memkit.compare(Toy, {"x": memkit.Variant(step=memkit.Step(mode="inference"))})
    assert message(e) == "every variant's step must be a training step, like the comparison's"
    with pytest.raises(ValueError) as e:
        memkit.compare(Toy, {"x": memkit.Variant(step=memkit.Step())}, mode="inference")
    assert message(e) == "every variant's step must be a inference step, like the comparison's"
    for bad in (0, -1.0, "1", None):
        with pytest.raises(ValueError) as e:
            memkit.compare(Toy, {}, tolerance=bad)
        assert message(e) == f"tolerance must be > 0, got {bad!r}"
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError) as e:
            memkit.compare(Toy, {}, repeats=bad)
        assert message(e) == f"repeats must be an int >= 0, got {bad!r}"
    with pytest.raises(ValueError) as e:
        memkit.compare("fluxx", {})
    assert message(e).startswith("unknown model 'fluxx': not a preset, a preset's hub id, a folder or a config.json")
    assert all(name in message(e) for name in PRESETS)
    with pytest.raises(TypeError) as e:
        memkit.compare(42, {})
    assert message(e) == f"model_fn must be a preset name ({sorted(PRESETS)}) or a callable returning a model"
    # small legal values pass the checks
    assert run({}, tolerance=0.5, repeats=0).tolerance == 0.5
    assert run({}, tolerance=2, repeats=1).tolerance == 2


def test_bad_variants_are_named():
    for value, kind in ((ShiftParam("a", 1.0), "ShiftParam"), ("ckpt", "str"), (b"ckpt", "bytes"), (3, "int")):
        with pytest.raises(TypeError) as e:
            memkit.compare(Toy, {7: value})
        assert message(e) == f"variants['7'] must be a memkit.Variant or a list of optimizations, got {kind}"
    with pytest.raises(TypeError) as e:
        memkit.Variant(step="sgd")
    assert message(e) == "step must be a memkit.Step or None, got str"
    with pytest.raises(TypeError) as e:
        memkit.Variant(check=1)
    assert message(e) == "check must be callable or None, got int"
    v = memkit.Variant(optimizations=[ShiftParam("a", 1.0)])
    assert isinstance(v.optimizations, tuple) and len(v.optimizations) == 1
    assert memkit.Variant().optimizations == () and memkit.Variant().step is None and memkit.Variant().check is None
    memkit.Variant(step=memkit.Step(), check=lambda m, h: {})  # legal values


class Many(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.full((2,), float(i))) for i in range(8)])

    def forward(self, x):
        return sum(p * x for p in self.ps)


class Freeze:
    def __init__(self, names):
        self.names = names

    def apply(self, model):
        for n in self.names:
            model.get_parameter(n).requires_grad_(False)
        return Handle(lambda: [model.get_parameter(n).requires_grad_(True) for n in self.names], name="freeze")


class Detach:
    """A broken optimization: the parameters still require grad, but the forward cuts them off the graph."""

    def __init__(self, names):
        self.names = names

    def apply(self, model):
        keep = [i for i in range(len(model.ps)) if f"ps.{i}" not in self.names]

        def forward(x):
            return sum((p if i in keep else p.detach()) * x for i, p in enumerate(model.ps))

        model.forward = forward
        return Handle(lambda: model.__dict__.pop("forward"), name="detach")


def test_gradients_missing_from_trained_parameters_are_an_error_naming_the_first_five():
    names = [f"ps.{i}" for i in (7, 1, 2, 6, 3, 4)]
    with pytest.raises(RuntimeError) as e:
        run({"detached": [Detach(names)]}, Many, inputs={"x": torch.ones(2)})
    first_five = sorted(names)[:5]
    assert message(e) == (
        f"variant 'detached' produced gradients for different parameters than the baseline: {first_five}"
    )


def test_frozen_parameters_must_end_the_update_as_they_began():
    # a variant that freezes parameters (LoRA freezes the base) is not compared on them with the trained baseline:
    # they get no gradient and must keep their initial values through the optimizer step
    names = ["ps.1", "ps.5"]
    cmp = run({"frozen": [Freeze(names)]}, Many, inputs={"x": torch.ones(2)}, step=memkit.Step(optimizer="sgd"))
    assert cmp.results["frozen"].passed and cmp.results["frozen"].max_abs_d_param == 0

    class Drift(Freeze):  # frozen, yet changed by the step (a write-back that ignores requires_grad)
        def apply(self, model):
            handle = super().apply(model)
            return Handle(
                handle.remove,
                name="drift",
                after_step=lambda: [model.get_parameter(n).data.add_(1.0) for n in self.names],
            )

    drift = run({"drift": [Drift(names)]}, Many, inputs={"x": torch.ones(2)}, step=memkit.Step(optimizer="sgd"))
    assert not drift.results["drift"].passed and drift.results["drift"].max_abs_d_param == 1.0


# ---- table, repr, figure -----------------------------------------------------------------------------------


def test_table_columns_and_values_come_from_each_variants_timeline():
    cmp = run({"owns": [Owns(1000), ShiftParam("b", 0.0)], "plain": []}, repeats=1)
    table = cmp.table()
    peaks = {n: r.timeline.peak_by_category() for n, r in cmp.results.items()}
    shown = [c for c in CATEGORIES if any(p[c] for p in peaks.values())]
    assert "ema" in shown and peaks["baseline"]["ema"] == 0  # shown because one variant has it
    assert [c for c in CATEGORIES if c not in shown]  # categories nobody uses are left out
    assert list(table.columns) == [
        "optimizations",
        "peak (MiB)",
        "peak vs baseline",
        *[f"{c} (MiB)" for c in shown],
        "peak phase",
        "step (s)",
        "time vs baseline",
        "max |Δoutput|",
        "max |Δgrad|",
        "pass",
    ]
    assert table.index.name == "variant" and list(table.index) == ["baseline", "owns", "plain"]
    assert table["optimizations"].tolist() == ["-", "owns, shift(b)", "-"]
    base_peak = cmp.results["baseline"].timeline.peak_bytes
    for name, r in cmp.results.items():
        tl = r.timeline
        assert table.loc[name, "peak (MiB)"] == tl.peak_bytes / 2**20
        assert table.loc[name, "peak vs baseline"] == tl.peak_bytes / base_peak
        for c in shown:
            assert table.loc[name, f"{c} (MiB)"] == peaks[name][c] / 2**20
        assert table.loc[name, "peak phase"] == tl.peak_phase
        assert table.loc[name, "step (s)"] == r.seconds
        assert table.loc[name, "time vs baseline"] == r.seconds / cmp.results["baseline"].seconds
    assert table.loc["owns", "peak vs baseline"] > 1
    kib = cmp.table(unit="KiB")
    assert kib.loc["owns", "peak (KiB)"] == cmp.results["owns"].timeline.peak_bytes / 1024
    assert kib.loc["owns", "ema (KiB)"] == 4000 / 1024
    with pytest.raises(ValueError, match="unit must be one of"):
        cmp.table(unit="MB")


def test_table_check_columns_in_order_of_appearance_and_nan_where_missing():
    cmp = run(
        {
            "v1": memkit.Variant(check=lambda m, h: {"x": 0.0, "y": 1e-6}),
            "v2": memkit.Variant(check=lambda m, h: {"z": 0.0, "x": 2e-6}),
        },
        step=memkit.Step(mode="inference"),
    )
    table = cmp.table()
    assert list(table.columns)[-5:] == ["max |Δoutput|", "x", "y", "z", "pass"]
    assert table.loc["v1", "y"] == 1e-6 and table.loc["v2", "x"] == 2e-6
    assert math.isnan(table.loc["v1", "z"]) and math.isnan(table.loc["baseline", "x"])


def tl(peak=0, **baseline):
    """A timeline with ``baseline`` bytes by category and one activation of ``peak`` bytes (freed again)."""
    cols = {
        "time": [0.0, 1.0],
        "action": [0, 1],
        "bytes": [peak, peak],
        "category": [CATEGORIES.index("activation")] * 2,
        "phase": [1, 1],
        "device": [0, 0],
        "storage": [1, 1],
    }
    return Timeline({k: np.array(v) for k, v in cols.items()}, baseline_by_category=baseline, devices=["cpu"])


def result(name, timeline, seconds, **kw):
    return comparison.VariantResult(name, timeline=timeline, seconds=seconds, **kw)


def test_table_time_vs_baseline_needs_a_positive_baseline_time_and_delta_param_needs_an_optimizer():
    t = tl(parameter=1024)
    results = {"baseline": result("baseline", t, 0.0), "v": result("v", t, 2.0)}
    table = comparison.Comparison(results=results, mode="training", tolerance=1e-4).table()
    assert math.isnan(table.loc["v", "time vs baseline"]) and math.isnan(table.loc["baseline", "time vs baseline"])
    assert "max |Δparam|" not in table.columns  # no step at all
    results = {"baseline": result("baseline", t, 2.0), "v": result("v", t, 3.0, step=memkit.Step())}
    table = comparison.Comparison(results=results, mode="training", tolerance=1e-4).table()
    assert table.loc["v", "time vs baseline"] == 1.5
    assert "max |Δparam|" not in table.columns  # a step without an optimizer
    results["v"].step = memkit.Step(optimizer="adam")
    results["v"].max_abs_d_param = 0.5
    table = comparison.Comparison(results=results, mode="inference", tolerance=1e-4).table()
    assert table["max |Δparam|"].tolist() == [0.0, 0.5] and "max |Δgrad|" not in table.columns


def test_from_timelines_rules():
    plain, more = tl(peak=4096, parameter=1024), tl(peak=1024, parameter=1024, ema=2048)
    cmp = memkit.Comparison.from_timelines({"plain": plain, "more": more})
    assert cmp.baseline == "plain" and cmp.mode == "training" and math.isnan(cmp.tolerance)
    assert list(cmp.results) == ["plain", "more"]
    assert all(r.measured is False and r.timeline is {"plain": plain, "more": more}[n] for n, r in cmp.results.items())
    assert [r.name for r in cmp.results.values()] == ["plain", "more"]
    table = cmp.table(unit="KiB")
    assert list(table.columns) == [
        "optimizations",
        "peak (KiB)",
        "peak vs baseline",
        "parameter (KiB)",
        "ema (KiB)",
        "activation (KiB)",
        "peak phase",
    ]
    assert table["peak (KiB)"].tolist() == [5.0, 4.0]
    assert table["peak vs baseline"].tolist() == [1.0, 4 / 5]
    assert table["ema (KiB)"].tolist() == [0.0, 2.0] and table["activation (KiB)"].tolist() == [4.0, 1.0]
    assert table["peak phase"].tolist() == ["backward", "backward"]
    # another baseline goes first; the others keep their order
    three = {"a": plain, "b": more, "c": plain}
    cmp = memkit.Comparison.from_timelines(three, baseline="b", mode="inference")
    assert list(cmp.results) == ["b", "a", "c"] and cmp.baseline == "b" and cmp.mode == "inference"
    assert cmp.table()["peak vs baseline"].tolist() == [1.0, 5 / 4, 5 / 4]
    with pytest.raises(ValueError) as e:
        memkit.Comparison.from_timelines({})
    assert message(e) == "timelines must map at least one name to a Timeline"
    with pytest.raises(ValueError) as e:
        memkit.Comparison.from_timelines({"a": plain}, baseline="b")
    assert message(e) == "baseline must be one of ['a'], got 'b'"
    with pytest.raises(TypeError) as e:
        memkit.Comparison.from_timelines({"a": plain, "x": 1})
    assert message(e) == "timelines['x'] must be a Timeline, got int"


def test_repr_html_and_figure():
    cmp = run({"v": [Owns(256)]}, mode="inference")
    assert repr(cmp) == "Comparison(mode='inference', variants=['baseline', 'v'])"
    assert cmp._repr_html_() == cmp.table()._repr_html_()
    pd.testing.assert_frame_equal(cmp.table(), cmp.table("MiB"))
    fig = cmp.figure(unit="KiB")
    assert fig.layout.yaxis.title.text == "KiB"
    assert fig.layout.title.text == "Memory: 'baseline' vs variants (inference)"
    bars = {trace.name: list(trace.y) for trace in fig.data if trace.type == "bar"}
    assert bars["ema"] == [0.0, 1024 / 1024]
    assert cmp.figure().layout.yaxis.title.text == "MiB"
    fig = memkit.Comparison.from_timelines({"p": tl(parameter=2048)}).figure(unit="KiB")
    assert fig.layout.title.text == "Memory: 'p' vs variants (training)"


def test_defaults_time_three_steps_and_show_progress(capsys):
    models = []

    def model_fn():
        models.append(Toy())
        return models[-1]

    cmp = memkit.compare(model_fn, {"v": []}, inputs=X)
    assert [m.calls for m in models] == [3 + 2, 3 + 2]
    assert cmp.mode == "training" and cmp.tolerance == 1e-4
    assert "compare" in capsys.readouterr().err


def test_a_model_fn_returning_one_model_starts_each_run_without_the_last_ones_gradients():
    shared = Toy()
    # the baseline's tracked step leaves its gradients on the model; the variant freezes `a`, so it must see no
    # gradient for `a` at all (not the baseline's, nor zeros): a leftover one would be an error naming it
    cmp = run({"frozen": [Freeze(["a"])]}, lambda: shared)
    assert cmp.results["frozen"].passed


def test_table_differences_are_those_plain_torch_finds():
    base_out, base_grads = training_grads(Toy(), X)
    shifted = Toy(b=tuple(v + DELTA for v in Toy().b.tolist()))
    out, grads = training_grads(shifted, X)
    d_out = (out - base_out).abs().max().item()
    d_grad = max((grads[n] - base_grads[n]).abs().max().item() for n in grads if grads[n].numel())
    assert d_out > 0 and d_grad > 0
    cmp = run({"shift": [ShiftParam("b", DELTA)], "grad": [ShiftGrad("a", 2 * DELTA)]}, tolerance=1.0)
    table = cmp.table()
    assert table["max |Δoutput|"].tolist() == [0.0, d_out, 0.0]
    assert table["max |Δgrad|"].tolist() == [0.0, d_grad, 2 * DELTA]
    assert table["pass"].tolist() == [True, True, True]


class SeesGrads(Toy):
    """A Toy that records, at each forward, whether ``a`` already holds a gradient (and which tensor)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(self.a.grad)
        return super().forward(x)


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_every_timed_step_starts_without_gradients_like_the_tracked_one(optimizer):
    # Without an optimizer gradients accumulate across steps (train_step's contract): the timed steps must each
    # start from none, freed (not zeroed in place), so each times a step that allocates its gradients.
    models = []

    def model_fn():
        models.append(SeesGrads())
        return models[-1]

    run({"v": []}, model_fn, repeats=3, step=memkit.Step(optimizer=optimizer))
    for m in models:
        # the compared step, 3 timed ones, the tracked one
        assert m.seen == [None] * 5
        assert m.a.grad is None if optimizer else m.a.grad is not None  # an update frees them after the step


def test_the_progress_bar_is_labelled_compare(capsys):
    run({"v": []}, progress=True)
    err = capsys.readouterr().err
    # tqdm writes "<desc>: <percent>|..." at the start of each redraw ("\r" before each)
    drawn = [s for s in err.split("\r") if s.strip()]
    assert drawn and all(s.startswith("compare: ") for s in drawn), drawn
