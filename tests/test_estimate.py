"""Fake-tensor estimates against real tracked runs."""

import pytest
import torch
from _cpu_estimate import estimate_cpu

import memkit


def real_peak(preset: str, mode: str, optimizations=(), optimizer=None) -> memkit.Timeline:
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    opt = memkit.step.make_optimizer(optimizer, model.parameters())
    with memkit.handle.apply_all(model, optimizations):
        with memkit.track(model, optimizer=opt, inputs=inputs) as tl:
            if mode == "training":
                memkit.train_step(model, inputs, opt)
            else:
                with torch.no_grad():
                    model(**inputs)
    return tl


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_estimate_equals_real_tracked_peak_for_every_tiny_preset(preset):
    est = estimate_cpu(preset, size="tiny")
    real = real_peak(preset, "training")
    assert est.peak_bytes == real.peak_bytes
    assert est.baseline_bytes == real.baseline_bytes
    assert est.peak_by_category() == real.peak_by_category()


@pytest.mark.parametrize("preset", ["flux", "unet"])
def test_estimate_inference_and_checkpointing_match_real(preset):
    estimated = estimate_cpu(preset, size="tiny", mode="inference")
    assert estimated.peak_bytes == real_peak(preset, "inference").peak_bytes
    ckpt = [memkit.Checkpointing(pattern="all")]
    assert (
        estimate_cpu(preset, size="tiny", optimizations=ckpt).peak_bytes
        == real_peak(preset, "training", ckpt).peak_bytes
    )


def test_estimate_with_a_callable_and_custom_inputs():
    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))

    tl = estimate_cpu(model_fn, lambda m: {"input": torch.randn(8, 64)}, mode="inference")
    # weights + input, then fc1 out (8x256) and gelu out coexist, then fc2 out
    params = (64 * 256 + 256 + 256 * 64 + 64) * 4
    assert tl.baseline_bytes == params + 8 * 64 * 4
    assert tl.peak_bytes - tl.baseline_bytes == 2 * 8 * 256 * 4


def test_estimate_bad_input():
    with pytest.raises(ValueError, match=r"unknown model 'sdxl-turbo-x'.*presets: flux"):
        estimate_cpu("sdxl-turbo-x")
    with pytest.raises(ValueError, match="mode"):
        estimate_cpu("flux", size="tiny", mode="train")
    with pytest.raises(ValueError, match="steps"):
        estimate_cpu("flux", size="tiny", steps=0)
    with pytest.raises(ValueError, match="device"):
        estimate_cpu("flux", size="tiny", device="tpu")


# HiDream-I1 at a tiny size (the shape of diffusers' own HiDream tests), 4 experts of which the router picks 2 per token
HIDREAM_TINY = dict(
    patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
    num_attention_heads=2, caption_channels=[16, 16], text_emb_dim=16, num_routed_experts=4, num_activated_experts=2,
    axes_dims_rope=(4, 2, 2), max_resolution=(16, 16), llama_layers=[0, 1],
)  # fmt: skip


def hidream_inputs(model, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {  # what HiDreamImagePipeline passes: latents, T5's states, a stack of Llama layers, CLIP's pooled pair
        "hidden_states": torch.randn(1, 4, 32, 32, generator=g),
        "timesteps": torch.rand(1, generator=g) * 1000,
        "encoder_hidden_states_t5": torch.randn(1, 8, 16, generator=g),
        "encoder_hidden_states_llama3": torch.randn(2, 1, 8, 16, generator=g),
        "pooled_embeds": torch.randn(1, 16, generator=g),
    }


@pytest.mark.parametrize(("force_inference_output", "op"), [(False, "nonzero"), (True, "bincount")])
def test_a_forward_that_sizes_tensors_by_values_is_refused_naming_the_op(force_inference_output, op):
    from diffusers import HiDreamImageTransformer2DModel

    def model_fn():
        return HiDreamImageTransformer2DModel(**HIDREAM_TINY, force_inference_output=force_inference_output)

    with pytest.raises(
        NotImplementedError, match=rf"aten\.{op}\.default.*fake tensors hold no values.*memkit\.compare"
    ):
        estimate_cpu(model_fn, hidream_inputs)


def test_the_real_memory_of_a_mixture_of_experts_follows_its_routing():
    # why the estimate above is refused, not guessed: the same shapes, other weights and inputs, other experts' token
    # counts, so other allocations and, in the CUDA allocator's 512-byte blocks, other peaks
    from diffusers import HiDreamImageTransformer2DModel

    peaks = set()
    for seed in range(5):
        torch.manual_seed(seed)
        model = HiDreamImageTransformer2DModel(**HIDREAM_TINY)
        inputs = hidream_inputs(model, seed)
        with memkit.track(model, inputs=inputs, alloc_granularity=512) as tl:
            memkit.train_step(model, inputs, None)
        peaks.add(tl.peak_bytes)
    assert len(peaks) > 1


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_estimate_equals_real_tracked_peak_for_every_small_preset(preset):
    model = memkit.load_model(preset, size="small")
    inputs = memkit.make_inputs(model)
    with memkit.track(model, inputs=inputs) as real:
        memkit.train_step(model, inputs)
    del model, inputs
    est = estimate_cpu(preset, size="small")
    assert est.peak_bytes == real.peak_bytes
    assert est.peak_by_category() == real.peak_by_category()


def test_steps_count_state_that_lives_across_steps():
    one = estimate_cpu("dit", size="tiny", optimizer="adamw", steps=1)
    two = estimate_cpu("dit", size="tiny", optimizer="adamw", steps=2)
    params = one.baseline_by_category["parameter"]
    # AdamW keeps two moments per parameter (and a step counter): in the baseline of the second step only
    assert one.baseline_by_category["optimizer_state"] == 0
    assert two.baseline_by_category["optimizer_state"] >= 2 * params
    no_opt = estimate_cpu("dit", size="tiny", optimizer=None, steps=2)
    # without an optimizer the gradients of step 1 are still there when step 2 starts
    assert no_opt.baseline_by_category["gradient"] > 0


def test_cuda_estimate_rounds_every_block_to_512_bytes():
    tl = estimate_cpu("flux", size="tiny", device="cuda")
    sizes = tl.column("bytes")
    assert len(sizes) and (sizes % 512 == 0).all()
    assert tl.peak_bytes > estimate_cpu("flux", size="tiny", device="cpu").peak_bytes
    assert tl.devices == ["cuda"]


def test_estimate_allocates_nothing_over_its_window():
    # RSS before and after cannot see memory allocated and freed in between: measure the allocator over the
    # whole window instead. A real small Flux (and its AdamW step) would allocate hundreds of MiB.
    from oracles import profiler_window
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tl = estimate_cpu("flux", size="small", optimizer="adamw", progress=False)
    peak, _ = profiler_window(prof)
    parameter_bytes = tl.baseline_by_category["parameter"]
    assert parameter_bytes > 100 * 2**20  # what a real run would hold before its first step
    assert peak < 2**20, f"estimate allocated {peak} bytes at its peak"


def test_estimate_counts_what_an_optimization_owns():
    class Shadow:
        def apply(self, model):
            shadows = [torch.zeros_like(p) for p in model.parameters()]  # fake tensors inside estimate
            return memkit.Handle(lambda: None, name="shadow", owned={"ema": shadows})

    plain = estimate_cpu("dit", size="tiny")
    shadowed = estimate_cpu("dit", size="tiny", optimizations=[Shadow()])
    params = plain.baseline_by_category["parameter"]
    assert shadowed.baseline_by_category["ema"] == params
    assert shadowed.peak_bytes == plain.peak_bytes + params


def test_estimate_takes_a_step_or_its_parts_but_not_both():
    step = memkit.Step(optimizer="sgd", steps=2)
    a = estimate_cpu("dit", size="tiny", step=step)
    b = estimate_cpu("dit", size="tiny", optimizer="sgd", steps=2)
    assert a.peak_bytes == b.peak_bytes and a.meta["optimizer"] == "sgd" and a.meta["steps"] == 2
    assert a.baseline_by_category["optimizer_state"] > 0  # the second step finds the first one's momentum
    with pytest.raises(ValueError, match="give either step or mode/optimizer/steps"):
        estimate_cpu("dit", size="tiny", step=step, optimizer="adamw")
    with pytest.raises(TypeError, match="step must be a memkit.Step"):
        estimate_cpu("dit", size="tiny", step="sgd")


@pytest.mark.parametrize("preset", ["lumina2", "z-image"])
def test_single_stream_presets_in_a_batch_equal_the_real_run(preset):
    # Lumina2 sums its attention mask into one caption length per sample (.tolist()): the estimate's mask carries its
    # values and keeps them through the sum; Z-Image takes lists of latents and captions, one per sample
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model, batch_size=2)
    with memkit.track(model, inputs=inputs) as real:
        memkit.train_step(model, inputs)
    est = estimate_cpu(preset, size="tiny", batch_size=2)
    assert est.peak_bytes == real.peak_bytes
    assert est.baseline_bytes == real.baseline_bytes
    assert est.peak_by_category() == real.peak_by_category()
