import pytest
import torch

import memkit


def _run(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # DiT drops class labels at random in training
    out = memkit.step.model_output(model(**inputs))
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_same_outputs_and_gradients_with_checkpointing(preset):
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    ref_out, ref_grads = _run(model, inputs)
    with memkit.Checkpointing(pattern="all").apply(model):
        assert model.is_gradient_checkpointing
        out, grads = _run(model, inputs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-6, atol=1e-7)


def test_remove_restores_every_module_exactly():
    model = memkit.load_model("flux")
    before = {
        name: (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", "absent"))
        for name, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    }
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle = memkit.Checkpointing(pattern="all").apply(model)
    assert handle.active and model.is_gradient_checkpointing
    handle.remove()
    handle.remove()  # harmless twice
    after = {
        name: (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", "absent"))
        for name, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    }
    assert after == before and not handle.active
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_checkpointing_lowers_activation_peak():
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model, height=128, width=128)
    with memkit.track(model, inputs=inputs) as base:
        memkit.train_step(model, inputs)
    model.zero_grad(set_to_none=True)
    with memkit.Checkpointing().apply(model), memkit.track(model, inputs=inputs) as ckpt:
        memkit.train_step(model, inputs)
    assert ckpt.peak_bytes < base.peak_bytes


def test_bad_pattern_and_unsupported_model():
    with pytest.raises(ValueError, match=r"pattern must be one of \['all'\]"):
        memkit.Checkpointing(pattern="every:2")
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        memkit.Checkpointing().apply(torch.nn.Linear(2, 2))
