"""The budget solver: the fewest checkpointed blocks whose estimated peak fits, checked against a real step."""

import pytest
import torch

import memkit
from memkit.optimizations.checkpoint_plan import spread

# LTX-Video small (8 blocks) at 33 frames: activations set the peak of a step without an optimizer.
PRESET, SIZES = "ltx-video", {"size": "small", "frames": 33, "optimizer": None}


def _estimated(config) -> int:
    return memkit.estimate(PRESET, optimizations=[config], **SIZES).peak_bytes


def test_the_chosen_pattern_fits_and_its_real_peak_is_the_prediction():
    none, every = _estimated(memkit.Checkpointing(pattern="none")), _estimated(memkit.Checkpointing())
    budget = (none + every) // 2
    plan = memkit.plan_checkpointing(PRESET, budget, **SIZES)
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
