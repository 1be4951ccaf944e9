"""Quantized base weights: the bytes bitsandbytes itself keeps, estimates equal to tracked real QLoRA steps, the
full-size storage equal to the library's layout, and the refusals.

The oracle for storage is the library run independently of memkit, the way diffusers loads a quantized checkpoint
(``replace_with_bnb_linear``, then ``Params4bit(weight).to(device)``, which quantizes); the oracle for memory is a
real CPU step tracked by the same tracker.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import memkit
from memkit.handle import apply_all
from memkit.optimizations import REGISTRY, parse
from memkit.optimizations.quantization import METHODS, Quantize

# `make test-fast` keeps a bitsandbytes and a storage-cast base (tests/conftest.py); every method runs in `make test`
FAST_CASES = {"test_qlora_estimate_equals_the_real_tracked_steps": {"nf4", "fp8-storage"}}

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

FOUR_BIT = ["nf4", "nf4-dq", "fp4"]


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def library_parameter_bytes(preset: str, method: str, dtype: torch.dtype = torch.float32) -> int:
    """The parameter bytes of ``preset`` (tiny, in ``dtype``) quantized by diffusers and bitsandbytes without memkit:
    the model's parameters (packed codes for the 4-bit layers) and every 4-bit layer's quant state tensors."""
    from diffusers import BitsAndBytesConfig
    from diffusers.quantizers.bitsandbytes.utils import replace_with_bnb_linear

    model = memkit.load_model(preset, dtype=dtype)
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="fp4" if method == "fp4" else "nf4",
        bnb_4bit_use_double_quant=method == "nf4-dq",
        bnb_4bit_compute_dtype=dtype,
    )
    old = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    keep = list(type(model)._keep_in_fp32_modules or [])
    replace_with_bnb_linear(model, modules_to_not_convert=keep, quantization_config=config)
    states = []
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):  # diffusers' create_quantized_param, then the bias
            kwargs = module.weight.__dict__
            module.weight = bnb.nn.Params4bit(old[name].weight.data, requires_grad=False, **kwargs).to("cpu")
            module.bias = old[name].bias
            qs = module.weight.quant_state
            states += [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
    assert states
    return _unique_bytes([*model.parameters(), *states])


@pytest.mark.parametrize("method", FOUR_BIT)
@pytest.mark.parametrize("preset", ["flux", "sd3"])
def test_storage_equals_the_librarys_own_bytes(preset, method):
    want = library_parameter_bytes(preset, method)
    # real: memkit's quantized model, its parameters and what the handle owns, tracked
    model = memkit.load_model(preset)
    with Quantize(method=method).apply(model) as handle, memkit.track(model, owned=handle) as real:
        pass
    assert real.baseline_by_category["parameter"] == want
    # fake: the estimate holds the same bytes
    est = memkit.estimate(
        preset, size="tiny", mode="inference", device="cpu", dtype=torch.float32,
        optimizations=[Quantize(method=method)], progress=False,
    )  # fmt: skip
    assert est.baseline_by_category["parameter"] == want


def torchao_parameter_bytes(preset: str, method: str) -> int:
    """The parameter bytes of ``preset`` (tiny, fp32) after torchao's own ``quantize_`` on its linear layers: the
    inner tensors of each weight-only tensor (int8 or float8 data, scales, zero points) and the other parameters."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    model = memkit.load_model(preset)
    quantize_(model, Int8WeightOnlyConfig() if method == "int8wo" else Float8WeightOnlyConfig())
    tensors = []
    for p in model.parameters():
        if is_traceable_wrapper_subclass(p):
            tensors += [getattr(p, name) for name in p.__tensor_flatten__()[0]]
        else:
            tensors.append(p)
    return _unique_bytes(tensors)


@pytest.mark.parametrize("method", ["int8wo", "float8wo"])
def test_torchao_storage_equals_the_librarys_own_bytes(method):
    want = torchao_parameter_bytes("flux", method)
    est = memkit.estimate(
        "flux", size="tiny", mode="inference", device="cpu", dtype=torch.float32,
        optimizations=[Quantize(method=method)], progress=False,
    )  # fmt: skip
    assert est.baseline_by_category["parameter"] == want


def test_fp8_storage_is_one_byte_per_cast_weight():
    import re

    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    model = memkit.load_model("flux")
    cast = [m for m in model.modules() if isinstance(m, nn.Linear)]
    patterns = (*DEFAULT_SKIP_MODULES_PATTERN, *(type(model)._skip_layerwise_casting_patterns or ()))
    skipped = [
        m for n, m in model.named_modules() if isinstance(m, nn.Linear) and any(re.search(p, n) for p in patterns)
    ]
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    with Quantize(method="fp8-storage").apply(model):
        after = sum(p.numel() * p.element_size() for p in model.parameters())
        assert {m.weight.dtype for m in cast if all(m is not s for s in skipped)} == {torch.float8_e4m3fn}
        assert skipped and {m.weight.dtype for m in skipped} == {torch.float32}  # diffusers' patterns (norm...)
    saved = sum(m.weight.numel() * 3 + (m.bias.numel() * 3 if m.bias is not None else 0) for m in cast
                if all(m is not s for s in skipped))  # fmt: skip
    assert before - after == saved


def test_fake_module_to_in_place_keeps_the_parameter_objects():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memkit._torch_compat import fake_module_to_in_place

    with FakeTensorMode(), fake_module_to_in_place():
        layer = nn.Linear(4, 2)
        weight = layer.weight
        assert layer.to(torch.float8_e4m3fn).weight is weight and weight.dtype == torch.float8_e4m3fn
    assert nn.Linear(4, 2).to(torch.float16).weight.dtype == torch.float16  # real modules: torch's own


def test_fsdp_refuses_a_quantized_base():
    with pytest.raises(ValueError, match="cannot go with memkit.FSDP"):
        memkit.estimate(
            "flux", size="tiny", optimizations=[Quantize(), memkit.LoRA()], parallel=memkit.FSDP(world_size=2)
        )


def test_a_bf16_estimate_holds_the_bytes_of_a_bf16_model_quantized_in_a_script():
    # an estimate builds its model under a bf16 default dtype; bitsandbytes' codes are float32 in a script
    want = library_parameter_bytes("flux", "nf4-dq", torch.bfloat16)
    est = memkit.estimate(
        "flux", size="tiny", mode="inference", device="cpu", dtype=torch.bfloat16,
        optimizations=[Quantize(method="nf4-dq")], progress=False,
    )  # fmt: skip
    assert est.baseline_by_category["parameter"] == want


def _real_steps(preset, optimizations, n=2):
    from oracles import tracked_steps

    torch.manual_seed(0)
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    with apply_all(model, optimizations) as handle:
        runner = memkit.Step(optimizer="adamw", steps=1).bind(model, handle)
        return tracked_steps(runner, inputs, n)


@pytest.mark.parametrize("method", METHODS)
def test_qlora_estimate_equals_the_real_tracked_steps(method):
    opts = [Quantize(method=method), memkit.LoRA(rank=4)]
    first, second = _real_steps("flux", opts)
    est = memkit.estimate(
        "flux", size="tiny", device="cpu", dtype=torch.float32, optimizations=opts, progress=False
    )  # fmt: skip
    assert est.meta["first_step_peak_bytes"] == first.peak_bytes
    assert est.meta["steady_peak_bytes"] == second.peak_bytes
    assert est.baseline_by_category == first.baseline_by_category


def test_the_4bit_forward_dequantizes_a_weight_sized_temporary_the_tracker_sees():
    # bitsandbytes' gemm_4bit dequantizes the whole weight in the compute dtype before its matmul (its Python
    # kernel, on CPU and CUDA alike): one layer's forward peaks at its output plus that weight
    layer = nn.Sequential(nn.Linear(512, 256, bias=False))
    Quantize(method="nf4").apply(layer)
    x = torch.randn(4, 512)
    with memkit.track(inputs={"x": x}) as tl, torch.no_grad():
        layer(x)
    assert tl.peak_bytes - tl.baseline_bytes == 512 * 256 * 4 + 4 * 256 * 4


def _meta_flux():
    import accelerate
    import diffusers

    spec = memkit.PRESETS["flux"]
    with accelerate.init_empty_weights():
        return getattr(diffusers, spec.model_class)(**spec.configs["full"])


def layout_bytes(model: nn.Module, method: str, dtype_bytes: int = 2) -> int:
    """bitsandbytes' 4-bit layout (blocksize 64): per quantized weight of n elements ceil(n/2) bytes of packed codes
    and the 16-entry fp32 code; fp32 absmax per block, or with double quantization a uint8 absmax per block, an fp32
    constant per 256 blocks, an fp32 offset and the layer's own copy of the 256-entry fp32 dynamic map
    (``quantize_blockwise`` stores ``code.to(device, copy=True)``). Everything else (biases, norms, embeddings kept
    whole) in the model's dtype."""
    total, other = 0, sum(p.numel() for p in model.parameters()) * dtype_bytes
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        n = module.weight.numel()
        blocks = math.ceil(n / 64)
        total += math.ceil(n / 2) + 16 * 4
        total += blocks + 4 * math.ceil(blocks / 256) + 4 + 256 * 4 if method == "nf4-dq" else 4 * blocks
        other -= n * dtype_bytes
    return total + other


@pytest.mark.slow  # full Flux, every block (bitsandbytes is not memoized): ~30 s each
@pytest.mark.parametrize("method", ["nf4", "nf4-dq"])
def test_full_flux_storage_equals_the_librarys_layout(method):
    tl = memkit.estimate(
        "flux", mode="inference", device="cpu", optimizations=[Quantize(method=method)], progress=False,
        height=256, width=256,
    )  # fmt: skip
    want = layout_bytes(_meta_flux(), method)
    assert tl.baseline_by_category["parameter"] == want
    # 11.9B weights, 22.17 GiB in bf16: nf4 6.24 GiB, nf4-dq 5.72 GiB
    assert want == {"nf4": 6_699_009_664, "nf4-dq": 6_144_698_752}[method]


@pytest.mark.extended  # full Flux QLoRA through the CLI, every block: ~40 s; the flag's parsing is tested fast
def test_the_cli_estimates_full_flux_qlora(capsys):
    import json

    from memkit.cli import main

    assert main(["estimate", "flux", "--quantize", "nf4", "--lora", "16", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizations"] == ["quantize:nf4", "lora:16"] and out["peak_bytes"] > 6 * 2**30
    # the 4-bit weights counted as weights (not as their packed bytes), beside the adapters
    assert out["parameters"] == sum(p.numel() for p in _meta_flux().parameters()) + out["trainable_parameters"]


def test_training_a_quantized_base_without_adapters_is_refused():
    model = memkit.load_model("flux")
    with Quantize().apply(model) as handle:
        with pytest.raises(ValueError, match=r"fully fine-tune a quantized base.*memkit.LoRA"):
            memkit.Step(optimizer="adamw").bind(model, handle)
        memkit.Step(mode="inference").bind(model, handle)  # inference is what it is for
    with pytest.raises(ValueError, match="fully fine-tune"):
        memkit.estimate("flux", size="tiny", optimizations=[Quantize()], progress=False)


def test_quantizing_twice_or_after_lora_is_refused_and_leaves_the_model_unchanged():
    model = memkit.load_model("flux")
    tree = [(n, type(m)) for n, m in model.named_modules()]
    with Quantize().apply(model):
        inner = [(n, type(m)) for n, m in model.named_modules()]
        for method in ("nf4", "fp8-storage"):
            with pytest.raises(ValueError, match="quantized already"):
                Quantize(method=method).apply(model)
        assert [(n, type(m)) for n, m in model.named_modules()] == inner
    assert [(n, type(m)) for n, m in model.named_modules()] == tree
    with memkit.LoRA(rank=4).apply(model), pytest.raises(ValueError, match="before memkit.LoRA"):
        Quantize().apply(model)


def test_a_failure_inside_the_library_undoes_everything(monkeypatch):
    model = memkit.load_model("flux")
    tree = [(n, type(m)) for n, m in model.named_modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def boom(self, device=None, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("inside bitsandbytes")
        return original(self, device, *args, **kwargs)

    original = bnb.nn.Params4bit._quantize
    monkeypatch.setattr(bnb.nn.Params4bit, "_quantize", boom)
    with pytest.raises(RuntimeError, match="inside bitsandbytes"):
        Quantize().apply(model)
    assert [(n, type(m)) for n, m in model.named_modules()] == tree
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert "is_loaded_in_4bit" not in model.__dict__


def test_bad_input_names_the_argument_and_lists_the_methods():
    with pytest.raises(ValueError, match=r"method must be one of \['nf4', 'nf4-dq', 'fp4'"):
        Quantize(method="int4")
    for kwargs, word in ((dict(compute_dtype=torch.int8), "compute_dtype"), (dict(fp8="e3m4"), "fp8"),
                         (dict(skip="norm"), "skip")):  # fmt: skip
        with pytest.raises(ValueError, match=word):
            Quantize(**kwargs)
    for text in ("quantize:nf4:colour=red", "quantize:nf4:compute=float99"):
        with pytest.raises(ValueError, match="quantize"):
            parse(text)
    with pytest.raises(ValueError, match="method must be one of"):
        parse("quantize:int3")


def test_parse_and_str_round_trip_and_registry_order():
    for text in ("quantize:nf4", "quantize:nf4-dq:compute=bfloat16", "quantize:fp8-storage:e5m2:skip=proj_out"):
        assert str(parse(text)) == text
    assert set(REGISTRY["quantize"].choices) <= set(METHODS)
    assert list(REGISTRY).index("quantize") < list(REGISTRY).index("lora")  # the base is quantized, then adapted


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("method", ["nf4", "nf4-dq"])
def test_the_tracker_sees_what_the_allocator_sees_in_a_4bit_layer(method, training):
    # the adapter's check against bitsandbytes' own numbers: torch's profiler counts every allocation of its kernels,
    # the weight gemm_4bit dequantizes inside included (without the adapter the forward's peak is 512 KiB short)
    from oracles import assert_equals_profiler, tracked_and_profiled

    layer = nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 128))
    Quantize(method=method).apply(layer)
    x = torch.randn(8, 512, requires_grad=training)

    def step():
        if training:
            layer(x).float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                layer(x)

    step()  # bitsandbytes' and torch's first-call caches out of the window
    x.grad = None
    tl, (peak, end) = tracked_and_profiled(step, inputs={"x": x})
    assert_equals_profiler(tl, peak, end)


def test_compare_measures_qlora_and_says_its_outputs_differ_by_the_quantization():
    cmp = memkit.compare(
        "flux", {"qlora": [Quantize(), memkit.LoRA(rank=4)]}, step=memkit.Step(optimizer="adamw"), repeats=0,
        progress=False,
    )  # fmt: skip
    base, qlora = cmp.results["baseline"], cmp.results["qlora"]
    assert qlora.timeline.peak_bytes < base.timeline.peak_bytes / 4
    assert not qlora.passed and qlora.max_abs_d_output > 0  # 4-bit weights: not the baseline's outputs
    assert qlora.max_abs_d_param == 0  # the weights kept whole (norms, biases) end the step as they began


def test_qlora_apply_step_remove_restores_the_model_bit_for_bit():
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = memkit.step.model_output(model(**inputs)).clone()
    for method in METHODS:
        with apply_all(model, [Quantize(method=method), memkit.LoRA(rank=4)]) as handle:
            memkit.Step(optimizer="adamw").bind(model, handle).run(inputs)
        assert model.state_dict().keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()), method
        assert not any(k in model.__dict__ for k in ("is_loaded_in_4bit", "is_loaded_in_8bit", "_memkit_quantized"))
        with torch.no_grad():
            assert torch.equal(memkit.step.model_output(model(**inputs)), before), method


# full Flux twice (spliced and every block, ~25 s each case): in `make test-extended`; CI splices both methods at a
# smaller depth (tests/test_memo.py::test_every_setting, "fp8-storage-lora" and "int8wo-lora")
@pytest.mark.extended
@pytest.mark.parametrize("method", ["fp8-storage", "int8wo"])
def test_full_flux_memoized_estimate_equals_every_block(method):
    # layerwise casting and torchao keep their state in the parameters themselves: spliced from a probe of blocks
    # (bitsandbytes' quant states are tensors beside the parameters: its estimates run every block)
    opts = [Quantize(method=method), memkit.LoRA(rank=16)]
    kwargs = dict(optimizations=opts, progress=False, height=256, width=256)
    memo, every = memkit.estimate("flux", **kwargs), memkit.estimate("flux", memoize=False, **kwargs)
    assert memo.meta["memoized"] and not every.meta["memoized"]
    for key in ("first_step_peak_bytes", "steady_peak_bytes", "parameters", "trainable_parameters"):
        assert memo.meta[key] == every.meta[key], key
    assert memo.baseline_by_category == every.baseline_by_category
    assert not memkit.estimate("flux", size="tiny", optimizations=[Quantize(), memkit.LoRA()], progress=False).meta[
        "memoized"
    ]


def test_a_library_version_without_the_method_names_the_version_needed_and_leaves_the_model(monkeypatch):
    pytest.importorskip("torchao")
    import torchao.quantization as ao

    model = memkit.load_model("flux", size="tiny", dtype=torch.bfloat16)
    before = {n: p for n, p in model.named_parameters()}
    monkeypatch.delattr(ao, "Int8WeightOnlyConfig")  # as in torchao < 0.9
    with pytest.raises(ImportError, match=r"quantize int8wo needs torchao >= 0\.9 \(its Int8WeightOnlyConfig\)"):
        Quantize(method="int8wo").apply(model)
    assert {n: p for n, p in model.named_parameters()} == before  # the same parameter objects, nothing replaced
    assert not getattr(model, "is_quantized", False)
