"""The whole pipeline's memory against published GPU figures for FLUX.1-dev inference, each row whose configuration
its source states in full.

Sources (figures in GiB, ``/ 1024**3``):

- diffusers PR #10009 ("[core] TorchAO Quantizer", https://github.com/huggingface/diffusers/pull/10009), its
  benchmark table, row ``flux | none | bf16 | compile False``: the pipeline built with ``text_encoder=None,
  text_encoder_2=None`` (prompt embeddings precomputed), ``pipe.to("cuda")`` (transformer and VAE on the GPU),
  768x768, one image, guidance 5.0 (Flux-dev is guidance-distilled: one pass per step), ``output_type="latent"``
  (the decode is outside the measured window). ``before_inference_memory`` 22.364 (allocated after loading),
  ``after_inference_max_memory`` 22.633 (max allocated), ``after_inference_max_memory_reserved`` 23.018.
  Its torchao rows are not reproduced: every eager quantized row sits near the bf16 pipeline's size (float8wo_e4m3
  22.534 resident where its weights are 11.1), something the thread does not explain.
- The HF blog "Exploring Quantization Backends in Diffusers" (huggingface/blog PR #2852,
  ``diffusers-quantization.md``): the whole pipeline on the GPU (``pipe.to("cuda")``: T5-XXL, CLIP-L, the VAE in
  bf16), 1024x1024, 50 steps, guidance 3.5, output a PIL image (the decode inside the window); both columns
  ``max_memory_reserved``. BF16 row: 31.447 after loading, 36.166 peak. FP8 layerwise casting (e4m3, the transformer
  only; ``enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)``): 23.682 after
  loading, 28.451 peak. Its other rows quantize T5 as well (``PipelineQuantizationConfig``), which memkit does not.
"""

from __future__ import annotations

import pytest
import torch

import memkit
from memkit._components import components
from memkit.memory.events import CUDA_BLOCK, round_alloc
from memkit.pipeline import Pipeline, estimate_job

GIB = 2**30


def _gib(n: int) -> float:
    return n / GIB


@pytest.fixture(scope="module")
def pr_10009_bf16():
    return estimate_job("flux", Pipeline(vae="gpu"), mode="inference", height=768, width=768, progress=False)


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_pr_10009_bf16_flux_with_its_vae_on_the_gpu(pr_10009_bf16):
    job = pr_10009_bf16
    load, denoise = job.phases["load"].timeline, job.phases["denoise"].timeline
    # the issue asks for 5%; these hold to 1% (the VAE's 0.156 GiB alone is 0.7%)
    assert _gib(load.end_bytes) == pytest.approx(22.364, rel=0.01)  # before_inference_memory
    assert _gib(denoise.peak_bytes) == pytest.approx(22.633, rel=0.01)  # after_inference_max_memory
    assert _gib(denoise.peak_reserved_bytes) == pytest.approx(23.018, rel=0.01)  # ..._max_memory_reserved
    # the VAE resident through the denoising step: its bf16 weights, each block rounded as the allocator rounds it
    vae = next(c for c in components("flux") if c.role == "vae")
    with torch.device("meta"):
        weights = sum(round_alloc(p.numel() * 2, CUDA_BLOCK) for p in vae.build().parameters())
    at_peak = job.phases["denoise"].by_component_at(denoise.peak_index, job.components)
    assert at_peak["vae"] == weights and 83_819_683 * 2 <= weights < 83_819_683 * 2 * 1.01
    assert at_peak["transformer"] == denoise.peak_bytes - weights


@pytest.mark.parametrize(
    ("optimizations", "after_loading", "peak"),
    [
        pytest.param([], 31.447, 36.166, id="bf16"),
        pytest.param(
            [memkit.Quantize(method="fp8-storage")],
            23.682,
            28.451,
            id="fp8-layerwise",
            marks=pytest.mark.extended,
        ),
    ],
)
@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_blog_quantization_backends_flux_whole_pipeline_on_the_gpu(optimizations, after_loading, peak):
    job = estimate_job(
        "flux", Pipeline(text_encoders="gpu", vae="gpu"), mode="inference", optimizations=optimizations, progress=False
    )
    assert list(job.phases) == ["load", "encode", "denoise", "decode"]
    assert _gib(job.phases["load"].timeline.peak_reserved_bytes) == pytest.approx(after_loading, rel=0.01)
    # the decode sets the peak; its convolutions' cuDNN workspaces are not modelled (a lower bound, said so)
    assert job.peak_phase == "decode" and "lower bound" in job.phases["decode"].timeline.meta["lower_bound"]
    measured = _gib(job.peak_reserved_bytes)
    assert measured < peak
    if not optimizations:
        assert measured == pytest.approx(peak, rel=0.05)
    else:  # the fp8 row: 26.84 against 28.45 (-5.7%): the same 1.4-1.6 GiB the decode's workspaces leave out
        assert peak - measured == pytest.approx(1.6, abs=0.2)
