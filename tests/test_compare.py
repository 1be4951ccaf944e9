import pytest
import torch

import memkit
from memkit.handle import Handle


class Perturb:
    """A deliberately wrong optimization: adds a constant to the last parameter (the output bias) while applied."""

    def __init__(self, delta):
        self.delta = delta

    def apply(self, model):
        p = list(model.parameters())[-1]
        with torch.no_grad():
            p.add_(self.delta)

        def undo():
            with torch.no_grad():
                p.sub_(self.delta)

        return Handle(undo, name=f"perturb({self.delta})")


def test_checkpointing_passes_and_lowers_the_peak():
    cmp = memkit.compare(
        "flux",
        {"checkpointing": [memkit.Checkpointing("all")]},
        inputs=lambda m: memkit.make_inputs(m, height=128, width=128),
        repeats=1,
        progress=False,
    )
    table = cmp.table()
    assert list(table.index) == ["baseline", "checkpointing"]
    assert table["pass"].all()
    assert table.loc["checkpointing", "max |Δgrad|"] == 0.0
    base, ckpt = cmp.results["baseline"].timeline, cmp.results["checkpointing"].timeline
    assert table.loc["checkpointing", "peak (MiB)"] == ckpt.peak_bytes / 2**20
    assert ckpt.peak_bytes < base.peak_bytes
    assert table.loc["baseline", "peak vs baseline"] == 1.0


def test_a_wrong_variant_fails_and_the_difference_is_reported():
    cmp = memkit.compare("dit", {"wrong": [Perturb(0.5)]}, repeats=0, progress=False)
    row = cmp.table().loc["wrong"]
    assert not row["pass"]
    assert row["max |Δoutput|"] > 0 and row["max |Δgrad|"] > 0


def test_inference_mode_has_no_gradient_column():
    cmp = memkit.compare("sd3", {"ckpt": [memkit.Checkpointing()]}, mode="inference", repeats=0, progress=False)
    table = cmp.table()
    assert "max |Δgrad|" not in table.columns and table["pass"].all()
    assert table.loc["ckpt", "max |Δoutput|"] == 0.0


def test_same_weights_for_every_variant_even_if_model_fn_is_not_deterministic():
    calls = []

    def model_fn():
        calls.append(1)
        return memkit.load_model("pixart", seed=len(calls))  # a different seed each call

    cmp = memkit.compare(model_fn, {"same": []}, repeats=0, progress=False)
    assert cmp.table().loc["same", "max |Δoutput|"] == 0.0 and len(calls) == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be"):
        memkit.compare("flux", {}, mode="train")
    with pytest.raises(ValueError, match="must not be named 'baseline'"):
        memkit.compare("flux", {"baseline": []})
    with pytest.raises(TypeError, match="variants must map"):
        memkit.compare("flux", [memkit.Checkpointing()])
    with pytest.raises(ValueError, match="unit must be one of"):
        memkit.compare("flux", {}, repeats=0, progress=False).table(unit="MB")


def test_random_ops_in_the_forward_draw_the_same_numbers_for_every_variant():
    # DiT drops class labels at random in training mode; a variant that changes nothing must still pass.
    for _ in range(3):
        batch = lambda m: memkit.make_inputs(m, batch_size=8)  # noqa: E731 - 8 labels: a stray drop is likely
        cmp = memkit.compare("dit", {"same": []}, inputs=batch, repeats=0, progress=False)
        row = cmp.table().loc["same"]
        assert row["pass"] and row["max |Δoutput|"] == 0.0 and row["max |Δgrad|"] == 0.0


def test_from_timelines_puts_estimates_side_by_side():
    plain = memkit.estimate("flux", size="tiny", height=128, width=128)
    ckpt = memkit.estimate("flux", size="tiny", height=128, width=128, optimizations=[memkit.Checkpointing()])
    cmp = memkit.Comparison.from_timelines({"checkpointing": ckpt, "plain": plain}, baseline="plain")
    table = cmp.table()
    assert list(table.index) == ["plain", "checkpointing"]
    assert "pass" not in table.columns and "step (s)" not in table.columns
    assert table.loc["checkpointing", "peak (MiB)"] == ckpt.peak_bytes / 2**20
    assert table.loc["plain", "peak phase"] == plain.peak_phase
    assert len(cmp.figure().data) > 0
    with pytest.raises(ValueError, match="baseline must be one of"):
        memkit.Comparison.from_timelines({"a": plain}, baseline="b")
    with pytest.raises(TypeError, match=r"timelines\['a'\] must be a Timeline"):
        memkit.Comparison.from_timelines({"a": 1})
