import pytest
import torch
from _cpu_estimate import estimate_cpu

import memkit
from memkit.handle import Handle

pytestmark = (
    pytest.mark.slow
)  # compare() on the tiny presets; test_comparison_fast.py holds the same invariants on toy models


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
        {"checkpointing": [memkit.Checkpointing(pattern="all")]},
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
    assert table.loc["checkpointing", "peak vs baseline"] == ckpt.peak_bytes / base.peak_bytes < 1.0


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
    plain = estimate_cpu("flux", size="tiny", height=128, width=128)
    ckpt = estimate_cpu("flux", size="tiny", height=128, width=128, optimizations=[memkit.Checkpointing()])
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


class Toy(torch.nn.Module):
    """out = x @ W.T + b with every output of magnitude about ``scale``."""

    def __init__(self, scale):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(0.0)
            self.lin.bias.copy_(torch.linspace(-scale, scale, 4))

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("scale", [0.25, 8.0])
def test_tolerance_is_relative_to_the_larger_of_one_and_the_baseline_magnitude(scale):
    # The rule: pass when max|Δ| <= tolerance * max(1, max|baseline|), for the output and each gradient.
    # Inference compares the output only; the perturbation moves every output by exactly delta.
    delta = 2.0**-10
    allowed = max(1.0, scale)
    for tolerance, expected in ((delta / allowed * 1.01, True), (delta / allowed * 0.99, False)):
        cmp = memkit.compare(
            lambda: Toy(scale),
            {"shift": [Perturb(delta)]},
            mode="inference",
            inputs={"x": torch.ones(1, 4)},
            tolerance=tolerance,
            repeats=0,
            progress=False,
        )
        result = cmp.results["shift"]
        assert result.max_abs_d_output == delta
        assert result.passed is expected, (scale, tolerance)


class OwnsMemory:
    """Allocates a buffer in apply (like EMA shadows) and declares it through the handle."""

    def __init__(self, numel, category="ema"):
        self.numel, self.category = numel, category

    def apply(self, model):
        buffer = torch.zeros(self.numel)
        return Handle(lambda: None, name="owns", owned={self.category: [buffer]})


def test_memory_a_handle_owns_is_counted_in_its_category():
    cmp = memkit.compare("dit", {"owns": [OwnsMemory(1000)]}, repeats=0, progress=False)
    base, owns = cmp.results["baseline"].timeline, cmp.results["owns"].timeline
    assert owns.baseline_by_category["ema"] == 4000 and base.baseline_by_category["ema"] == 0
    assert owns.peak_by_category()["ema"] == 4000
    assert owns.peak_bytes - base.peak_bytes == 4000
    assert cmp.table().loc["owns", "ema (MiB)"] == 4000 / 2**20


def test_a_variant_carries_its_own_step_and_check():
    calls = []

    def check(model, handle):
        calls.append(handle.name)
        return {"shadow |Δ|": 0.0, "other |Δ|": 1.0}

    variants = {
        "checked": memkit.Variant(optimizations=[memkit.Checkpointing()], check=check),
        "sgd": memkit.Variant(step=memkit.Step(optimizer="sgd")),
        "short": [memkit.Checkpointing()],  # the short form
    }
    cmp = memkit.compare("flux", variants, repeats=0, progress=False, tolerance=1e-6)
    table = cmp.table()
    assert calls == ["checkpointing:all"]
    assert table.loc["checked", "shadow |Δ|"] == 0.0 and table.loc["checked", "other |Δ|"] == 1.0
    assert not table.loc["checked", "pass"]  # a check over the tolerance fails the variant
    assert table.loc["short", "pass"]
    assert cmp.results["sgd"].step.optimizer == "sgd"
    # The baseline took no update: the SGD variant's parameters moved, its output and gradients did not.
    assert table.loc["sgd", "max |Δoutput|"] == 0.0 and table.loc["sgd", "max |Δgrad|"] == 0.0
    assert table.loc["sgd", "max |Δparam|"] > 0 and not table.loc["sgd", "pass"]


def test_with_an_optimizer_parameters_after_the_update_are_compared():
    step = memkit.Step(optimizer="adamw")
    cmp = memkit.compare(
        "dit", {"ckpt": [memkit.Checkpointing()], "wrong": [Perturb(1e-2)]}, step=step, repeats=1, progress=False
    )
    table = cmp.table()
    assert table.loc["ckpt", "max |Δparam|"] == 0.0 and table.loc["ckpt", "pass"]
    assert table.loc["wrong", "max |Δparam|"] > 0 and not table.loc["wrong", "pass"]
    # the tracked step is a steady one: AdamW's state exists before it starts
    assert cmp.results["ckpt"].timeline.baseline_by_category["optimizer_state"] > 0


def test_variant_and_step_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"variants\['x'\] must be a memkit.Variant or a list"):
        memkit.compare("flux", {"x": memkit.Checkpointing()})
    with pytest.raises(TypeError, match="step must be a memkit.Step"):
        memkit.compare("flux", {}, step="adamw")
    with pytest.raises(ValueError, match="every variant's step must be a training step"):
        memkit.compare("flux", {"x": memkit.Variant(step=memkit.Step(mode="inference"))})
    with pytest.raises(TypeError, match="check must be callable"):
        memkit.Variant(check=1)
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        memkit.compare("flux", {}, tolerance=0)
    with pytest.raises(ValueError, match=r"unknown model 'fluxx'.*did you mean flux\b"):
        memkit.compare("fluxx", {})


def test_compare_takes_a_preset_by_its_hub_id_and_refuses_a_config(tmp_path):
    import json

    cmp = memkit.compare("facebook/DiT-XL-2-256", {}, repeats=0, progress=False)  # the dit preset, tiny, offline
    tiny_dit = sum(p.numel() * 4 for p in memkit.load_model("dit").parameters())  # fp32 bytes
    assert cmp.results["baseline"].timeline.baseline_by_category["parameter"] == tiny_dit
    config = {"_class_name": "DiTTransformer2DModel", **memkit.PRESETS["dit"].configs["tiny"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="compare runs real tensors, and a config has one size"):
        memkit.compare(str(tmp_path / "config.json"), {})
