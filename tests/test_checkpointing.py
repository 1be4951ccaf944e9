import pytest
import torch

import memkit


def _run(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # DiT drops class labels at random in training
    out = memkit.step.model_output(model(**inputs))
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# diffusers' Chroma passes no attention mask to its checkpointed single blocks (ChromaTransformer2DModel.forward): the
# preset's mask is all ones, so the same attention by another SDPA path, equal to rounding
ROUNDING = {"chroma": 1e-6}


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_same_outputs_and_gradients_with_checkpointing(preset):
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    ref_out, ref_grads = _run(model, inputs)
    with memkit.Checkpointing(pattern="all").apply(model):
        assert model.is_gradient_checkpointing
        out, grads = _run(model, inputs)
    tol = ROUNDING.get(preset, 0.0)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=max(tol, 1e-6), atol=max(tol, 1e-7))


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


def test_bad_patterns_providers_and_models_name_what_is_allowed():
    for bad in ("every:2:3", "every:0", "sometimes", "first:-1", ""):
        with pytest.raises(ValueError, match="pattern must be one of"):
            memkit.Checkpointing(pattern=bad)
    with pytest.raises(TypeError, match="pattern must be"):
        memkit.Checkpointing(pattern=2.5)
    with pytest.raises(ValueError, match=r"provider must be one of \['torch', 'selective', 'offload'\]"):
        memkit.Checkpointing(provider="offload-to-moon")
    flux = memkit.load_model("flux")  # 2 blocks
    with pytest.raises(ValueError, match=r"blocks \[2\] that do not exist: the model has 2 blocks"):
        memkit.Checkpointing(pattern=(0, 2)).apply(flux)
    with pytest.raises(ValueError, match="names 3 blocks, but the model has 2"):
        memkit.Checkpointing(pattern="last:3").apply(flux)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in flux.modules())  # nothing half-applied
    with pytest.raises(ValueError, match="no nn.ModuleList of blocks"):
        memkit.Checkpointing().apply(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="blocks must name a non-empty nn.ModuleList"):
        memkit.Checkpointing(blocks="layers").apply(_Stack(3))


class _Stack(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)) for _ in range(n)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _every_other(index, block):
    return index % 2 == 1


PATTERNS = ["all", "every:2", "skip-every:2", "first:1", "last:1", (1,), _every_other, "none"]


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["torch", "selective"])
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_every_pattern_and_provider_keeps_outputs_and_gradients(preset, provider):
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    ref_out, ref_grads = _run(model, inputs)
    for pattern in PATTERNS:
        with memkit.Checkpointing(pattern=pattern, provider=provider).apply(model):
            out, grads = _run(model, inputs)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-7, msg=f"{pattern} output")
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-6, atol=1e-7, msg=f"{pattern} {k}")


@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_the_blocks_found_are_the_ones_diffusers_checkpoints(preset):
    model = memkit.load_model(preset)
    passed = []

    def record(module, *args, **kwargs):
        passed.append(module)
        return module(*args, **kwargs)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=record)
    memkit.train_step(model, memkit.make_inputs(model))
    names = {id(m): n for n, m in model.named_modules()}
    found = [name for name, _ in memkit.Checkpointing().select(model)]
    assert {names[id(m)] for m in passed} == set(found) - {"mid_block.resnets.0"}  # UNet's runs outside


def _checkpointed(model, inputs, config, monkeypatch) -> list[str]:
    from memkit.optimizations import checkpointing as ck

    names = {id(m): n for n, m in model.named_modules()}
    seen, real = [], ck._run_checkpointed

    def spy(provider, fn, *args, **kwargs):
        seen.append(names[id(getattr(fn, "__self__", None))] if hasattr(fn, "__self__") else "?")
        return real(provider, fn, *args, **kwargs)

    monkeypatch.setattr(ck, "_run_checkpointed", spy)
    with config.apply(model):
        memkit.train_step(model, inputs)
    model.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("every:4", lambda n: [i for i in range(n) if i % 4 == 0]),
        ("skip-every:4", lambda n: [i for i in range(n) if i % 4]),
        ("first:3", lambda n: [0, 1, 2]),
        ("last:2", lambda n: [n - 2, n - 1]),
        ((5, 1), lambda n: [1, 5]),
        ("none", lambda n: []),
    ],
)
def test_a_pattern_checkpoints_exactly_the_blocks_it_names(pattern, expected, monkeypatch):
    model = memkit.load_model("dit", size="small")  # 12 transformer blocks
    blocks = [name for name, _ in memkit.Checkpointing().select(model)]
    assert len(blocks) == 12
    seen = _checkpointed(model, memkit.make_inputs(model), memkit.Checkpointing(pattern=pattern), monkeypatch)
    assert seen == [blocks[i] for i in expected(len(blocks))]


def test_a_plain_module_list_model_is_checkpointed_and_restored(monkeypatch):
    torch.manual_seed(0)
    model, x = _Stack(5), torch.randn(4, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def grads():
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.pow(2).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    ref_out, ref = grads()
    config = memkit.Checkpointing(pattern="every:2")
    assert config.select(model) == [(f"blocks.{i}", i % 2 == 0) for i in range(5)]
    with config.apply(model):
        assert all(("forward" in vars(b)) == (i % 2 == 0) for i, b in enumerate(model.blocks))
        out, got = grads()
    assert not any("forward" in vars(b) for b in model.blocks)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _activation_at_backward_start(tl) -> int:
    events = tl.to_pandas()
    return tl.bytes_by_category_at(int(events.index[events.phase == "backward"][0]))["activation"]


def test_activations_are_ordered_by_the_share_of_blocks_checkpointed():
    # What checkpointing cuts is what the forward keeps for the backward. By the share of the 8 blocks each
    # pattern checkpoints: none 0, every:4 2/8, every:2 4/8, skip-every:4 6/8, all 8/8.
    model = memkit.load_model("ltx-video", size="small")
    inputs = memkit.make_inputs(model)
    kept = {}
    for pattern in ("none", "every:4", "every:2", "skip-every:4", "all"):
        with memkit.Checkpointing(pattern=pattern).apply(model), memkit.track(model, inputs=inputs) as tl:
            memkit.train_step(model, inputs)
        model.zero_grad(set_to_none=True)
        kept[pattern] = _activation_at_backward_start(tl)
    values = list(kept.values())
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values), kept
    # each checkpointed block drops the same activations (identical blocks): the cut is linear in the share
    per_block = (kept["none"] - kept["all"]) / 8
    for pattern, share in (("every:4", 2), ("every:2", 4), ("skip-every:4", 6)):
        assert abs(kept["none"] - kept[pattern] - share * per_block) < 0.02 * kept["none"], (pattern, kept)


def test_selective_keeps_more_than_full_recompute_and_less_than_nothing():
    model = memkit.load_model("dit", size="small")
    inputs = memkit.make_inputs(model)
    act = {}
    for name, config in {
        "none": memkit.Checkpointing(pattern="none"),
        "selective": memkit.Checkpointing(provider="selective"),
        "torch": memkit.Checkpointing(),
    }.items():
        with config.apply(model), memkit.track(model, inputs=inputs) as tl:
            memkit.train_step(model, inputs)
        model.zero_grad(set_to_none=True)
        act[name] = _activation_at_backward_start(tl)
    assert act["none"] > act["selective"] > act["torch"], act


def test_parse_and_names():
    assert memkit.Checkpointing.parse("every:2") == memkit.Checkpointing(pattern="every:2")
    assert memkit.Checkpointing.parse("all@selective") == memkit.Checkpointing(provider="selective")
    assert str(memkit.Checkpointing(pattern="every:2", provider="selective")) == "checkpointing:every:2@selective"
    assert str(memkit.Checkpointing(pattern=(0, 3))) == "checkpointing:0,3"
    assert memkit.Checkpointing(pattern=[1, 2]).pattern == (1, 2)


# ---- selective checkpointing: each op it must keep -------------------------------------------------------------
# The ops whose outputs cost compute (matmuls, convolutions, attention): "selective" keeps their outputs and
# recomputes the rest. Listed here from the provider's contract, not read from the module.
KEPT_OPS = [
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
]


def _kept_op_forward(name: str):
    """(input, forward(x, weight), weight): ``sigmoid(name(exp(x), weight))``, aten ``name`` called once between two
    cheap ops (their outputs are saved for the backward: the recompute must rebuild them)."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cases = {
        "mm": (r(4, 6), r(6, 5), lambda x, w: x @ w),
        "addmm": (r(4, 6), r(5, 6), lambda x, w: F.linear(x, w, torch.ones(5))),
        "bmm": (r(2, 4, 6), r(2, 6, 5), torch.bmm),
        "baddbmm": (r(2, 4, 6), r(2, 6, 5), lambda x, w: torch.baddbmm(torch.ones(2, 4, 5), x, w)),
        "convolution": (r(1, 2, 6, 6), r(3, 2, 3, 3), F.conv2d),
        "_scaled_dot_product_flash_attention_for_cpu": (
            r(1, 2, 8, 4),
            r(1, 2, 8, 4),
            lambda x, w: F.scaled_dot_product_attention(x, w, w * 2),
        ),
    }
    x, w, fn = cases[name]
    return x.requires_grad_(), (lambda x, w: torch.sigmoid(fn(torch.exp(x), w))), torch.nn.Parameter(w)


class _OneOpNet(torch.nn.Module):
    def __init__(self, fn, weight):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_OneOpBlock(fn, weight)])

    def forward(self, x):
        return self.blocks[0](x)


class _OneOpBlock(torch.nn.Module):
    def __init__(self, fn, weight):
        super().__init__()
        self.fn, self.weight = fn, weight

    def forward(self, x):
        return self.fn(x, self.weight)


class _Calls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _backward_calls(name: str, provider: str | None) -> dict[str, int]:
    """How often ``name`` and ``exp`` run in the backward of the one-op block, checkpointed by ``provider``."""
    x, fn, weight = _kept_op_forward(name)
    model = _OneOpNet(fn, weight)
    handle = memkit.Checkpointing(provider=provider).apply(model) if provider else None
    out = model(x)
    with _Calls() as calls:
        out.pow(2).sum().backward()
    if handle is not None:
        handle.remove()
    return {op: calls.names.count(op) for op in (name, "exp")}


RUNNABLE_ON_CPU = KEPT_OPS[:6]


@pytest.mark.parametrize("name", RUNNABLE_ON_CPU)
def test_selective_keeps_the_output_of_each_costly_op(name):
    plain = _backward_calls(name, None)
    full = _backward_calls(name, "torch")
    selective = _backward_calls(name, "selective")
    assert plain["exp"] == 0
    assert full[name] == plain[name] + 1 and full["exp"] == 1  # the block is really recomputed in the backward
    assert selective["exp"] == 1  # ...the cheap op again under "selective"...
    assert selective[name] == plain[name]  # ...but not the costly one: its output was kept


@pytest.mark.parametrize("name", KEPT_OPS)
def test_selective_policy_must_save_each_costly_op(name):
    # the CUDA attention ops cannot run on a CPU build: the policy's answer for each is checked directly
    from torch.utils.checkpoint import CheckpointPolicy

    from memkit.optimizations.checkpointing import _selective_policy

    op = getattr(torch.ops.aten, name).default
    assert _selective_policy(None, op) == CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, torch.ops.aten.sin.default) == CheckpointPolicy.PREFER_RECOMPUTE
