"""``Step(optimizer_on="cpu")``: torchao's own ``CPUOffloadOptimizer``, run on this CPU-only machine through memkit's
stand-in for its streams and pinned memory. Real CPU steps tracked one by one are held against the estimate to the
byte; a ``"cuda"`` estimate's host bytes against torchao's own objects after a real step; the stand-in is undone
after every use, also after an error."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from oracles import Wide, real_steps, tracked_and_profiled, tracked_steps, wide_inputs
from test_optimizers import net, net_inputs
from test_widgets import _state

import memkit
from memkit.cli import main
from memkit.handle import apply_all
from memkit.memory.events import CUDA_BLOCK, round_alloc
from memkit.optimizers import OPTIMIZERS, MissingLibraryError, make_optimizer
from memkit.step import model_output

pytest.importorskip("bitsandbytes")
pytest.importorskip("prodigyopt")
pytest.importorskip("came_pytorch")
cpu_offload = pytest.importorskip("torchao.optim.cpu_offload")
torchao_utils = pytest.importorskip("torchao.utils")


def originals() -> tuple:
    """What memkit's stand-in replaces while torchao's code runs, as it must be outside it."""
    return (
        cpu_offload.torch,
        cpu_offload.get_available_devices,
        torch.Tensor.record_stream,
        torch.Tensor.register_post_accumulate_grad_hook,
        torch.cuda.Stream,
        torch.cuda.current_stream,
        torch.cuda.stream,
        torch.empty_like,
    )


ORIGINALS = originals()


def hooks_of(model: torch.nn.Module) -> int:
    """Post-accumulate-grad hooks on the model's parameters (torch keeps them in a private dict)."""
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def host_bytes_of(opt) -> dict[str, int]:
    """The oracle: the host memory torchao's objects hold, from torchao's own attributes (``param_d2h_map``: device
    parameter -> host copy, whose ``.grad`` is the host gradient; ``optim_dict``: one optimizer per host copy)."""
    hosts = list(opt.param_d2h_map.values())
    return {
        "parameter": sum(p.untyped_storage().nbytes() for p in hosts),
        "gradient": sum(p.grad.untyped_storage().nbytes() for p in hosts),
        "optimizer_state": state_bytes(opt.optim_dict.values()),
    }


def state_bytes(optimizers, granularity: int | None = None) -> int:
    """Every storage in the optimizers' ``state``, once (bitsandbytes shares its quantization maps), each rounded up
    to ``granularity`` bytes if given."""
    storages = {}
    for inner in optimizers:
        for s in inner.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    storages[v.untyped_storage()._cdata] = v.untyped_storage().nbytes()
    return sum(round_alloc(n, granularity) if granularity else n for n in storages.values())


def device_state_of(opt, granularity: int | None = None) -> int:
    """The state of torchao's on-device optimizer (the parameters under ``minimal_size``)."""
    return state_bytes([opt.d_opt] if opt.d_opt is not None else [], granularity)


# ---- torchao's class, run for real on the CPU -------------------------------------------------------------------


def test_the_optimizer_is_torchaos_class_and_the_stand_in_is_gone_after_each_use():
    model = Wide(width=64, depth=2)
    runner = memkit.Step(optimizer="adamw", optimizer_on="cpu").bind(model)
    opt = runner.optimizer
    assert isinstance(opt, cpu_offload.CPUOffloadOptimizer) and originals() == ORIGINALS
    assert set(opt.param_d2h_map) == {m.weight for m in model.layers}  # 4,096 elements: offloaded; biases: not
    assert set(opt.d_opt.param_groups[0]["params"]) == {m.bias for m in model.layers}
    assert all(inner.defaults["fused"] for inner in opt.optimizers)  # torchao's default: fused AdamW
    x = {"x": torch.randn(8, 64)}
    runner.run(x)
    assert originals() == ORIGINALS
    for p, host in opt.param_d2h_map.items():  # the update reached the device parameter (copied back)
        assert torch.equal(p.detach(), host)
    assert hooks_of(model) == 2
    runner.remove()
    assert hooks_of(model) == 0


@pytest.mark.parametrize("name", ["adamw", "sgd", "adamw8bit"])
def test_the_update_is_the_optimizers_own(name):
    # the same parameters as the optimizer on the device after two steps (AdamW: torchao's fused kernel against the
    # loop, to float rounding; the others: the same kernel on the same values)
    def trained(**step):
        torch.manual_seed(0)
        model = Wide(width=64, depth=2)
        runner = memkit.Step(optimizer=name, **step).bind(model)
        x = {"x": torch.randn(8, 64)}
        for _ in range(2):
            runner.run(x)
        return [p.detach() for p in model.parameters()]

    device, cpu = trained(), trained(optimizer_on="cpu")
    for a, b in zip(device, cpu, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.manual_seed(0)
    initial = list(Wide(width=64, depth=2).parameters())
    assert all(not torch.equal(a, b) for a, b in zip(initial, cpu, strict=True))  # every parameter was updated


def test_offload_gradients_frees_each_device_gradient_in_the_backward():
    torch.manual_seed(0)
    model = Wide(width=64, depth=2)
    runner = memkit.Step(optimizer="adamw", optimizer_on="cpu", offload_gradients=True).bind(model)
    seen = {}
    runner.run({"x": torch.randn(8, 64)}, on_grads=lambda m: seen.update({n: p.grad for n, p in m.named_parameters()}))
    offloaded = {n for n, p in model.named_parameters() if p in runner.optimizer.param_d2h_map}
    assert offloaded and all(seen[n] is None for n in offloaded)
    assert all(seen[n] is not None for n in seen if n not in offloaded)  # the small ones, stepped on the device


# ---- the estimate against real steps -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_estimate_equals_the_real_first_and_steady_step_with_each_optimizer(name):
    # torchao steps one optimizer of that name per host copy (the 8-bit ones through bitsandbytes' CPU kernel)
    model = net()()
    runner = memkit.Step(optimizer=name, optimizer_on="cpu", steps=1).bind(model)
    first, steady = tracked_steps(runner, net_inputs(model), 2)
    tl = memkit.estimate(net(), net_inputs, optimizer=name, optimizer_on="cpu", device="cpu", dtype=torch.float32)
    assert (tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"]) == (first.peak_bytes, steady.peak_bytes)
    host = host_bytes_of(runner.optimizer)
    assert steady.baseline_by_category["optimizer_state"] == host["optimizer_state"] + device_state_of(runner.optimizer)
    assert tl.meta["host_bytes"] == {} and tl.meta["optimizer_on"] == "cpu"


@pytest.mark.parametrize(
    "model_fn, step",
    [
        (Wide, {}),
        (Wide, {"offload_gradients": True}),
        (Wide, {"grad_accum": 2}),
        (Wide, {"mixed_precision": "bf16"}),
        (Wide, {"mixed_precision": "fp16"}),
    ],
    ids=["plain", "offload-gradients", "grad-accum", "bf16", "fp16"],
)
def test_an_estimate_equals_real_steps_with_the_recipe_options(model_fn, step):
    first, steady = real_steps(2, model_fn, optimizer_on="cpu", **step)
    tl = memkit.estimate(model_fn, wide_inputs, device="cpu", dtype=torch.float32, optimizer_on="cpu", **step)
    assert (tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"]) == (first.peak_bytes, steady.peak_bytes)


@pytest.mark.parametrize(
    "optimizations",
    [[memkit.LoRA(rank=4)], [memkit.Checkpointing()], [memkit.EMA()]],
    ids=["lora", "checkpointing", "ema"],
)
def test_an_estimate_of_tiny_flux_equals_real_steps_with_the_optimizations(optimizations):
    model = memkit.load_model("flux", dtype=torch.bfloat16)
    handle = apply_all(model, optimizations)
    runner = memkit.Step(optimizer="adamw", optimizer_on="cpu", steps=1).bind(model, handle)
    first, steady = tracked_steps(runner, memkit.make_inputs(model), 2)
    tl = memkit.estimate(
        "flux", size="tiny", optimizations=optimizations, optimizer_on="cpu", device="cpu", progress=False
    )
    assert (tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"]) == (first.peak_bytes, steady.peak_bytes)
    trainable = {p for p in model.parameters() if p.requires_grad}
    assert set(runner.optimizer.param_d2h_map) <= trainable  # LoRA: only the adapters are offloaded
    assert not tl.meta["memoized"] and "optimizer_on='cpu'" in tl.meta["memo"]


# ---- host bytes of an estimate for a GPU ---------------------------------------------------------------------------


def _host_and_device(size: str):
    model = memkit.load_model("flux", size=size, dtype=torch.bfloat16)
    runner = memkit.Step(optimizer="adamw", optimizer_on="cpu").bind(model)
    runner.run(memkit.make_inputs(model))
    oracle = host_bytes_of(runner.optimizer)
    small = device_state_of(runner.optimizer), device_state_of(runner.optimizer, CUDA_BLOCK)
    on_cpu = memkit.estimate("flux", size=size, optimizer_on="cpu", progress=False)
    on_device = memkit.estimate("flux", size=size, progress=False)
    return oracle, small, on_cpu, on_device


def _check_host_and_device(oracle, small, on_cpu, on_device):
    assert on_cpu.meta["host_bytes"] == oracle  # fused AdamW: no host temporaries
    assert on_device.meta["host_bytes"] == {}
    state, (small, rounded) = oracle["optimizer_state"], small
    for which in ("first_step_peak_bytes", "steady_peak_bytes"):
        assert on_device.meta[which] - on_cpu.meta[which] >= state - small
    # the state on the device at the steady step's start is the small parameters' alone, each storage in 512 B blocks
    start = on_cpu.meta["step_starts"][1]
    assert on_cpu.bytes_by_category_at(start - 1)["optimizer_state"] == rounded
    start = on_device.meta["step_starts"][1]
    assert on_device.bytes_by_category_at(start - 1)["optimizer_state"] >= state + small


def test_a_cuda_estimates_host_bytes_are_torchaos_host_copies_and_state():
    _check_host_and_device(*_host_and_device("tiny"))


@pytest.mark.slow  # a real step of small Flux (39M parameters) on the CPU: ~25-45 s
@pytest.mark.extended  # the tiny-size case above checks the same equality in make test
def test_a_cuda_estimates_host_bytes_are_torchaos_at_small_size():
    _check_host_and_device(*_host_and_device("small"))


@pytest.mark.parametrize("name", ["adamw8bit", "came", "adam"])
def test_a_cuda_estimates_host_temporaries_are_what_the_cpu_allocator_saw_in_the_host_steps(name):
    # each host copy's optimizer steps on the CPU whatever the estimate plans for: bitsandbytes' CPU kernel (its
    # dequantized fp32 moments), CAME's and Adam's CPU loops; the most alive at once, against torch.profiler's count
    # of each host step run under the tracker (as in test_optimizers: bitsandbytes' kernel called op by op). Short by
    # the CPU's wrapped Python numbers only (0-dim tensors the arguments' parser makes per op, a few bytes each): in
    # an estimate for a GPU the tracker counts no CPU kernel buffers in host steps (as for FSDP's CPU offload)
    model = net()()
    x = net_inputs(model)
    runner = memkit.Step(optimizer=name, optimizer_on="cpu").bind(model)
    runner.run(x)  # the state exists, as in the steady step
    model_output(model(**x)).float().pow(2).mean().backward()  # torchao's hooks copy the gradients to the host
    peaks = []
    for inner in runner.optimizer.optim_dict.values():
        _, (peak, _) = tracked_and_profiled(inner.step, optimizer=inner)
        peaks.append(peak)
    tl = memkit.estimate(net(), net_inputs, optimizer=name, optimizer_on="cpu", steps=2, dtype=torch.float32)
    host = tl.meta["host_bytes"]["temporary"]
    assert 0 <= max(peaks) - host <= 64 and host > 0


# ---- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"optimizer_on": "host"}, r"optimizer_on must be one of \['device', 'cpu'\], got 'host'"),
        ({"optimizer_on": "cpu", "optimizer": None}, "optimizer_on='cpu' .* needs a training step with an optimizer"),
        ({"optimizer_on": "cpu", "optimizer": None, "mode": "inference"}, "needs a training step with an optimizer"),
        ({"optimizer_on": "cpu", "fused_backward": True}, "optimizer_on='cpu' refuses fused_backward=True"),
        ({"offload_gradients": True}, "offload_gradients=True .* goes with optimizer_on='cpu'"),
        ({"optimizer_on": "cpu", "offload_gradients": True, "grad_accum": 2}, "refuses grad_accum=2"),
        ({"optimizer_on": "cpu", "offload_gradients": 1}, "offload_gradients must be True or False"),
    ],
)
def test_a_step_refuses_what_torchaos_class_cannot_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        memkit.Step(**{"optimizer": "adamw", **kwargs})


def test_fsdp_and_foreach_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="optimizer_on='cpu' .* is single-GPU: it refuses FSDP"):
        memkit.estimate("flux", size="tiny", optimizer_on="cpu", parallel=memkit.FSDP(world_size=2))
    with pytest.raises(ValueError, match="foreach=True does not apply to AdamW on the CPU"):
        memkit.Step(optimizer="adamw", optimizer_on="cpu", foreach=True).bind(Wide(width=64, depth=1))
    with pytest.raises(ValueError, match="on must be one of"):
        make_optimizer("adamw", Wide().parameters(), on="gpu")


def test_a_missing_torchao_names_the_option_the_package_and_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao.optim.cpu_offload", None)  # import fails as if not installed
    message = r"optimizer_on='cpu' needs torchao.*pip install \"memkit\[finetune\]\""
    with pytest.raises(MissingLibraryError, match=message):
        memkit.Step(optimizer="adamw", optimizer_on="cpu").bind(Wide(width=64, depth=1))
    assert main(["estimate", "flux", "--size", "tiny", "--optimizer-on", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "memkit[finetune]" in err and "Traceback" not in err


def test_a_failed_setup_leaves_the_model_unchanged_and_the_stand_in_undone(monkeypatch):
    model = Wide(width=64, depth=3)
    made = []

    def fails_on_the_second(name, params, *, foreach=None):  # torchao builds one optimizer per host copy
        made.append(name)
        if len(made) == 2:
            raise RuntimeError("no more optimizers")
        return torch.optim.SGD(params, lr=1e-3)

    monkeypatch.setattr(memkit.optimizers, "build_optimizer", fails_on_the_second)
    with pytest.raises(RuntimeError, match="no more optimizers"):
        memkit.Step(optimizer="sgd", optimizer_on="cpu").bind(model)
    assert hooks_of(model) == 0 and originals() == ORIGINALS


def test_an_error_in_the_step_or_the_backward_undoes_the_stand_in(monkeypatch):
    model = Wide(width=64, depth=2)
    runner = memkit.Step(optimizer="adamw", optimizer_on="cpu").bind(model)
    x = {"x": torch.randn(8, 64)}
    inner = next(iter(runner.optimizer.optim_dict.values()))

    def broken(closure=None):
        assert cpu_offload.torch is not torch  # inside torchao's step: the stand-in is in place
        raise RuntimeError("step failed")

    monkeypatch.setattr(inner, "step", broken)
    with pytest.raises(RuntimeError, match="step failed"):
        runner.run(x)
    assert originals() == ORIGINALS
    monkeypatch.setattr(runner.optimizer.stream, "wait_stream", lambda s: 1 / 0)  # torchao's backward hook fails
    with pytest.raises(ZeroDivisionError):
        runner.run(x)
    assert originals() == ORIGINALS


# ---- surfaces ------------------------------------------------------------------------------------------------------


def test_the_command_line_reports_the_host_bytes(capsys):
    code = main(["estimate", "flux", "--size", "tiny", "--optimizer-on", "cpu", "--offload-gradients", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and (result["optimizer_on"], result["offload_gradients"]) == ("cpu", True)
    tl = memkit.estimate("flux", size="tiny", optimizer_on="cpu", offload_gradients=True, progress=False)
    assert result["host_bytes"] == tl.meta["host_bytes"] and set(tl.meta["host_bytes"]) == {
        "parameter",
        "gradient",
        "optimizer_state",
    }
    assert result["peak_bytes"] == tl.peak_bytes
    assert main(["estimate", "flux", "--size", "tiny", "--optimizer-on", "cpu"]) == 0
    assert "in CPU memory, off the GPU peak" in capsys.readouterr().out
    assert main(["estimate", "flux", "--size", "tiny", "--optimizer-on", "cpu", "--fused-backward"]) == 2
    assert "refuses fused_backward=True" in capsys.readouterr().err
    assert main(["estimate", "flux", "--size", "tiny", "--offload-gradients"]) == 2
    assert "--offload-gradients goes with --optimizer-on cpu" in capsys.readouterr().err


def test_the_playground_controls_reach_the_step_and_the_estimate():
    pg = memkit.Playground(figures="widget")
    c = pg.controls
    c["optimizer_on"].value = "cpu"
    c["offload_gradients"].value = True
    step = pg.state.step()
    assert (step.optimizer_on, step.offload_gradients) == ("cpu", True)
    c["mode"].value = "inference"
    assert c["optimizer_on"].disabled and c["offload_gradients"].disabled
    assert pg.state.step() == memkit.Step(mode="inference")
    c["mode"].value = "training"
    state = _state(estimate_size="tiny", optimizer="adamw", optimizer_on="cpu", offload_gradients=True)
    base = state.estimate().comparison.results["baseline"].timeline
    assert base.meta["optimizer_on"] == "cpu" and base.meta["offload_gradients"]
    tl = memkit.estimate("dit", size="tiny", optimizer_on="cpu", offload_gradients=True, progress=False)
    assert base.peak_bytes == tl.peak_bytes and base.meta["host_bytes"] == tl.meta["host_bytes"]


def _readme_rows() -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return text[text.index("| recipe (`memkit estimate flux ...`) | GPU peak") :].split("\n\n")[0].splitlines()[2:]


# Five full-size Flux estimates, three of them every block (~15 s each): CI checks the first row and the first
# --optimizer-on cpu row, `make test-extended` every row.
_ROWS = _readme_rows()
_CI_ROWS = {0}  # CI time: the --optimizer-on cpu row (17 s) in make test-extended; tests above hold its figures


def test_the_readme_table_has_its_five_rows():
    assert len(_ROWS) == 5


@pytest.mark.slow
@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=() if i in _CI_ROWS else pytest.mark.extended, id=str(i)) for i, r in enumerate(_ROWS)],
)
def test_the_readme_table_is_what_the_estimates_say(row, capsys):
    # the row's command, run: its steady-step peak (allocated, "cuda"; the larger here) and host bytes as printed
    command, peak, host = re.fullmatch(
        r"\| .*\(`(memkit estimate [^`]+)`\) \| ([\d.]+) GiB \| ([\d.]+) GiB \|", row
    ).groups()
    assert main([*command.split()[1:], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured"] == "first and steady" and out["peak_bytes"] == out["steady_peak_bytes"], row
    assert f"{out['peak_bytes'] / 2**30:.2f}" == peak, row
    assert f"{sum(out['host_bytes'].values()) / 2**30:.2f}" == host, row
    assert set(out["host_bytes"]) == ({"parameter", "gradient", "optimizer_state"} if "cpu" in command else set())


def test_compare_holds_the_cpu_optimizer_against_the_device_one_and_takes_its_hooks_off():
    shared = Wide(width=64, depth=2)
    x = {"x": torch.randn(8, 64)}
    result = memkit.compare(
        lambda: shared, {"on cpu": memkit.Variant(step=memkit.Step(optimizer="adamw", optimizer_on="cpu"))},
        step=memkit.Step(optimizer="adamw"), inputs=x, repeats=0, progress=False,
    )  # fmt: skip
    assert result.results["on cpu"].passed
    assert hooks_of(shared) == 0
