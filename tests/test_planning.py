"""The budget solver: the fewest checkpointed blocks whose estimated peak fits, checked against a real step."""

import math
from types import SimpleNamespace

import pytest
import torch
from _cpu_estimate import CPU_STEP, estimate_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

import memkit
from memkit.planning import spread

# LTX-Video small (8 blocks) at 33 frames: activations set the peak of a step without an optimizer.
PRESET, SIZES = "ltx-video", {"size": "small", "frames": 33, "optimizer": None}


def _estimated(config) -> int:
    return estimate_cpu(PRESET, optimizations=[config], **SIZES).peak_bytes


@pytest.mark.slow
def test_the_chosen_pattern_fits_and_its_real_peak_is_the_prediction():
    none, every = _estimated(memkit.Checkpointing(pattern="none")), _estimated(memkit.Checkpointing())
    budget = (none + every) // 2
    plan = memkit.plan_checkpointing(PRESET, budget, **SIZES, **CPU_STEP, steps=1)  # the real step below
    assert plan.fits and plan.blocks == 8 and 0 < plan.checkpointed < 8
    assert plan.config.pattern == spread(plan.checkpointed, 8)
    # the least recompute: one block fewer, spread the same way, does not fit
    fewer = memkit.Checkpointing(pattern=spread(plan.checkpointed - 1, 8) or "none")
    assert _estimated(fewer) > budget
    # a real step with the chosen pattern: at most the budget, within 10% of the prediction
    model = memkit.load_model(PRESET, size="small")
    inputs = memkit.make_inputs(model, frames=33)
    with plan.config.apply(model), memkit.track(model, inputs=inputs) as tl:
        memkit.train_step(model, inputs)
    assert tl.peak_bytes <= budget
    assert abs(tl.peak_bytes - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes
    # every candidate tried is on record, none and all first
    assert [k for k, _ in plan.tried[:2]] == [0, 8] and len(plan.tried) <= 2 + 3
    assert dict(plan.tried)[plan.checkpointed] == plan.predicted_peak_bytes


def test_a_budget_above_the_plain_peak_checkpoints_nothing_and_one_below_all_says_so():
    plan = memkit.plan_checkpointing("flux", 2**40, size="tiny")
    assert plan.config.pattern == "none" and plan.checkpointed == 0 and plan.fits and len(plan.tried) == 1
    plan = memkit.plan_checkpointing("flux", 1024, size="tiny", provider="selective")
    assert plan.config == memkit.Checkpointing(pattern="all", provider="selective")
    assert not plan.fits and plan.predicted_peak_bytes > 1024 and "does NOT fit" in str(plan)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=2, max_size=60), st.integers(0, 10**6), st.booleans())
def test_the_search_finds_the_fewest_blocks_that_fit_in_few_estimates(drops, budget, preset):
    # any peak that does not grow with the blocks checkpointed (n + 1 values), a callable or a preset's count
    n = len(drops) - 1
    peaks = [10**8 - sum(drops[:k]) for k in range(n + 1)]
    budget = peaks[-1] + budget - 2 * 10**5  # below all, between, above none
    asked = []

    def estimate(model, inputs, *, optimizations, **kwargs):
        (config,) = optimizations
        if callable(config.pattern):
            return SimpleNamespace(peak_bytes=peaks[sum(config.pattern(i, None) for i in range(n))])
        k = {"none": 0, "all": n}.get(config.pattern) if isinstance(config.pattern, str) else len(config.pattern)
        asked.append(k)
        return SimpleNamespace(peak_bytes=peaks[k])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memkit.estimation, "estimate", estimate)
        mp.setattr(memkit.planning, "_preset_blocks", lambda model, size: n if preset else None)
        plan = memkit.plan_checkpointing(lambda: None, budget)
    fitting = [k for k in range(n + 1) if peaks[k] <= budget]
    assert plan.checkpointed == (fitting[0] if fitting else n) and plan.blocks == n
    assert plan.fits == bool(fitting) and plan.predicted_peak_bytes == peaks[plan.checkpointed]
    assert len(set(asked)) == len(asked) and len(plan.tried) <= 2 + 4 + math.ceil(math.log2(n))
    if len(set(drops[:-1])) == 1 and fitting and 0 < fitting[0] < n:  # every block drops the same: two guesses
        assert len(plan.tried) <= 2 + 2


def test_spread_and_errors():
    assert spread(3, 12) == (0, 4, 8) and spread(12, 12) == tuple(range(12)) and spread(0, 5) == ()
    assert spread(4, 6) == (0, 1, 3, 4) and len(set(spread(5, 7))) == 5
    with pytest.raises(ValueError, match="k must be between 0 and n=4"):
        spread(5, 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
            memkit.plan_checkpointing("flux", bad, size="tiny")
    with pytest.raises(ValueError, match="provider must be one of"):
        memkit.plan_checkpointing("flux", 2**30, size="tiny", provider="moon")


def test_the_model_needs_blocks():
    with pytest.raises(ValueError, match="no nn.ModuleList of blocks"):
        memkit.plan_checkpointing(lambda: torch.nn.Linear(4, 4), 2**20, inputs=lambda m: {"input": torch.ones(2, 4)})


def _tiny_budget(estimate=estimate_cpu) -> int:
    """Half way between no checkpointing and all blocks, on tiny LTX-Video at 97 frames (2 blocks)."""
    kw = {"size": "tiny", "frames": 97}
    none = estimate(PRESET, optimizations=[memkit.Checkpointing(pattern="none")], **kw).peak_bytes
    every = estimate(PRESET, optimizations=[memkit.Checkpointing()], **kw).peak_bytes
    assert every < none
    return (none + every) // 2


@pytest.mark.slow
def test_checkpointing_with_a_budget_plans_for_the_estimate_it_is_given_to():
    budget = _tiny_budget()
    config = memkit.Checkpointing(budget_bytes=budget, provider="selective")
    assert config.pattern == "auto" and str(config).startswith("checkpointing:auto<=")
    kw = {"size": "tiny", "frames": 97}
    tl = estimate_cpu(PRESET, optimizations=[config], **kw)
    plan = memkit.plan_checkpointing(PRESET, budget, provider="selective", **kw, **CPU_STEP, optimizer=None, steps=1)
    assert tl.meta["optimizations"] == [str(plan.config)] and tl.meta["checkpoint_plans"] == [str(plan)]
    assert tl.peak_bytes == plan.predicted_peak_bytes <= budget
    # other sizes, another plan: the budget is planned for the very step estimated
    bigger = estimate_cpu(PRESET, optimizations=[config], size="tiny", frames=129)
    assert bigger.meta["checkpoint_plans"] != tl.meta["checkpoint_plans"]


@pytest.mark.slow
def test_apply_with_a_budget_plans_on_a_fake_copy_of_the_model_and_remove_restores_it():
    # apply() plans for the model's dtype and device, and the library's step: AdamW, first and steady step
    budget = _tiny_budget(lambda *a, **k: memkit.estimate(*a, **k, **CPU_STEP))
    model = memkit.load_model(PRESET)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = memkit.Checkpointing(budget_bytes=budget)
    plan = config.plan(model, frames=97)
    assert plan.fits and 0 < plan.checkpointed < plan.blocks
    inputs = memkit.make_inputs(model, frames=97)
    # apply() plans for make_inputs' default inputs (and this model's dtype, on the CPU)
    default = config.plan(model)
    with config.apply(model) as handle, memkit.track(model, inputs=inputs) as tl:
        assert handle.name == str(default.config)
        assert [c for _, c in config.select(model)] == [c for _, c in default.config.select(model)]
        memkit.train_step(model, inputs)
    assert tl.peak_bytes > 0
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.warns(UserWarning, match="does NOT fit"), memkit.Checkpointing(budget_bytes=1).apply(model) as h:
        assert h.name == "checkpointing:all"


def test_budget_errors_name_the_argument():
    with pytest.raises(ValueError, match="give a pattern or budget_bytes, not both"):
        memkit.Checkpointing(pattern="every:2", budget_bytes=2**30)
    with pytest.raises(ValueError, match="pattern='auto' needs budget_bytes="):
        memkit.Checkpointing(pattern="auto")
    for bad in (0, -5, 1.5, True, "1GiB"):
        with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
            memkit.Checkpointing(budget_bytes=bad)
    with pytest.raises(ValueError, match="provider must be one of"):
        memkit.Checkpointing(budget_bytes=2**30, provider="moon")
    with pytest.raises(ValueError, match="plan\\(\\) needs budget_bytes"):
        memkit.Checkpointing().plan(memkit.load_model(PRESET))
    stack = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    with pytest.raises(TypeError, match="memkit.plan_checkpointing"):
        memkit.Checkpointing(budget_bytes=2**30).apply(stack)


def test_the_old_import_path_works_with_a_deprecation_warning():
    import importlib
    import sys

    sys.modules.pop("memkit.optimizations.checkpoint_plan", None)
    with pytest.warns(DeprecationWarning, match="moved to memkit.planning"):
        old = importlib.import_module("memkit.optimizations.checkpoint_plan")
    assert old.plan_checkpointing is memkit.plan_checkpointing and old.spread is spread
    assert memkit.CheckpointPlan is old.CheckpointPlan
