import re
import warnings

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


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
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


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
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


# ---- fast behaviour on a plain stack of blocks -------------------------------------------------------------------


def _stack_grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.pow(2).sum().backward()
    return out.detach(), [p.grad for p in model.parameters()]


def _provider(provider: str, monkeypatch) -> str:
    """The provider to configure: "offload-moving" is "offload" with the kept inputs really moved to a separate copy
    (see test_checkpointing_offload), where on the CPU they would stay put."""
    if provider != "offload-moving":
        return provider
    from memkit.optimizations import checkpointing as ck

    monkeypatch.setattr(ck, "_offload_target", lambda device: torch.device("cpu"))
    return "offload"


@pytest.mark.parametrize("provider", ["torch", "selective", "offload", "offload-moving"])
def test_a_checkpointed_block_is_non_reentrant(provider, monkeypatch):
    # Non-reentrant checkpointing gives a block's weights their gradients even when its input needs none (the
    # first block's input, a batch); the reentrant one (torch's default when use_reentrant is not passed, with a
    # warning) returns an output that needs no gradient, and the weights get none.
    provider = _provider(provider, monkeypatch)
    torch.manual_seed(0)
    model, x = _Stack(3), torch.randn(4, 8)
    ref_out, ref = _stack_grads(model, x)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with memkit.Checkpointing(provider=provider).apply(model):
            out, got = _stack_grads(model, x)
    assert not [str(w.message) for w in said if "reentrant" in str(w.message) or "requires_grad" in str(w.message)]
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, r in zip(got, ref, strict=True):
        assert g is not None
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


# Which of 5 blocks each pattern names, written out from the pattern's definition (Checkpointing.pattern).
FIVE_BLOCKS = [
    ("all", [0, 1, 2, 3, 4]),
    ("none", []),
    ("every:1", [0, 1, 2, 3, 4]),
    ("every:2", [0, 2, 4]),
    ("every:3", [0, 3]),
    ("every:7", [0]),
    ("skip-every:1", []),
    ("skip-every:2", [1, 3]),
    ("skip-every:3", [1, 2, 4]),
    ("first:1", [0]),
    ("first:2", [0, 1]),
    ("first:5", [0, 1, 2, 3, 4]),
    ("last:1", [4]),
    ("last:2", [3, 4]),
    ("last:5", [0, 1, 2, 3, 4]),
    ((4, 0), [0, 4]),
    ((), []),
    ([2], [2]),
    (_every_other, [1, 3]),
]


@pytest.mark.parametrize(
    ("pattern", "chosen"), FIVE_BLOCKS, ids=[getattr(p, "__name__", str(p)) for p, _ in FIVE_BLOCKS]
)
def test_each_pattern_form_names_its_blocks(pattern, chosen):
    model = _Stack(5)
    config = memkit.Checkpointing(pattern=pattern)
    assert config.select(model) == [(f"blocks.{i}", i in chosen) for i in range(5)]
    with config.apply(model):  # the blocks named are the ones wrapped, and only while applied
        assert [i for i, b in enumerate(model.blocks) if "forward" in vars(b)] == chosen
    assert not any("forward" in vars(b) for b in model.blocks)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("first:6", "pattern 'first:6' names 6 blocks, but the model has 5"),
        ("last:6", "pattern 'last:6' names 6 blocks, but the model has 5"),
        ((5,), "pattern names blocks [5] that do not exist: the model has 5 blocks (0..4)"),
        ((-1,), "pattern names blocks [-1] that do not exist: the model has 5 blocks (0..4)"),
        ((0, -5, 7), "pattern names blocks [-5, 7] that do not exist: the model has 5 blocks (0..4)"),
    ],
)
def test_a_pattern_naming_blocks_the_model_lacks_is_refused(pattern, message):
    model = _Stack(5)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        memkit.Checkpointing(pattern=pattern).apply(model)
    assert not any("forward" in vars(b) for b in model.blocks)  # nothing half-applied


def test_pattern_values_are_checked_when_the_config_is_made():
    for bad in ((True,), ("0",), (0, 1.0)):
        with pytest.raises(TypeError, match="got tuple"):
            memkit.Checkpointing(pattern=bad)
    with pytest.raises(TypeError, match="got float"):
        memkit.Checkpointing(pattern=2.5)
    with pytest.raises(ValueError, match=r"one of \['none', 'all', 'every:N', 'skip-every:N', 'first:K'"):
        memkit.Checkpointing(pattern="last:0")
    with pytest.raises(TypeError, match="blocks must be the name of an nn.ModuleList or None, got int"):
        memkit.Checkpointing(blocks=3)
    with pytest.raises(ValueError, match=r"provider must be one of \['torch', 'selective', 'offload'\], got 'x'"):
        memkit.Checkpointing(budget_bytes=2**30, provider="x")
    assert memkit.Checkpointing(blocks="blocks", provider="offload").provider == "offload"


def test_a_budget_is_a_positive_int_given_instead_of_a_pattern():
    for bad in (0, -1, 1.5, True, "1GiB"):
        with pytest.raises(ValueError, match=f"budget_bytes must be a positive int \\(bytes\\) or None, got {bad!r}"):
            memkit.Checkpointing(budget_bytes=bad)
    assert memkit.Checkpointing(budget_bytes=1).pattern == "auto"
    assert memkit.Checkpointing(pattern="auto", budget_bytes=1) == memkit.Checkpointing(budget_bytes=1)
    with pytest.raises(ValueError, match="give a pattern or budget_bytes, not both: pattern='every:2' with"):
        memkit.Checkpointing(pattern="every:2", budget_bytes=2**30)
    with pytest.raises(ValueError, match="pattern='auto' needs budget_bytes="):
        memkit.Checkpointing(pattern="auto")


def test_plan_needs_a_budget_and_a_diffusers_model():
    with pytest.raises(ValueError, match=r"^plan\(\) needs budget_bytes=, the memory budget to fit \(bytes\)$"):
        memkit.Checkpointing().plan(_Stack(2))
    budget = memkit.Checkpointing(budget_bytes=2**30)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        budget.plan("flux")
    no_config = (
        "budget_bytes plans on a fake copy built from a diffusers model's config; _Stack has none: call "
        "memkit.plan_checkpointing(lambda: build_model(), budget_bytes, inputs=...) and apply its plan.config"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(no_config)}$"):
        budget.plan(_Stack(2))
    with pytest.raises(TypeError, match=f"^{re.escape(no_config)}$"):
        budget.apply(_Stack(2))
    configured = _Stack(2)
    configured.config = {"blocks": 2}  # a config, but no class method to build from it
    with pytest.raises(TypeError, match="_Stack has none"):
        budget.plan(configured)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        memkit.Checkpointing().apply(3)


def test_apply_restores_a_forward_the_block_had_of_its_own():
    model = _Stack(3)
    own = model.blocks[1].forward  # a bound method stored on the instance, as a hook library would
    model.blocks[1].forward = own
    with memkit.Checkpointing().apply(model):
        assert all(b.forward is not own for b in model.blocks)
    assert vars(model.blocks[1])["forward"] is own
    assert "forward" not in vars(model.blocks[0]) and "forward" not in vars(model.blocks[2])


def test_remove_restores_a_diffusers_models_own_checkpointing_function():
    model = memkit.load_model("flux")
    calls = []

    def mine(module, *args, **kwargs):
        calls.append(module)
        return module(*args, **kwargs)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=mine)
    with memkit.Checkpointing(pattern="first:1").apply(model):
        assert model.is_gradient_checkpointing
    flags = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    assert all(m.gradient_checkpointing and m._gradient_checkpointing_func is mine for m in flags)
    memkit.train_step(model, memkit.make_inputs(model))
    assert calls  # the model runs its own function again


def test_parse_takes_a_string_and_defaults_to_torch():
    with pytest.raises(TypeError, match="value must be a string such as 'every:2' or 'all@selective', got int"):
        memkit.Checkpointing.parse(2)
    assert memkit.Checkpointing.parse("first:2").provider == "torch"
    assert memkit.Checkpointing.parse("last:1@offload") == memkit.Checkpointing(pattern="last:1", provider="offload")


def test_str_names_the_pattern_and_any_provider_but_torch():
    from functools import partial

    from memkit.units import format_bytes

    assert str(memkit.Checkpointing()) == "checkpointing:all"
    assert str(memkit.Checkpointing(provider="offload")) == "checkpointing:all@offload"
    assert str(memkit.Checkpointing(pattern=_every_other)) == "checkpointing:_every_other"
    assert str(memkit.Checkpointing(pattern=partial(_every_other))) == "checkpointing:custom"
    budget = 3 * 2**30
    assert " " in format_bytes(budget)
    assert str(memkit.Checkpointing(budget_bytes=budget)) == (
        f"checkpointing:auto<={format_bytes(budget).replace(' ', '')}"
    )


def _stand_in_planner(monkeypatch, peak: int) -> list:
    """memkit.plan_checkpointing replaced by one that records what it is asked and plans block 0, at ``peak``."""
    import memkit.planning as planning

    asked = []

    def plan_checkpointing(model, budget_bytes, **kwargs):
        asked.append((model(), budget_bytes, kwargs))
        config = memkit.Checkpointing(pattern=(0,), provider=kwargs["provider"])
        return planning.CheckpointPlan(
            config=config, predicted_peak_bytes=peak, budget_bytes=budget_bytes, blocks=2, checkpointed=1, tried=()
        )

    monkeypatch.setattr(planning, "plan_checkpointing", plan_checkpointing)
    return asked


def test_a_budget_plans_on_a_fresh_copy_with_the_models_dtype_and_device(monkeypatch):
    asked = _stand_in_planner(monkeypatch, peak=100)
    model = memkit.load_model("flux").to(torch.bfloat16)
    config = memkit.Checkpointing(budget_bytes=1000, provider="selective")
    assert config.plan(model).config == memkit.Checkpointing(pattern=(0,), provider="selective")
    config.plan(model, device="cuda", frames=9)
    (copy, budget, kwargs), (_, _, overridden) = asked
    assert type(copy) is type(model) and copy is not model and copy.config == model.config
    assert budget == 1000
    assert kwargs == {"provider": "selective", "dtype": torch.bfloat16, "device": "cpu"}
    assert overridden == {"provider": "selective", "dtype": torch.bfloat16, "device": "cuda", "frames": 9}


def test_a_budget_applies_and_selects_the_plans_blocks(monkeypatch):
    _stand_in_planner(monkeypatch, peak=100)
    model = memkit.load_model("flux")
    config = memkit.Checkpointing(budget_bytes=1000)
    names = [name for name, _ in memkit.Checkpointing().select(model)]
    assert config.select(model) == [(name, i == 0) for i, name in enumerate(names)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it fits: nothing to say
        with config.apply(model) as handle:
            assert handle.name == "checkpointing:0" and model.is_gradient_checkpointing
    assert not model.is_gradient_checkpointing


def test_a_budget_that_does_not_fit_says_so(monkeypatch):
    _stand_in_planner(monkeypatch, peak=2000)
    model = memkit.load_model("flux")
    with pytest.warns(UserWarning, match="budget_bytes: checkpointing:0: .* does NOT fit") as said:
        memkit.Checkpointing(budget_bytes=1000).apply(model).remove()
    assert len(said) == 1


class _ScaledStack(torch.nn.Module):
    """Blocks called with a keyword argument, as diffusers' blocks are (``temb=``, ``attention_mask=``...)."""

    def __init__(self, n: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ScaledBlock() for _ in range(n))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x, scale=float(i + 2))
        return x


class _ScaledBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return torch.tanh(self.linear(x)) * scale


@pytest.mark.parametrize("provider", ["torch", "selective", "offload", "offload-moving"])
def test_keyword_arguments_reach_a_checkpointed_block_with_and_without_grad(provider, monkeypatch):
    provider = _provider(provider, monkeypatch)
    torch.manual_seed(0)
    model, x = _ScaledStack(3), torch.randn(4, 8)
    ref_out, ref = _stack_grads(model, x)
    with torch.no_grad():
        ref_no_grad = model(x)
    config = memkit.Checkpointing(pattern="every:2", provider=provider)
    with config.apply(model) as handle:
        assert handle.name == str(config)
        out, got = _stack_grads(model, x)
        with torch.no_grad():
            no_grad = model(x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(no_grad, ref_no_grad, rtol=0, atol=0)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


class _Weightless(torch.nn.Module):
    """A model built from a config, with no weights of its own."""

    config = {"blocks": 0}

    @classmethod
    def from_config(cls, config):
        return cls()


def test_a_budget_for_a_weightless_model_plans_with_the_planners_defaults(monkeypatch):
    asked = _stand_in_planner(monkeypatch, peak=100)
    memkit.Checkpointing(budget_bytes=1000).plan(_Weightless(), frames=9)
    [(copy, _, kwargs)] = asked
    assert isinstance(copy, _Weightless) and kwargs == {"provider": "torch", "frames": 9}


class _OnCuda(_Weightless):
    """A model built from a config, its weight a fake CUDA tensor (no GPU needed: nothing is allocated)."""

    def __init__(self):
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            self.weight = torch.nn.Parameter(torch.empty(2, dtype=torch.float16, device="cuda"))


def test_a_budget_for_a_model_on_cuda_plans_for_cuda(monkeypatch):
    asked = _stand_in_planner(monkeypatch, peak=100)
    memkit.Checkpointing(budget_bytes=1000).plan(_OnCuda())
    [(copy, _, kwargs)] = asked
    assert isinstance(copy, _OnCuda) and kwargs == {"provider": "torch", "dtype": torch.float16, "device": "cuda"}
