"""The whole job (memkit.estimate_job, memkit.Pipeline): its phases against their oracles.

- The default job is the transformer's step alone: its training phase is the step's estimate, its load phase the
  step's weights, its saving phase the trained parameters' bytes in host memory.
- Quantizing on the GPU (``quantize_on="gpu"``) is the real library run on the loaded checkpoint: against torchao's
  ``quantize_`` run on a real CPU model as a script does (no reference kept), byte for byte.
- Bad input names the argument and what is allowed.
"""

from __future__ import annotations

import pytest
import torch

import memkit
from memkit.memory.events import CUDA_BLOCK, round_alloc
from memkit.pipeline import Pipeline, estimate_job, parse_validate

PRESET = "flux"


def test_the_default_job_is_the_step_alone():
    lora = memkit.LoRA(rank=4)
    job = estimate_job(PRESET, size="tiny", optimizations=[lora], progress=False)
    step = memkit.estimate(PRESET, size="tiny", optimizations=[lora], progress=False)
    assert list(job.phases) == ["load", "training", "saving"]
    training = job.phases["training"].timeline
    assert training.peak_bytes == step.peak_bytes
    assert training.peak_reserved_bytes == step.peak_reserved_bytes
    assert job.peak_phase == "training" and job.peak_bytes == step.peak_bytes
    assert job.components == ["transformer"]
    # load: the weights the step holds (quantized, with adapters), its inputs left out
    inputs = step.baseline_by_category["input"]
    assert job.phases["load"].timeline.end_bytes == step.baseline_bytes - inputs
    # saving: the trained parameters copied to the host
    trained = sum(p.numel() for p in _lora_model(lora).parameters() if p.requires_grad) * 2  # bf16 adapters
    assert job.phases["saving"].host_bytes == trained == step.meta["trainable_bytes"]
    # host while loading: the checkpoint in the step's dtype
    assert job.phases["load"].host_bytes == step.meta["parameters"] * 2
    summary = job.summary()
    assert summary["peak_phase"] == "training" and set(summary["peak_by_phase"]) == set(job.phases)
    assert summary["peak_by_component"] == {"transformer": job.peak_by_component["transformer"]}


def _lora_model(lora):
    model = memkit.load_model(PRESET, size="tiny", dtype=torch.bfloat16)
    lora.apply(model)
    return model


def _torchao_on_a_real_model():
    """A script's torchao quantization of the loaded checkpoint, tracked: ``quantize_`` on a real bf16 model."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = memkit.load_model(PRESET, size="tiny", dtype=torch.bfloat16)
    with memkit.track(model) as tl:
        quantize_(model, Int8WeightOnlyConfig())
    return tl


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_quantizing_on_the_gpu_is_the_libraries_run_on_the_loaded_checkpoint():
    real = _torchao_on_a_real_model()
    quantize = memkit.Quantize(method="int8wo")
    job = estimate_job(
        PRESET, Pipeline(quantize_on="gpu"), size="tiny", device="cpu", optimizations=[quantize, memkit.LoRA(rank=4)],
        progress=False,
    )  # fmt: skip
    load = job.phases["load"].timeline
    assert (load.peak_bytes, load.end_bytes) == (real.peak_bytes, real.end_bytes)
    assert real.peak_bytes > real.end_bytes  # the checkpoint's weights were resident before they were quantized


@pytest.mark.parametrize("method", ["nf4", "int8wo", "fp8-storage"])
def test_quantizing_on_the_gpu_frees_each_original_and_ends_where_the_cpu_one_does(method):
    pytest.importorskip("bitsandbytes")
    quantize = memkit.Quantize(method=method)
    jobs = {
        on: estimate_job(PRESET, Pipeline(quantize_on=on), size="tiny", optimizations=[quantize], optimizer=None,
                         progress=False)
        for on in ("cpu", "gpu")
    }  # fmt: skip
    cpu, gpu = (jobs[on].phases["load"].timeline for on in ("cpu", "gpu"))
    assert gpu.end_bytes == cpu.end_bytes  # every original weight freed once replaced
    bf16 = sum(p.numel() * 2 for p in memkit.load_model(PRESET, size="tiny", dtype=torch.bfloat16).parameters())
    assert gpu.peak_bytes >= bf16 > cpu.peak_bytes
    assert jobs["gpu"].phases["load"].note.startswith("the checkpoint in bfloat16 loaded on the device")
    # the checkpoint is read from host memory; on the CPU the quantized copy is made beside it
    assert jobs["cpu"].phases["load"].host_bytes == jobs["gpu"].phases["load"].host_bytes + cpu.end_bytes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(text_encoders="disk"), r"text_encoders must be one of \['precomputed', 'gpu', 'cpu'\], got 'disk'"),
        (dict(vae="GPU"), r"vae must be one of \['precomputed', 'gpu', 'cpu'\]"),
        (dict(cfg="double"), r"cfg must be one of \[None, 'batch', 'separate'\]"),
        (dict(quantize_on="tpu"), r"quantize_on must be one of \['cpu', 'gpu'\]"),
        (dict(validate=(0, 28)), r"validate must be None or \(every, steps\)"),
        (dict(validate="100"), r"validate must be EVERY:STEPS"),
    ],
)
def test_a_bad_pipeline_names_the_argument_and_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Pipeline(**kwargs)


def test_validate_takes_every_colon_steps():
    assert parse_validate("100:28") == (100, 28)
    assert Pipeline(validate="50:4").validate == (50, 4)
    for bad in ("100", "a:b", "0:28", "100:-1"):
        with pytest.raises(ValueError, match="EVERY:STEPS"):
            parse_validate(bad)


def test_a_job_refuses_what_its_mode_lacks():
    with pytest.raises(ValueError, match="validate and precompute are phases of a training job"):
        estimate_job(PRESET, Pipeline(validate=(10, 2)), size="tiny", mode="inference")
    with pytest.raises(ValueError, match="cfg applies to inference and to validation"):
        estimate_job(PRESET, Pipeline(cfg="batch"), size="tiny")
    with pytest.raises(TypeError, match="pipeline must be a memkit.Pipeline"):
        estimate_job(PRESET, {"vae": "gpu"}, size="tiny")
    with pytest.raises(ValueError, match="no preset"):
        estimate_job(lambda: torch.nn.Linear(2, 2), Pipeline(vae="gpu"))


def _real_job(preset, placements, *, validate=False, optimizations=()):
    """A tiny training run on real CPU tensors, written as a script writes it and tracked whole: the components as
    placed (resident), each live one encoding the batch before each step, two steps, then one validation denoising
    step and the VAE decode. Returns (timeline, index where validation starts)."""
    from memkit import _components
    from memkit.handle import apply_all

    torch.manual_seed(0)
    model = memkit.load_model(preset, size="tiny", dtype=torch.bfloat16)
    comps = _components.components(preset)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        modules = {c.name: c.build("tiny") for c in comps if placements[c.role] == "gpu"}
        handle = apply_all(model, list(optimizations))
        runner = memkit.Step(optimizer="adamw").bind(model, handle)
        inputs = memkit.make_inputs(model, batch_size=1)
        sizes = dict(memkit.PRESETS[preset].input_sizes["tiny"])
        owned = {"parameter": [p for m in modules.values() for p in m.parameters()]}
        with memkit.track(model, optimizer=runner.optimizer, inputs=inputs, owned=owned) as tl:
            for _ in range(2):
                for c in comps:
                    if c.name in modules:
                        out = _components.run(c, modules[c.name], batch_size=1, sizes=sizes, part="encode")
                        del out
                runner.run(inputs)
            start = len(tl)
            if validate:
                with torch.no_grad():
                    for c in comps:  # the validation prompt, encoded by the text encoders as placed
                        if c.role == "text_encoder":
                            out = _components.run(c, modules[c.name], batch_size=1, sizes=sizes, part="encode")
                            del out
                    val_inputs = memkit.make_inputs(model, batch_size=1)
                    out = model(**val_inputs)
                    del out, val_inputs
                    vae = next(c for c in comps if c.role == "vae")
                    decoded = _components.run(vae, modules[vae.name], batch_size=1, sizes=sizes, part="decode")
                    del decoded
        return tl, start
    finally:
        torch.set_default_dtype(old)


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_resident_components_and_validation_compose_as_a_real_run():
    pytest.importorskip("memkit._components")
    lora = memkit.LoRA(rank=4)
    real, start = _real_job(PRESET, {"text_encoder": "gpu", "vae": "gpu"}, validate=True, optimizations=[lora])
    job = estimate_job(
        PRESET, Pipeline(text_encoders="gpu", vae="gpu", validate=(10, 2)), size="tiny", device="cpu",
        optimizations=[lora], progress=False,
    )  # fmt: skip
    assert job.phases["training"].timeline.peak_bytes == real.peak_between(0, start)
    assert job.phases["validation"].timeline.peak_bytes == real.peak_between(start)


def _real_inference(preset, cfg_batch: int):
    """A tiny pipeline call on real CPU tensors as a script writes it: the prompt encoded by the resident text
    encoders, one denoising step (the batch doubled under classifier-free guidance), the VAE decode."""
    from memkit import _components

    torch.manual_seed(0)
    model = memkit.load_model(preset, size="tiny", dtype=torch.bfloat16)
    comps = _components.components(preset)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        modules = {c.name: c.build("tiny") for c in comps}
        sizes = dict(memkit.PRESETS[preset].input_sizes["tiny"])
        owned = {"parameter": [p for m in modules.values() for p in m.parameters()]}
        marks = []
        with memkit.track(model, owned=owned) as tl:
            for c in comps:
                if c.role == "text_encoder":
                    out = _components.run(c, modules[c.name], batch_size=2, sizes=sizes, part="encode")
                    del out
            marks.append(len(tl))
            inputs = memkit.make_inputs(model, batch_size=2 * cfg_batch)
            with torch.no_grad():
                out = model(**inputs)
            del out, inputs
            marks.append(len(tl))
            vae = next(c for c in comps if c.role == "vae")
            image = _components.run(vae, modules[vae.name], batch_size=2, sizes=sizes, part="decode")
            del image
        return tl, marks
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("cfg", [None, "batch"])
def test_an_inference_job_composes_as_a_real_pipeline_call(cfg):
    pytest.importorskip("memkit._components")
    real, (denoise_at, decode_at) = _real_inference(PRESET, 2 if cfg == "batch" else 1)
    job = estimate_job(
        PRESET, Pipeline(text_encoders="gpu", vae="gpu", cfg=cfg), size="tiny", mode="inference", batch_size=2,
        device="cpu", progress=False,
    )  # fmt: skip
    assert list(job.phases) == ["load", "encode", "denoise", "decode"]
    assert job.phases["encode"].timeline.peak_bytes == real.peak_between(0, denoise_at)
    assert job.phases["denoise"].timeline.peak_bytes == real.peak_between(denoise_at, decode_at)
    assert job.phases["decode"].timeline.peak_bytes == real.peak_between(decode_at)


def test_a_component_on_the_cpu_is_on_the_device_only_while_it_encodes():
    pytest.importorskip("memkit._components")
    jobs = {
        where: estimate_job(PRESET, Pipeline(text_encoders=where, vae=where), size="tiny", progress=False)
        for where in ("gpu", "cpu")
    }
    weights = jobs["gpu"].phases["load"].timeline.end_bytes - jobs["cpu"].phases["load"].timeline.end_bytes
    gpu, cpu = (jobs[w].phases["training"] for w in ("gpu", "cpu"))
    assert weights > 0
    assert gpu.timeline.baseline_bytes - cpu.timeline.baseline_bytes == weights  # resident vs in host memory
    assert cpu.host_bytes - gpu.host_bytes == weights
    # encoding moves each component on and back: the phase ends as it began, less the step's own state
    assert cpu.timeline.end_bytes == gpu.timeline.end_bytes - weights
    # the T5 encode is the training phase's peak in both; on the CPU the other components are off the device then
    others = gpu.baseline_by_component["text_encoder"] + gpu.baseline_by_component["vae"]
    assert cpu.timeline.peak_bytes == gpu.timeline.peak_bytes - others
    assert jobs["cpu"].peak_by_component["text_encoder_2"] > 0 == jobs["cpu"].peak_by_component["vae"]


def test_separate_guidance_passes_hold_the_first_prediction_and_cost_less_than_a_doubled_batch():
    jobs = {
        cfg: estimate_job(PRESET, Pipeline(cfg=cfg), size="tiny", mode="inference", progress=False)
        for cfg in (None, "separate", "batch")
    }
    one, two, doubled = (jobs[c].phases["denoise"].timeline for c in (None, "separate", "batch"))
    assert one.peak_bytes < two.peak_bytes < doubled.peak_bytes
    # the second pass runs beside the first's prediction, the shape of the latents (Flux: packed tokens x 64)
    model = memkit.load_model(PRESET, size="tiny", dtype=torch.bfloat16)
    latents = memkit.make_inputs(model)["hidden_states"]
    assert two.peak_bytes - one.peak_bytes == round_alloc(latents.numel() * 2, CUDA_BLOCK)
    assert jobs["separate"].phases["denoise"].note == "two passes; the first's prediction kept"


def test_a_preset_without_a_catalog_takes_the_default_pipeline_in_both_modes():
    for mode in ("training", "inference"):
        job = estimate_job("dit", size="tiny", mode=mode, progress=False)
        assert job.components == ["transformer"]
        assert list(job.phases) == (["load", "training", "saving"] if mode == "training" else ["load", "denoise"])
    with pytest.raises(ValueError, match=r"preset='dit' has no catalog of pipeline components; those with one: \["):
        estimate_job("dit", Pipeline(vae="gpu"), size="tiny")
    assert [c.name for c in memkit.pipeline.components("flux")] == ["text_encoder", "text_encoder_2", "vae"]
