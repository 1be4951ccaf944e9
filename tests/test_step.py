"""The one step everyone runs: Step, its runner, train_step."""

import subprocess
import sys

import pytest
import torch

import memkit
from memkit.handle import Handle
from memkit.memory import track
from memkit.step import Step, model_output


def test_a_runner_steps_the_optimizer_and_runs_the_handles_work_after_each_step():
    model = memkit.load_model("dit")
    inputs = memkit.make_inputs(model)
    calls = []
    handle = Handle(lambda: None, after_step=lambda: calls.append(model.pos_embed.proj.weight.detach().clone()))
    before = model.pos_embed.proj.weight.detach().clone()
    runner = Step(optimizer="sgd").bind(model, handle)
    assert isinstance(runner.optimizer, torch.optim.SGD)
    loss = runner.run(inputs)
    assert loss.ndim == 0 and not loss.requires_grad
    assert len(calls) == 1 and not torch.equal(calls[0], before)  # after the update
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)
    runner.run(inputs)
    assert len(calls) == 2


def test_without_an_optimizer_gradients_accumulate_and_inference_keeps_none():
    model = memkit.load_model("pixart")
    inputs = memkit.make_inputs(model)
    runner = Step().bind(model)
    assert runner.optimizer is None
    runner.run(inputs)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    runner.run(inputs)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n])
    model.zero_grad(set_to_none=True)
    assert Step(mode="inference").bind(model).run(inputs) is None
    assert all(p.grad is None for p in model.parameters())


def test_hooks_see_the_output_and_the_gradients_before_the_update():
    model = memkit.load_model("sd3")
    inputs = memkit.make_inputs(model)
    seen = {}
    Step(optimizer="adamw").bind(model).run(
        inputs,
        on_output=lambda out: seen.setdefault("out", out.detach().clone()),
        on_grads=lambda m: seen.setdefault("grads", sum(p.grad is not None for p in m.parameters())),
    )
    with torch.no_grad():
        assert seen["out"].shape == model_output(model(**inputs)).shape
    assert seen["grads"] == sum(1 for p in model.parameters() if p.requires_grad)


def test_train_step_is_the_same_step():
    a, b = memkit.load_model("flux"), memkit.load_model("flux")
    inputs = memkit.make_inputs(a)
    la = memkit.train_step(a, inputs)
    lb = Step().bind(b).run(inputs)
    assert torch.equal(la, lb)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa.grad, pb.grad)


def test_the_loss_is_part_of_the_forward_so_its_float32_copy_is_an_activation():
    # In bf16 the loss upcasts the output; backward keeps that float32 copy (pow saves its input).
    model = memkit.load_model("dit", dtype=torch.bfloat16)
    inputs = memkit.make_inputs(model)
    with track(model, inputs=inputs) as tl:
        memkit.train_step(model, inputs)
    df = tl.to_pandas()
    out_numel = model_output(model(**inputs)).numel()
    first_backward = df.index[df.phase == "backward"][0]
    upcasts = df[(df.op == "aten._to_copy.default") & (df.action == "alloc") & (df.index < first_backward)]
    last = upcasts.iloc[-1]  # the loss's .float(), the last cast before backward
    assert last.bytes == out_numel * 4 and last.phase == "forward" and last.category == "activation"


def test_a_model_predicting_two_streams_gets_a_loss_term_for_each():
    # LTX-2 denoises video and audio, and its trainer's loss has a term per stream: the audio head learns too
    model = memkit.load_model("ltx-2")
    inputs = memkit.make_inputs(model)
    with torch.no_grad():
        video, audio = model(**inputs)
    loss = memkit.train_step(model, inputs)
    torch.testing.assert_close(loss, video.float().pow(2).mean() + audio.float().pow(2).mean())
    assert model.audio_proj_out.weight.grad.any()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "train"}, "mode must be one of"),
        ({"optimizer": "lamb"}, "optimizer must be one of"),
        ({"mode": "inference", "optimizer": "sgd"}, "only used in training"),
        ({"steps": 0}, "steps must be None .* or an int >= 1"),
        ({"steps": True}, "steps must be None .* or an int >= 1"),
        ({"foreach": "yes"}, "foreach must be"),
    ],
)
def test_bad_steps_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Step(**kwargs)


def test_step_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        Step("training")
    with pytest.raises(AttributeError):
        Step().mode = "inference"
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Step().bind("flux")


@pytest.mark.slow  # a fresh interpreter importing memkit, torch and diffusers: seconds
def test_importing_plots_or_the_timeline_does_not_load_torch():
    code = (
        "import sys, memkit, memkit.plots, memkit.memory\n"
        "from memkit.memory import Timeline, CATEGORIES\n"
        "assert 'torch' not in sys.modules and 'diffusers' not in sys.modules, sorted(sys.modules)\n"
        "memkit.compare\n"
        "assert 'torch' in sys.modules\n"
        "import memkit.comparison, memkit.estimation\n"
        "assert callable(memkit.compare) and callable(memkit.estimate)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
