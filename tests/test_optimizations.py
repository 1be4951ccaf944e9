"""The registry every optimization is known by, and the contract every registered one keeps."""

import dataclasses

import pytest
import torch

import memkit
from memkit.optimizations import REGISTRY, Spec, parse, register, spec_of
from memkit.step import Step, model_output

# `make test-fast` keeps each optimization on Flux (tests/conftest.py); `make test` and CI run the UNet too
FAST_CASES = {
    "test_apply_step_remove_leaves_the_model_bit_identical": {
        f"{name}-flux" for name in ("checkpointing", "ema", "ff-split", "fsdp", "lora", "offload", "quantize")
    }
}

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
SPECS = sorted(REGISTRY)
MODELS = ["flux", "unet"]  # a transformer and the UNet: different block structures


def _snapshot(model: torch.nn.Module) -> dict:
    """Everything `remove()` must restore: the module tree, the state_dict bits, flags and hooks."""
    return {
        "tree": [(name, type(m).__name__) for name, m in model.named_modules()],
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "attrs": [
            sorted(
                (k, repr(v)) for k, v in vars(m).items() if not k.startswith(("_parameters", "_buffers", "_modules"))
            )
            for m in model.modules()
        ],
        "forward": [type(m).forward for m in model.modules()],
        "instance_forward": [m.__dict__.get("forward") for m in model.modules()],
    }


def _outputs(model, inputs):
    with torch.no_grad():
        return model_output(model(**inputs)).clone()


@pytest.mark.parametrize("preset", MODELS)
@pytest.mark.parametrize("name", SPECS)
def test_apply_step_remove_leaves_the_model_bit_identical(name, preset):
    spec = REGISTRY[name]
    for value in spec.choices:
        model = memkit.load_model(preset)
        inputs = memkit.make_inputs(model)
        before, out_before = _snapshot(model), _outputs(model, inputs)
        with spec.parse(value).apply(model) as handle:
            Step().bind(model, handle).run(inputs)  # gradients only: the weights stay
        model.zero_grad(set_to_none=True)
        after = _snapshot(model)
        assert after["tree"] == before["tree"]
        assert after["state"].keys() == before["state"].keys()
        for k, v in before["state"].items():
            assert torch.equal(after["state"][k], v), k
        assert after["attrs"] == before["attrs"]
        assert after["forward"] == before["forward"] and after["instance_forward"] == before["instance_forward"]
        assert torch.equal(_outputs(model, inputs), out_before)


@pytest.mark.parametrize("name", SPECS)
def test_every_spec_names_itself_consistently(name):
    spec = REGISTRY[name]
    assert spec.name == name
    assert dataclasses.is_dataclass(spec.config) and spec.config.__dataclass_params__.frozen
    for field in dataclasses.fields(spec.config):
        assert field.kw_only, f"{spec.config.__name__}.{field.name} must be keyword-only"
    for value in spec.choices:
        config = spec.parse(value)
        assert isinstance(config, spec.config)
        assert str(config) == f"{name}:{value}"
        assert parse(str(config)) == config
        model = memkit.load_model("dit")
        with config.apply(model) as handle:
            assert handle.name == str(config)
    assert parse(name) == spec.default
    assert spec.summary and spec.metavar
    assert set(spec.report) <= set(spec.choices)


def test_checkpointing_is_registered_with_its_patterns():
    spec = REGISTRY["checkpointing"]
    assert spec.config is memkit.Checkpointing
    assert parse("checkpointing:all") == memkit.Checkpointing(pattern="all")


def test_fsdp_is_registered_as_an_estimate_only_entry():
    spec = REGISTRY["fsdp"]
    assert spec.config is memkit.FSDP and spec_of(memkit.FSDP(world_size=2)) is spec
    assert parse("fsdp:4,cpu-offload") == memkit.FSDP(world_size=4, cpu_offload=True)
    assert parse("fsdp") == memkit.FSDP(world_size=8)
    assert "rank 0" in spec.estimate_only and not spec.report  # memkit report compares real runs
    assert all(not s.estimate_only for n, s in REGISTRY.items() if n != "fsdp")
    assert list(REGISTRY).index("fsdp") < list(REGISTRY).index("ema")  # an EMA's shadows live on the shards
    assert spec_of(object()) is None
    with pytest.raises(ValueError, match="spec.report must be empty"):
        register(dataclasses.replace(spec, name="sharded", report=("8",)))
    assert "sharded" not in REGISTRY


def test_parse_and_register_refuse_bad_input_by_name():
    with pytest.raises(ValueError, match="unknown optimization 'nosuch'; registered: quantize, lora, checkpointing"):
        parse("nosuch:0.999")
    with pytest.raises(ValueError, match="pattern must be one of"):
        parse("checkpointing:sometimes")
    with pytest.raises(TypeError, match="text must be a string"):
        parse(3)
    with pytest.raises(ValueError, match="registered already"):
        register(REGISTRY["checkpointing"])
    spec = dataclasses.replace(REGISTRY["checkpointing"], name="Bad Name")
    with pytest.raises(ValueError, match="lowercase word"):
        register(spec)
    with pytest.raises(ValueError, match="at least one value"):
        register(dataclasses.replace(REGISTRY["checkpointing"], name="empty", choices=()))
    with pytest.raises(TypeError, match="spec must be"):
        register({"name": "x"})
    assert "Bad Name" not in REGISTRY and "empty" not in REGISTRY  # nothing half-registered
    with pytest.raises(TypeError):
        REGISTRY["x"] = Spec  # read-only view


def _fresh_registry(monkeypatch):
    """register() into a copy of the registry, thrown away after the test."""
    import memkit.optimizations as opt

    monkeypatch.setattr(opt, "_REGISTRY", dict(opt._REGISTRY))
    return opt


def test_a_new_spec_is_parsed_by_its_name_dashes_included(monkeypatch):
    opt = _fresh_registry(monkeypatch)
    spec = dataclasses.replace(REGISTRY["checkpointing"], name="re-compute", report=())
    assert opt.register(spec) is spec
    assert opt.parse("re-compute") == memkit.Checkpointing()
    assert opt.parse("re-compute:every:2") == memkit.Checkpointing(pattern="every:2")
    assert "re-compute" not in REGISTRY  # the copy only


@pytest.mark.parametrize("name", ["", "UPPER", "Mixed", "a1", "two words", "-"])
def test_a_spec_name_must_be_a_lowercase_word(name, monkeypatch):
    opt = _fresh_registry(monkeypatch)
    with pytest.raises(ValueError, match=f"spec.name must be a lowercase word \\(dashes allowed\\), got {name!r}"):
        opt.register(dataclasses.replace(REGISTRY["checkpointing"], name=name))


def test_a_spec_names_only_fields_its_config_has_and_a_known_section():
    spec = REGISTRY["checkpointing"]
    with pytest.raises(ValueError, match=r"spec.panel names \['colour'\], not fields of Checkpointing"):
        register(dataclasses.replace(spec, name="painted", panel=("pattern", "colour")))
    with pytest.raises(ValueError, match=r"spec.field_choices names \['colour'\], not fields of Checkpointing"):
        register(dataclasses.replace(spec, name="painted", field_choices={"colour": ("red",)}))
    with pytest.raises(ValueError, match="section must be 'optimizations' or 'fine-tuning', got 'other'"):
        dataclasses.replace(spec, section="other")
    assert "painted" not in REGISTRY


def test_bad_values_name_the_type_or_the_choices():
    spec = REGISTRY["checkpointing"]
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match=r"checkpointing needs a value, one of \['all', 'every:2', .*got "):
            spec.parse(bad)
    with pytest.raises(TypeError, match="text must be a string such as 'checkpointing:all', got int"):
        parse(3)
    with pytest.raises(TypeError, match="spec must be a memkit.optimizations.Spec, got dict"):
        register({"name": "x"})
    assert parse("checkpointing:") == spec.default == memkit.Checkpointing()


def test_a_spec_takes_either_section_and_freezes_its_field_choices():
    spec = REGISTRY["checkpointing"]
    assert dataclasses.replace(spec, section="fine-tuning").section == "fine-tuning"
    assert dataclasses.replace(spec, section="optimizations").section == "optimizations"
    given = {"pattern": ["all", "every:2"]}
    choices = dataclasses.replace(spec, field_choices=given).field_choices
    assert dict(choices) == {"pattern": ("all", "every:2")}  # lists become tuples
    given["pattern"].append("none")  # the spec keeps its own copy
    assert choices["pattern"] == ("all", "every:2")
    with pytest.raises(TypeError):
        choices["provider"] = ("torch",)  # read-only
