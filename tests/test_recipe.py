"""The training recipe's options of :class:`memkit.Step` (``grad_accum``...): each estimate is held against real CPU
steps tracked one by one, to the byte, on models where the option changes the peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from oracles import Wide, real_steps
from oracles import wide_inputs as inputs

import memkit
from memkit.step import model_output

README = Path(__file__).resolve().parents[1] / "README.md"


def estimate_cpu(model_fn=Wide, inputs_fn=inputs, **kwargs) -> memkit.Timeline:
    return memkit.estimate(model_fn, inputs_fn, device="cpu", dtype=torch.float32, **kwargs)


# ---- gradient accumulation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_grad_accum_estimate_equals_real_steps_to_the_byte(n):
    first, steady = real_steps(2, grad_accum=n)
    tl = estimate_cpu(grad_accum=n)
    assert tl.meta["grad_accum"] == n
    assert tl.meta["first_step_peak_bytes"] == first.peak_bytes
    assert tl.meta["steady_peak_bytes"] == steady.peak_bytes
    assert tl.peak_bytes == max(first.peak_bytes, steady.peak_bytes)


def test_grad_accum_keeps_the_first_micro_batch_s_gradients_through_the_next():
    weights = sum(p.numel() * 4 for p in Wide().parameters())
    one, two, three = (real_steps(2, grad_accum=n)[1] for n in (1, 2, 3))
    # the second micro-batch's backward begins beside a full set of gradients that the first has not made yet (and
    # the first one's 4-byte loss, summed into the step's)
    assert two.peak_bytes - one.peak_bytes == weights + 4
    assert three.peak_bytes == two.peak_bytes  # a third micro-batch repeats the second
    assert two.peak_by_category()["gradient"] == weights


def test_a_step_that_zeroes_the_gradients_between_micro_batches_is_told_apart():
    # the one-line mutant of the step: zero_grad(set_to_none=True) after each micro-batch's backward frees the
    # gradients the next one would accumulate into; its real peak is not the estimate's
    torch.manual_seed(0)
    model, x = Wide(), inputs(None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = []
    for _ in range(2):
        with memkit.track(model, optimizer=opt, inputs=x) as tl:
            for _ in range(2):
                loss = model_output(model(**x)).float().pow(2).mean() / 2
                loss.backward()
                del loss
                if _ == 0:
                    opt.zero_grad(set_to_none=True)  # the mutation
            opt.step()
            opt.zero_grad(set_to_none=True)
        peaks.append(tl.peak_bytes)
    tl = estimate_cpu(grad_accum=2)
    assert peaks[1] != tl.meta["steady_peak_bytes"]
    assert peaks[1] == estimate_cpu(grad_accum=1).meta["steady_peak_bytes"]


def test_grad_accum_gradients_are_the_mean_over_micro_batches():
    torch.manual_seed(0)
    model, x = Wide(width=16, depth=2), {"x": torch.randn(8, 16)}
    seen = {}
    for n in (1, 3):
        memkit.Step(grad_accum=n).bind(model).run(x)  # no optimizer: the gradients stay
        seen[n] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    for a, b in zip(seen[1], seen[3], strict=True):
        torch.testing.assert_close(a, b)
    loss = memkit.Step(grad_accum=3).bind(model).run(x)
    torch.testing.assert_close(loss, model(**x).float().pow(2).mean().detach())


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_bad_grad_accum_names_the_argument(value):
    with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
        memkit.Step(grad_accum=value)
    with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
        memkit.estimate("dit", size="tiny", grad_accum=value)


def test_grad_accum_is_training_only_and_not_given_twice():
    with pytest.raises(ValueError, match="grad_accum is only used in training"):
        memkit.Step(mode="inference", grad_accum=2)
    with pytest.raises(ValueError, match="give either step or mode/optimizer/steps/grad_accum"):
        memkit.estimate("dit", size="tiny", step=memkit.Step(), grad_accum=2)
    assert str(memkit.Step(optimizer="adamw", grad_accum=4)) == "training (adamw, 4 micro-batches)"
    assert str(memkit.Step(optimizer="adamw")) == "training (adamw)"


def test_grad_accum_is_part_of_the_cache_key():
    memkit.estimation.clear_cache()
    one = memkit.estimate("dit", size="tiny")
    two = memkit.estimate("dit", size="tiny", grad_accum=2)
    assert not two.meta["cached"] and len(two) > len(one)
    assert memkit.estimate("dit", size="tiny", step=memkit.Step(optimizer="adamw", grad_accum=2)).meta["cached"]


def test_the_command_line_takes_grad_accum(capsys):
    from memkit.cli import main

    assert main(["estimate", "dit", "--size", "tiny", "--grad-accum", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["grad_accum"] == 2
    assert result["peak_bytes"] == memkit.estimate("dit", size="tiny", grad_accum=2).peak_bytes
    assert main(["estimate", "dit", "--size", "tiny", "--grad-accum", "0"]) == 2
    assert "--grad-accum takes an int >= 1" in capsys.readouterr().err
    assert main(["estimate", "dit", "--size", "tiny", "--inference", "--grad-accum", "2"]) == 2
    assert "--grad-accum applies to training only" in capsys.readouterr().err


# ---- mixed precision ------------------------------------------------------------------------------------------


class Shared(torch.nn.Module):
    """One weight used twice in the forward: autocast casts it once and keeps the bf16 copy in its cast cache until
    the forward ends; the backward keeps the copy (saved by both matmuls) until its own backward."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.shared = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.out(torch.relu(self.shared(torch.relu(self.shared(x)))))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("model_fn", [Wide, Shared], ids=["wide", "shared"])
def test_mixed_precision_estimate_equals_real_steps_to_the_byte(precision, model_fn):
    first, steady = real_steps(2, model_fn, mixed_precision=precision)
    tl = estimate_cpu(model_fn, mixed_precision=precision)
    assert (tl.meta["mixed_precision"], tl.meta["dtype"]) == (precision, "float32")
    assert tl.meta["first_step_peak_bytes"] == first.peak_bytes
    assert tl.meta["steady_peak_bytes"] == steady.peak_bytes


def test_mixed_precision_with_grad_accum_equals_real_steps():
    first, steady = real_steps(2, Shared, mixed_precision="fp16", grad_accum=2)
    tl = estimate_cpu(Shared, mixed_precision="fp16", grad_accum=2)
    assert (tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"]) == (first.peak_bytes, steady.peak_bytes)


def test_the_cast_cache_is_in_the_tracked_memory():
    # the bf16 copy of the shared weight is made once (the cache), not per use, and is alive until the forward ends
    torch.manual_seed(0)
    model, x = Shared(), {"x": torch.ones(512, 256)}
    runner = memkit.Step(mixed_precision="bf16").bind(model)
    with memkit.track(inputs=x, **runner.tracked_objects()) as tl:
        runner.run(x)
    casts = [
        (op, n)
        for op, n, action in zip(tl.column("op"), tl.column("bytes"), tl.column("action"), strict=True)
        if tl.ops[op].startswith("aten._to_copy") and action == 0
    ]
    weights = {p.numel() * 2 for p in model.parameters()}  # bf16 copies: 2 bytes per element
    copies = [n for _, n in casts if n in weights]
    assert sorted(copies) == sorted(p.numel() * 2 for p in model.parameters())  # each parameter cast once


@pytest.mark.slow
def test_mixed_precision_on_a_tiny_preset_equals_real_steps():
    def model_fn():
        return memkit.load_model("flux", size="tiny", dtype=torch.float32)

    for precision in ("bf16", "fp16"):
        first, steady = real_steps(2, model_fn, lambda m: memkit.make_inputs(m), mixed_precision=precision)
        tl = memkit.estimate("flux", size="tiny", device="cpu", mixed_precision=precision, memoize=False)
        assert tl.meta["first_step_peak_bytes"] == first.peak_bytes
        assert tl.meta["steady_peak_bytes"] == steady.peak_bytes


def test_mixed_precision_runs_every_block_and_says_why():
    # autocast frees every block's cast copies at once when the forward ends: not a sum over blocks
    tl = memkit.estimate("flux", size="tiny", mixed_precision="bf16")
    assert not tl.meta["memoized"]
    assert tl.meta["memo"] == "mixed_precision='bf16' frees its cast cache of every block at once"


def test_mixed_precision_keeps_the_weights_and_the_state_in_fp32():
    torch.manual_seed(0)
    model, x = Wide(width=16, depth=2), {"x": torch.randn(8, 16)}
    runner = memkit.Step(optimizer="adamw", mixed_precision="fp16").bind(model)
    runner.run(x)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = [t for s in runner.optimizer.state.values() for t in s.values() if t.dim()]
    assert state and {t.dtype for t in state} == {torch.float32}
    assert runner.scaler is not None and runner.scaler.get_scale() > 1  # loss scaling ran


@pytest.mark.parametrize("value", ["bf32", "fp32", torch.bfloat16, True])
def test_bad_mixed_precision_names_the_argument(value):
    with pytest.raises(ValueError, match=r"mixed_precision must be one of \[None, 'bf16', 'fp16'\]"):
        memkit.Step(mixed_precision=value)


def test_mixed_precision_refuses_low_precision_master_weights():
    with pytest.raises(ValueError, match="mixed_precision='bf16' keeps the trained weights in float32"):
        memkit.estimate("dit", size="tiny", mixed_precision="bf16", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mixed_precision='bf16' keeps the trained weights in float32"):
        memkit.Step(mixed_precision="bf16").bind(Wide().to(torch.bfloat16))
    frozen = Wide().to(torch.bfloat16).requires_grad_(False)  # the LoRA scripts' base: bf16, frozen
    memkit.Step(mixed_precision="bf16").bind(frozen)
    assert memkit.estimate("dit", size="tiny", mixed_precision="bf16").meta["dtype"] == "float32"
    assert str(memkit.Step(optimizer="adamw", mixed_precision="bf16")) == "training (adamw, mixed bf16)"


def test_the_command_line_takes_mixed_precision(capsys):
    from memkit.cli import main

    assert main(["estimate", "dit", "--size", "tiny", "--mixed-precision", "bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["mixed_precision"], result["dtype"]) == ("bf16", "float32")
    assert result["peak_bytes"] == memkit.estimate("dit", size="tiny", mixed_precision="bf16").peak_bytes
    assert main(["estimate", "dit", "--size", "tiny", "--mixed-precision", "fp16", "--dtype", "bf16"]) == 2
    # a bf16 model trained under mixed precision: its trained weights are not fp32 master weights
    assert "mixed_precision='fp16' keeps the trained weights in float32" in capsys.readouterr().err
    assert main(["estimate", "dit", "--size", "tiny", "--mixed-precision", "fp8"]) == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


# ---- fused backward -------------------------------------------------------------------------------------------


def _most_gradient_bytes(tl: memkit.Timeline) -> int:
    return int(tl.live_by_category()["gradient"].max())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fused_backward_estimate_equals_real_steps_to_the_byte(optimizer):
    first, steady = real_steps(2, optimizer=optimizer, fused_backward=True)
    tl = estimate_cpu(optimizer=optimizer, fused_backward=True)
    assert tl.meta["fused_backward"] is True
    assert tl.meta["first_step_peak_bytes"] == first.peak_bytes
    assert tl.meta["steady_peak_bytes"] == steady.peak_bytes


def test_fused_backward_never_holds_a_full_set_of_gradients():
    # one layer's gradients at a time: its backward node makes the weight's and the bias's together, and each is
    # freed by its hook as soon as it is accumulated, before the next layer's node runs
    largest = max(sum(p.numel() * 4 for p in m.parameters()) for m in Wide().layers)
    fused = real_steps(2, fused_backward=True)
    plain = real_steps(2)
    assert _most_gradient_bytes(fused[1]) == largest
    assert _most_gradient_bytes(plain[1]) == sum(p.numel() * 4 for p in Wide().parameters())
    assert _most_gradient_bytes(fused[0]) < _most_gradient_bytes(plain[0])


def test_fused_backward_updates_as_the_plain_step_does():
    torch.manual_seed(0)
    a, x = Wide(width=16, depth=2), {"x": torch.randn(8, 16)}
    b = Wide(width=16, depth=2)
    b.load_state_dict(a.state_dict())
    for model, fused in ((a, False), (b, True)):
        runner = memkit.Step(optimizer="adamw", fused_backward=fused).bind(model)
        for _ in range(2):
            runner.run(x)
        runner.remove()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        assert q.grad is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fused_backward=True, grad_accum=2), "fused_backward=True .* refuses grad_accum=2"),
        (dict(fused_backward=True, optimizer=None), "fused_backward=True steps the optimizer in the backward"),
        (dict(fused_backward=True, mixed_precision="fp16"), "fused_backward=True refuses mixed_precision='fp16'"),
        (dict(fused_backward="yes"), "fused_backward must be True or False"),
    ],
)
def test_bad_fused_backward_says_why(kwargs, message):
    kwargs.setdefault("optimizer", "adamw")
    with pytest.raises(ValueError, match=message):
        memkit.Step(**kwargs)


def test_the_command_line_takes_fused_backward(capsys):
    from memkit.cli import main

    assert main(["estimate", "dit", "--size", "tiny", "--fused-backward", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fused_backward"] is True
    assert result["peak_bytes"] == memkit.estimate("dit", size="tiny", fused_backward=True).peak_bytes
    assert main(["estimate", "dit", "--size", "tiny", "--fused-backward", "--grad-accum", "2"]) == 2
    assert "refuses grad_accum=2" in capsys.readouterr().err


def test_mixed_precision_with_fp32_adapters_on_a_frozen_bf16_base_equals_real_steps():
    # the LoRA scripts' recipe: the base cast to bf16 and frozen, the adapters upcast to fp32, the forward under
    # autocast; the estimate (device="cpu") against real CPU steps tracked one by one
    def build():
        model = memkit.load_model("flux", dtype=torch.bfloat16)
        memkit.LoRA(rank=4, dtype=torch.float32).apply(model)
        return model

    model = build()
    inputs = memkit.make_inputs(model)
    runner = memkit.Step(optimizer="adamw", mixed_precision="bf16", steps=1).bind(model)
    first, second = [], []
    for out in (first, second):
        with memkit.track(inputs=inputs, **runner.tracked_objects()) as tl:
            runner.run(inputs)
        out.append(tl)
    first, second = first[0], second[0]
    est = memkit.estimate(build, device="cpu", dtype=torch.bfloat16, mixed_precision="bf16", progress=False)
    assert est.meta["first_step_peak_bytes"] == first.peak_bytes
    assert est.meta["steady_peak_bytes"] == second.peak_bytes


@pytest.mark.slow
@pytest.mark.extended  # CI time (23 s): the README figure re-estimated in make test-extended
def test_the_readme_figure_of_the_lora_mixed_precision_recipe():
    # README, "The training recipe": full Flux, a frozen bf16 base, fp32 adapters, autocast (every block runs: ~25 s)
    tl = memkit.estimate(
        "flux", dtype=torch.bfloat16, mixed_precision="bf16", optimizations=[memkit.LoRA(dtype=torch.float32)],
        progress=False,
    )  # fmt: skip
    assert f"{tl.peak_bytes:,} B, {tl.peak_bytes / 2**30:.2f} GiB" in " ".join(README.read_text().split())
    assert tl.peak_bytes == tl.meta["steady_peak_bytes"] and tl.meta["trainable_parameters"] == 44_826_624


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_compare_holds_a_fused_backward_to_the_baseline(optimizer):
    torch.manual_seed(0)
    state = Wide(width=16, depth=2).state_dict()

    def fresh():
        model = Wide(width=16, depth=2)
        model.load_state_dict(state)
        return model

    x = {"x": torch.randn(8, 16)}
    cmp = memkit.compare(
        fresh,
        {
            "fused": memkit.Variant(step=memkit.Step(optimizer=optimizer, fused_backward=True)),
            # another update rule, fused: its gradients are the baseline's, its updated weights are not
            "fused-other": memkit.Variant(step=memkit.Step(optimizer="adafactor", fused_backward=True)),
        },
        step=memkit.Step(optimizer=optimizer), inputs=x, repeats=0, progress=False,
    )  # fmt: skip
    fused, other = cmp.results["fused"], cmp.results["fused-other"]
    # the gradients each hook saw before its update, against the baseline's after its backward: the same numbers
    assert fused.passed and fused.max_abs_d_grad == 0.0 and fused.max_abs_d_param <= 1e-6
    assert other.max_abs_d_grad == 0.0 and other.max_abs_d_param > 1e-3 and not other.passed
    # and each step's memory is its own: the fused one never holds the full set of gradients the baseline does
    most = {k: cmp.results[k].timeline.live_by_category()["gradient"].max() for k in ("baseline", "fused")}
    assert most["baseline"] == sum(p.numel() * 4 for p in fresh().parameters()) > most["fused"]


def test_compare_takes_a_fused_backwards_hooks_off_a_shared_model():
    shared = Wide(width=16, depth=2)
    x = {"x": torch.randn(8, 16)}

    def broken_check(model, handle):
        raise RuntimeError("the variant's own check failed")

    # a variant that raises after its fused step: the hooks must still come off the model compare was given
    with pytest.raises(RuntimeError, match="own check failed"):
        memkit.compare(
            lambda: shared,
            {"fused": memkit.Variant(step=memkit.Step(optimizer="sgd", fused_backward=True), check=broken_check)},
            step=memkit.Step(optimizer="sgd"), inputs=x, repeats=0, progress=False,
        )  # fmt: skip
    before = [p.detach().clone() for p in shared.parameters()]
    memkit.train_step(shared, x)  # no optimizer: nothing may update the weights now
    assert all(torch.equal(a, b) for a, b in zip(before, shared.parameters(), strict=True))
