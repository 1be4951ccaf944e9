"""Presets build deterministic models, inputs fit them, every parameter learns, full sizes match the releases."""

from __future__ import annotations

import functools

import diffusers
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from memkit._torch_compat import known_values
from memkit.models import load_model, make_inputs, preset_of
from memkit.presets import PRESETS, SIZES, Preset
from memkit.step import model_output, train_step

# `make test-fast` keeps one preset of each block layout here (tests/conftest.py); every preset runs in `make test`
FAST_CASES = {
    name: {"flux", "wan", "pixart", "unet"}
    for name in (
        "test_bfloat16_builds_bfloat16_params_and_inputs",
        "test_full_size_matches_the_release_without_allocating",
        "test_forward_and_backward_run_under_fake_mode",
        "test_small_size_has_30_to_100m_parameters",
        "test_save_pretrained_round_trip",
        "test_train_step_reaches_every_parameter_and_keeps_the_latent_shape",
    )
}

NAMES = list(PRESETS)

# Parameter counts of the released models, from their model cards and papers (within 3%; see ROUNDED, EXACT).
PUBLISHED = {
    "flux": 11.9e9,  # FLUX.1-dev
    "sd3": 2.0e9,  # Stable Diffusion 3 Medium, "2B"
    "ltx-video": 1.9e9,  # LTX-Video 0.9 (the "2B" checkpoints)
    "wan": 14e9,  # Wan2.1-T2V-14B
    "hunyuanvideo": 13e9,  # HunyuanVideo paper and model card, "13B" (diffusers' transformer: 12,821,012,544)
    # finetrainers' full fine-tuning log, "trainable parameters": 5570283072 (docs/training/cogvideox.md at
    # a-r-r-o-w/finetrainers cfbb5dafd9b3cde0f973483e9a36855bab9f6ca5 to c4d6c6c9cbffbf73578e5e468da837cb66a3f381)
    "cogvideox-5b": 5_570_283_072,
    "cogvideox-2b": 2e9,  # the "2B" of CogVideoX-2b's name and model card (~2B): the nearest billion, see ROUNDED
    "unet": 860e6,  # Stable Diffusion 1.5 UNet
    "pixart": 0.6e9,  # PixArt-Sigma XL-2
    "dit": 675e6,  # DiT-XL/2 (paper); diffusers duplicates an embedder per block, see below
    "qwen-image": 20e9,  # Qwen-Image, "a 20B MMDiT" (its technical report and model card)
    "sana": 1.6e9,  # Sana-1.6B (the paper, arXiv 2410.10629, and the model card: 1,604,462,752 in diffusers)
    "wan2.1-1.3b": 1.3e9,  # Wan2.1-T2V-1.3B, the "1.3B" of its name and model card: see NAMED
    "wan2.2-ti2v-5b": 5e9,  # Wan2.2-TI2V-5B model card, "5B"
    # Wan2.2-T2V-A14B model card: "27B total parameters, with 14B active per step", one expert of two per step
    "wan2.2-t2v-a14b": 14e9,
    "sd3.5-large": 8.1e9,  # Stable Diffusion 3.5 Large model card, "8.1 billion parameters"
    "sd3.5-medium": 2.5e9,  # Stable Diffusion 3.5 Medium model card, "2.5 billion parameters"
    "sdxl": 2.6e9,  # SDXL paper (arXiv 2307.01952): "a 2.6B parameter UNet"
    "flux2-dev": 32e9,  # FLUX.2-dev's model card: "a 32 billion parameter rectified flow transformer"
    "chroma": 8.9e9,  # Chroma's model card: "an 8.9B parameter model based on FLUX.1-[schnell]"
    "cogview4": 6e9,  # the "6B" of CogView4-6B's name and model card, see ROUNDED
    "auraflow": 6.8e9,  # AuraFlow, "6.8B" (fal's AuraFlow blog post); v0.3's table has 6,858,605,568: within 1%
    # LTX-2 paper (arXiv 2601.03233): "a 14B-parameter video stream and a 5B-parameter audio stream"; the 19B of its
    # checkpoints' names (ltx-2-19b-dev)
    "ltx-2": 19e9,
    "z-image": 6e9,  # Z-Image, "6B parameters" (the README of Tongyi-MAI/Z-Image and the model card), see ROUNDED
    "lumina2": 2.6e9,  # Lumina-Image 2.0, "2.6B" (the model table of Alpha-VLLM/Lumina-Image-2.0's README)
    "mochi": 10e9,  # Mochi 1's model card (genmo/mochi-1-preview): "a 10 billion parameter diffusion model"
    # HunyuanVideo 1.5 technical report (arXiv 2511.18870) and model card: "only 8.3 billion parameters"
    "hunyuanvideo-1.5": 8.3e9,
}

# Published counts that are a rounded name, not a measurement: the unit they are rounded to. diffusers' CogVideoX-2b
# transformer has 1,693,783,872 parameters (its 30 blocks at width 1920 and the T5 projection), "2B" to the billion.
ROUNDED = {"cogvideox-2b": 1e9, "sd3.5-large": 0.1e9, "sd3.5-medium": 0.1e9, "sdxl": 0.1e9}
# Published sizes that are a model's name, further from its count than any rounding: how far (relative) the count
# is above the name. Wan2.1's 1.3B has the dimensions of the Wan paper's table (1536 wide, FFN 8960, 12 heads,
# 30 layers) and 1,418,996,800 parameters (2.84 GB in bf16, the size its checkpoint is listed at): 9% above "1.3B".
NAMED = {"wan2.1-1.3b": 0.1}
# The SD3.5 checkpoints store the position table that diffusers keeps as a (persistent) buffer: the model cards
# count it. SD3.5 Medium's 384x384 positions x 1536 are 226M of its 2.47B ("2.5 billion"; 2.24B without).
COUNTS_POSITION_TABLE = {"sd3.5-large", "sd3.5-medium"}
# diffusers' FLUX.2-dev transformer has 32,223,281,152: "32 billion" to the billion.
ROUNDED |= {"flux2-dev": 1e9}
# Chroma: 8,899,983,424, "8.9B" to the hundred million. CogView4-6B: 6,369,118,272, "6B" to the billion.
ROUNDED |= {"chroma": 0.1e9, "cogview4": 1e9}
# diffusers' LTX-2 transformer has 18,876,174,592: "19B" to the billion. The text connectors that
# ltx-2-19b-dev.safetensors stores beside it (LTX2TextConnectors in diffusers, 1.43B) are not in it, nor in the 19B.
ROUNDED |= {"ltx-2": 1e9}
# Z-Image-Turbo: 6,154,908,736, "6B" to the billion. Lumina-Image 2.0: 2,609,769,152, "2.6B" to the hundred million.
ROUNDED |= {"z-image": 1e9, "lumina2": 0.1e9}
# Mochi 1: 10,027,677,744, "10 billion" to the billion. HunyuanVideo 1.5 (480p T2V): 8,326,608,160, "8.3 billion".
ROUNDED |= {"mochi": 1e9, "hunyuanvideo-1.5": 0.1e9}
# Published counts given to the parameter.
EXACT = {"cogvideox-5b"}

WB = ("weight", "bias")
# Parameters that get no gradient by construction of the released architecture, not by a bug of the preset.
NO_GRAD = {
    # SD3's last joint block is "context_pre_only": its text-stream output is dropped, so the text queries of
    # that block feed nothing. SD3 Medium ships the same dead weights.
    "sd3": {"transformer_blocks.1.attn.add_q_proj.weight", "transformer_blocks.1.attn.add_q_proj.bias"},
    # the same for SD3.5, with the QK norm of those queries
    **dict.fromkeys(
        ("sd3.5-large", "sd3.5-medium"),
        {f"transformer_blocks.1.attn.{n}" for n in ("add_q_proj.weight", "add_q_proj.bias", "norm_added_q.weight")},
    ),
    # Qwen-Image's last block computes a text-stream output that the model discards (only the image stream reaches
    # norm_out): the text side of that block's attention output and MLP feed nothing. The release has the same.
    "qwen-image": {
        f"transformer_blocks.1.{name}"
        for name in (
            "attn.add_q_proj.weight",
            "attn.add_q_proj.bias",
            "attn.to_add_out.weight",
            "attn.to_add_out.bias",
            "attn.norm_added_q.weight",
            "txt_mlp.net.0.proj.weight",
            "txt_mlp.net.0.proj.bias",
            "txt_mlp.net.2.weight",
            "txt_mlp.net.2.bias",
        )
    },  # fmt: skip
    # Mochi's last block is "context_pre_only", as SD3's: the text queries of that block feed nothing.
    "mochi": {"transformer_blocks.1.attn1.add_q_proj.weight", "transformer_blocks.1.attn1.norm_added_q.weight"},
    # HunyuanVideo 1.5, text-to-video: the image tokens are multiplied by 0 (the pipeline's image embeddings are
    # zeros), the glyph tokens of a prompt without quoted text replaced by zeros (none valid in their mask), and the
    # last block's text stream is dropped as Qwen-Image's: the release trains the same dead paths on such prompts.
    "hunyuanvideo-1.5": {
        *(f"image_embedder.{n}.{p}" for n in ("norm_in", "linear_1", "linear_2", "norm_out") for p in WB),
        *(f"context_embedder_2.{n}.{p}" for n in ("norm", "linear_1", "linear_2", "linear_3") for p in WB),
        *(f"transformer_blocks.1.attn.{n}.{p}" for n in ("add_q_proj", "to_add_out") for p in WB),
        "transformer_blocks.1.attn.norm_added_q.weight",
        *(f"transformer_blocks.1.ff_context.net.{n}.{p}" for n in ("0.proj", "2") for p in WB),
    },
}

# Pixels per latent token edge and frames per latent frame: the smallest steps each preset's inputs take.
PIXEL_STEP = {"flux": 16, "sd3": 16, "ltx-video": 32, "wan": 16, "unet": 8, "pixart": 16, "dit": 16}
PIXEL_STEP |= {"hunyuanvideo": 16, "cogvideox-5b": 16, "cogvideox-2b": 16, "sana": 32, "qwen-image": 16}
PIXEL_STEP |= {"wan2.1-1.3b": 16, "wan2.2-ti2v-5b": 32, "wan2.2-t2v-a14b": 16, "sd3.5-large": 16, "sd3.5-medium": 16}
PIXEL_STEP |= {"sdxl": 8}
PIXEL_STEP |= {"flux2-dev": 16, "chroma": 16, "auraflow": 16, "cogview4": 16}
PIXEL_STEP |= {"ltx-2": 32}
PIXEL_STEP |= {"flux2-dev": 16, "chroma": 16, "auraflow": 16, "cogview4": 16, "z-image": 16, "lumina2": 16}
FRAME_STEP = {"ltx-video": 8, "wan": 4, "hunyuanvideo": 4, "cogvideox-5b": 4, "cogvideox-2b": 4}
FRAME_STEP |= {"wan2.1-1.3b": 4, "wan2.2-ti2v-5b": 4, "wan2.2-t2v-a14b": 4}
FRAME_STEP |= {"ltx-2": 8}
PIXEL_STEP |= {"mochi": 16, "hunyuanvideo-1.5": 16}
FRAME_STEP |= {"mochi": 6, "hunyuanvideo-1.5": 4}


def expected_output_shape(name: str, config, batch: int, height: int, width: int, frames: int = 1) -> tuple:
    """The output contract: the input latent's shape, with DiT/PixArt predicting a variance too (8 channels)."""
    h, w = height // 8, width // 8
    if name in ("flux", "flux2-dev", "chroma"):  # 2x2 latent pixels packed into one token
        return (batch, (h // 2) * (w // 2), config.in_channels)
    if name in ("ltx-video", "ltx-2"):  # 32x spatial, 8x temporal VAE, tokens packed (LTX-2: the video's)
        return (batch, ((frames - 1) // 8 + 1) * (height // 32) * (width // 32), config.out_channels)
    if name.startswith("wan") or name == "hunyuanvideo":  # Wan2.2-TI2V-5B: a 16x VAE
        vae = 16 if name == "wan2.2-ti2v-5b" else 8
        return (batch, config.out_channels, (frames - 1) // 4 + 1, height // vae, width // vae)
    if name == "qwen-image":  # 2x2 latent pixels of out_channels packed into one token
        return (batch, (h // 2) * (w // 2), config.out_channels * 4)
    if name == "sana":  # the DC-AE: 32x spatial
        return (batch, config.out_channels, height // 32, width // 32)
    if name.startswith("cogvideox"):  # frames before channels
        return (batch, (frames - 1) // 4 + 1, config.out_channels, h, w)
    if name == "z-image":  # a list of (C, 1, H, W) latents, one per sample, stacked (see model_output)
        return (batch, config.in_channels, 1, h, w)
    if name == "lumina2":  # out_channels None: in_channels
        return (batch, config.in_channels, h, w)
    if name == "mochi":  # 8x spatial, 6x temporal VAE
        return (batch, config.in_channels, (frames - 1) // 6 + 1, h, w)
    if name == "hunyuanvideo-1.5":  # 16x spatial, 4x temporal VAE; the output has the latent's channels only
        return (batch, config.out_channels, (frames - 1) // 4 + 1, height // 16, width // 16)
    return (batch, config.out_channels, h, w)


def latent_input(inputs: dict) -> torch.Tensor:
    if "x" in inputs:  # Z-Image: one latent per sample, in a list
        return torch.stack(inputs["x"])
    return inputs["sample"] if "sample" in inputs else inputs["hidden_states"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP's spin-waiting made a tiny
    # UNet step take seconds instead of 50 ms.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Z-Image's timestep MLP is 256 -> 1024 -> 256 wide whatever the model's width (diffusers fixes it): 296K parameters
TINY_PARAMETERS = {"z-image": 400_000}


@functools.cache
def cached_tiny(name: str) -> torch.nn.Module:
    return load_model(name)


def states_equal(a: torch.nn.Module | dict, b: torch.nn.Module | dict) -> bool:
    sa = a.state_dict() if isinstance(a, torch.nn.Module) else a
    sb = b.state_dict() if isinstance(b, torch.nn.Module) else b
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------------------------------------------ presets


def test_presets_cover_every_size_with_a_diffusers_class():
    assert NAMES == [
        "flux", "sd3", "sd3.5-large", "sd3.5-medium", "ltx-video", "ltx-2", "wan", "wan2.1-1.3b", "wan2.2-ti2v-5b",
        "wan2.2-t2v-a14b", "hunyuanvideo", "cogvideox-5b", "cogvideox-2b", "mochi", "hunyuanvideo-1.5", "unet", "sdxl",
        "pixart", "dit", "sana", "qwen-image",
        "flux2-dev", "chroma", "auraflow", "cogview4", "z-image", "lumina2",
    ]  # fmt: skip
    for name, preset in PRESETS.items():
        assert isinstance(preset, Preset) and preset.name == name
        assert hasattr(diffusers, preset.model_class)
        assert set(preset.configs) == set(preset.input_sizes) == set(SIZES)
        assert preset.description and "\n" not in preset.description


# HunyuanVideo 1.5's glyph-text projection is 2048 wide whatever the config (4.2M of its tiny model's 4.4M).
TINY_PARAMETERS |= {"hunyuanvideo-1.5": 5_000_000}


@pytest.mark.parametrize("name", NAMES)
def test_tiny_builds_deterministically_without_touching_global_rng(name):
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    model = load_model(name, seed=0)
    assert torch.equal(torch.rand(3), expected_draw)

    assert model.training and preset_of(model) == name
    assert sum(p.numel() for p in model.parameters()) < TINY_PARAMETERS.get(name, 300_000)
    assert states_equal(model, load_model(name, seed=0))
    assert not states_equal(model, load_model(name, seed=1))
    assert all(p.any() for p in model.parameters()), "zero-initialised parameters are refilled"


@pytest.mark.parametrize("name", NAMES)
def test_train_step_reaches_every_parameter_and_keeps_the_latent_shape(name):
    model = load_model(name)
    inputs = make_inputs(model, batch_size=2)
    loss = train_step(model, inputs)

    assert loss.ndim == 0 and torch.isfinite(loss) and not loss.requires_grad
    missing = {k for k, p in model.named_parameters() if p.grad is None or not p.grad.any()}
    nonfinite = {k for k, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()}
    print(f"{name}: no gradient for {sorted(missing)}; non-finite for {sorted(nonfinite)}")
    assert missing == NO_GRAD.get(name, set())
    assert not nonfinite

    sizes = PRESETS[name].input_sizes["tiny"]
    out = model_output(model(**inputs))
    frames = sizes.get("frames", 1)
    assert out.shape == expected_output_shape(name, model.config, 2, sizes["height"], sizes["width"], frames)
    if name not in ("pixart", "dit", "hunyuanvideo-1.5"):  # HunyuanVideo 1.5's input has the image condition too
        assert out.shape == latent_input(inputs).shape


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_builds_bfloat16_params_and_inputs(name):
    model = load_model(name, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    inputs = make_inputs(model)
    floats = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert floats and {t.dtype for t in floats} == {torch.bfloat16}
    assert torch.isfinite(train_step(model, inputs))


FULL_LATENTS = {  # the full-size default inputs: 1024x1024 images, 512x512 UNet, 256x256 DiT, two videos
    "flux": (1, 64 * 64, 64),
    "sd3": (1, 16, 128, 128),
    "ltx-video": (1, 6 * 15 * 22, 128),  # 41 frames x 480 x 704 px
    "wan": (1, 16, 5, 60, 104),  # 17 frames x 480 x 832 px
    "hunyuanvideo": (1, 16, 13, 64, 96),  # 49 frames x 512 x 768 px
    "cogvideox-5b": (1, 13, 16, 60, 90),  # 49 frames x 480 x 720 px, frames before channels
    "cogvideox-2b": (1, 13, 16, 60, 90),
    "unet": (1, 4, 64, 64),
    "pixart": (1, 4, 128, 128),
    "dit": (1, 4, 32, 32),
    "sana": (1, 32, 32, 32),  # 1024x1024 px through the 32x DC-AE
    "qwen-image": (1, 64 * 64, 64),
    "wan2.1-1.3b": (1, 16, 21, 60, 104),  # 81 frames x 480 x 832 px
    "wan2.2-ti2v-5b": (1, 48, 31, 44, 80),  # 121 frames x 704 x 1280 px through the 16x VAE
    "wan2.2-t2v-a14b": (1, 16, 21, 60, 104),
    "sd3.5-large": (1, 16, 128, 128),
    "sd3.5-medium": (1, 16, 128, 128),
    "sdxl": (1, 4, 128, 128),
    "flux2-dev": (1, 64 * 64, 128),  # 2x2 latent pixels of 32 channels per token
    "chroma": (1, 64 * 64, 64),
    "auraflow": (1, 4, 128, 128),
    "cogview4": (1, 16, 128, 128),
    "ltx-2": (1, 16 * 16 * 24, 128),  # 121 frames x 512 x 768 px
    "z-image": (1, 16, 1, 128, 128),  # each sample's (C, 1, H, W), stacked
    "lumina2": (1, 16, 128, 128),
    "mochi": (1, 12, 4, 60, 106),  # 19 frames x 480 x 848 px through the 8x, 6x VAE
    "hunyuanvideo-1.5": (1, 65, 31, 30, 53),  # 121 frames x 480 x 848 px through the 16x VAE; 32 + 32 + 1 channels
}


@pytest.mark.parametrize("name", NAMES)
def test_full_size_matches_the_release_without_allocating(name):
    with FakeTensorMode():
        model = load_model(name, size="full", dtype=torch.bfloat16)
        inputs = make_inputs(model)
    assert all(is_fake(p) for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    if name == "dit":
        # diffusers' DiT gives each block its own timestep+class embedder; the paper shares one.
        per_block = sum(p.numel() for p in model.transformer_blocks[0].norm1.emb.parameters())
        count -= (len(model.transformer_blocks) - 1) * per_block
    if name in COUNTS_POSITION_TABLE:
        count += model.pos_embed.pos_embed.numel()
    if name in EXACT:
        assert count == PUBLISHED[name]
    elif name in ROUNDED:
        assert abs(count - PUBLISHED[name]) <= ROUNDED[name] / 2
    elif name in NAMED:
        assert 0 < count - PUBLISHED[name] <= NAMED[name] * PUBLISHED[name]
    else:
        assert count == pytest.approx(PUBLISHED[name], rel=0.03)

    latent = latent_input(inputs)
    assert is_fake(latent) and latent.dtype == torch.bfloat16
    assert tuple(latent.shape) == FULL_LATENTS[name]


@pytest.mark.parametrize("name", NAMES)
def test_small_size_has_30_to_100m_parameters(name):
    with FakeTensorMode():
        model = load_model(name, size="small")
    assert 30e6 <= sum(p.numel() for p in model.parameters()) <= 100e6


@pytest.mark.parametrize("name", NAMES)
def test_forward_and_backward_run_under_fake_mode(name):
    with FakeTensorMode():
        model = load_model(name)
        inputs = make_inputs(model)
        with known_values(inputs):  # Mochi's and HunyuanVideo 1.5's masks: their values decide shapes
            out = model_output(model(**inputs))
            out.float().pow(2).mean().backward()
        assert all(is_fake(p.grad) for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trip(name, tmp_path):
    model = load_model(name, seed=3)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert type(loaded) is type(model) and loaded.training
    assert states_equal(model, loaded)
    assert preset_of(loaded) == name
    a, b = make_inputs(model), make_inputs(loaded)  # tiny defaults recovered from the config
    assert torch.equal(latent_input(a), latent_input(b))
    outputs = []
    for m, inputs in ((model, a), (loaded, b)):
        torch.manual_seed(0)  # DiT drops class labels at random in training mode: the same draws for both
        outputs.append(model_output(m(**inputs)))
    assert torch.equal(*outputs)
    # diffusers' own from_pretrained(torch_dtype=bfloat16) gives float32 SD3 weights and refuses Wan here.
    assert {p.dtype for p in load_model(str(tmp_path), dtype=torch.bfloat16).parameters()} == {torch.bfloat16}


def test_sharded_checkpoint_round_trip(tmp_path):
    model = load_model("flux", seed=5)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert states_equal(model, load_model(tmp_path))


def test_preset_found_by_class_for_a_model_not_built_by_memkit():
    model = diffusers.DiTTransformer2DModel(**PRESETS["dit"].configs["tiny"])
    assert preset_of(model) == "dit"
    assert latent_input(make_inputs(model)).shape == (1, 4, 4, 4)  # tiny defaults: the config matches


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_presets_sharing_a_class_are_told_apart_by_the_config():
    shared: dict[str, list[str]] = {}
    for p in PRESETS.values():
        shared.setdefault(p.model_class, []).append(p.name)
    shared = {cls: names for cls, names in shared.items() if len(names) > 1}
    assert set(shared) == {
        "SD3Transformer2DModel", "WanTransformer3DModel", "CogVideoXTransformer3DModel", "UNet2DConditionModel"
    }  # fmt: skip
    # a Wan2.2 A14B expert is Wan2.1-14B's architecture, config and inputs alike: built outside memkit it is "wan"
    assert dict(PRESETS["wan2.2-t2v-a14b"].configs["full"]) == dict(PRESETS["wan"].configs["full"])
    for cls_name, names in shared.items():
        cls = getattr(diffusers, cls_name)
        for name in names:
            for size in SIZES:
                with torch.device("meta"):  # the released configs, no weights
                    model = cls(**PRESETS[name].configs[size])
                want = "wan" if (name, size) == ("wan2.2-t2v-a14b", "full") else name
                assert preset_of(model) == want, (name, size)
    # sibling checkpoints match no preset config: the closest full config wins. THUDM/CogVideoX-5b-I2V's
    # transformer (the image latent concatenated: 32 channels in; learned position embeddings), and a 2b variant
    # trained at other sample sizes; an SD3.5 Large fine-tune at another pos_embed_max_size; SDXL's inpainting UNet
    # (9 channels in)
    cls = diffusers.CogVideoXTransformer3DModel
    i2v = dict(PRESETS["cogvideox-5b"].configs["full"], in_channels=32, use_learned_positional_embeddings=True)
    wide = dict(PRESETS["cogvideox-2b"].configs["full"], sample_width=128, sample_frames=81)
    large = dict(PRESETS["sd3.5-large"].configs["full"], pos_embed_max_size=96)
    inpaint = dict(PRESETS["sdxl"].configs["full"], in_channels=9)
    for cls, config, name in (
        (diffusers.CogVideoXTransformer3DModel, i2v, "cogvideox-5b"),
        (diffusers.CogVideoXTransformer3DModel, wide, "cogvideox-2b"),
        (diffusers.SD3Transformer2DModel, large, "sd3.5-large"),
        (diffusers.UNet2DConditionModel, inpaint, "sdxl"),
    ):
        with torch.device("meta"):
            assert preset_of(cls(**config)) == name


def test_a_config_that_sets_more_than_a_preset_is_not_taken_for_it():
    # SD3.5 Large's tiny config is SD3's with QK norm: SD3's keys all match it, the class defaults tell them apart
    config = dict(PRESETS["sd3.5-large"].configs["tiny"])
    assert {k: v for k, v in config.items() if k != "qk_norm"} == dict(PRESETS["sd3"].configs["tiny"])
    assert preset_of(diffusers.SD3Transformer2DModel(**config)) == "sd3.5-large"


def test_sdxl_micro_conditioning_is_the_pipelines():
    # StableDiffusionXLPipeline._get_add_time_ids for an uncropped image at the requested size, and the pooled text
    # embedding as wide as the add embedding leaves beside the six size embeddings
    from types import SimpleNamespace

    from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline

    model = cached_tiny("sdxl")
    added = make_inputs(model, batch_size=2, height=48, width=64)["added_cond_kwargs"]
    pipe = SimpleNamespace(unet=model)
    want = StableDiffusionXLPipeline._get_add_time_ids(
        pipe, (48, 64), (0, 0), (48, 64), torch.float32, text_encoder_projection_dim=added["text_embeds"].shape[1]
    )
    assert torch.equal(added["time_ids"], want.repeat(2, 1))
    assert "added_cond_kwargs" not in make_inputs(cached_tiny("unet"))  # SD1.5: no micro-conditioning


def test_wan22_ti2v_takes_a_timestep_per_token():
    # WanPipeline(expand_timesteps=True): (batch, latent frames x (h / 2) x (w / 2)), one value per sample in
    # text-to-video
    inputs = make_inputs(cached_tiny("wan2.2-ti2v-5b"), batch_size=2, height=64, width=96, frames=9)
    assert inputs["hidden_states"].shape == (2, 48, 3, 4, 6)
    t = inputs["timestep"]
    assert t.shape == (2, 3 * 2 * 3) and torch.equal(t, t[:, :1].expand(2, 18))
    assert make_inputs(cached_tiny("wan2.1-1.3b"))["timestep"].shape == (1,)


def test_ltx2_audio_is_as_long_as_the_video_as_the_pipeline_makes_it():
    # LTX2Pipeline: 41 frames at 24 fps are 1.71 s of audio, 25 latent frames a second (16 kHz, hop 160, 4x VAE):
    # round(42.7) = 43 latent frames of 8 channels x 16 mel bins, packed to 128 features
    from types import SimpleNamespace

    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    inputs = make_inputs(cached_tiny("ltx-2"), batch_size=2, height=64, width=96, frames=41)
    pipe = SimpleNamespace(audio_vae_mel_compression_ratio=4, _pack_audio_latents=LTX2Pipeline._pack_audio_latents)
    audio = LTX2Pipeline.prepare_audio_latents(pipe, 2, num_channels_latents=8, audio_latent_length=43)
    assert inputs["audio_hidden_states"].shape == audio.shape == (2, 43, 128) and inputs["audio_num_frames"] == 43
    assert inputs["hidden_states"].shape == (2, 6 * 2 * 3, 128)
    assert inputs["encoder_hidden_states"].shape == inputs["audio_encoder_hidden_states"].shape


@pytest.mark.parametrize("size", [(32, 32, 5), (32, 64, 9), (64, 32, 1), (48, 80, 5)])
def test_cogvideox_rotary_tables_are_the_pipelines(size):
    # CogVideoXPipeline._prepare_rotary_positional_embeddings, run on the preset's model: the crop of the grid into
    # the config's sample size included (non-square grids crop differently)
    from types import SimpleNamespace

    from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline

    model = cached_tiny("cogvideox-5b")
    height, width, frames = size
    got = make_inputs(model, height=height, width=width, frames=frames)["image_rotary_emb"]
    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    want = CogVideoXPipeline._prepare_rotary_positional_embeddings(
        pipe, height, width, (frames - 1) // 4 + 1, torch.device("cpu")
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "image_rotary_emb" not in make_inputs(cached_tiny("cogvideox-2b"))  # sincos positions inside the model


# ------------------------------------------------------------------------------------------------------ inputs


def test_make_inputs_is_deterministic_and_leaves_global_rng_alone():
    model = cached_tiny("flux")
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    a, b, c = make_inputs(model, seed=1), make_inputs(model, seed=1), make_inputs(model, seed=2)
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert not torch.equal(a["hidden_states"], c["hidden_states"])


@settings(max_examples=15, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    batch=st.integers(1, 3),
    h_steps=st.integers(1, 4),
    w_steps=st.integers(1, 4),
    f_steps=st.integers(0, 2),
)
def test_output_shape_follows_requested_sizes(name, batch, h_steps, w_steps, f_steps):
    model = cached_tiny(name)
    height, width = h_steps * PIXEL_STEP[name], w_steps * PIXEL_STEP[name]
    if name == "dit":  # diffusers' DiT unpatchifies square latents only
        width = height
    sizes = {"height": height, "width": width}
    frames = 1
    if name in FRAME_STEP:
        frames = sizes["frames"] = f_steps * FRAME_STEP[name] + 1
    inputs = make_inputs(model, batch_size=batch, **sizes)
    with torch.no_grad():
        out = model_output(model(**inputs))
    assert out.shape == expected_output_shape(name, model.config, batch, height, width, frames)


# ------------------------------------------------------------------------------------------------------ step


def test_train_step_accumulates_without_optimizer_and_frees_grads_with_one():
    model = load_model("pixart")
    inputs = make_inputs(model)
    train_step(model, inputs)
    first = {k: p.grad.clone() for k, p in model.named_parameters()}
    train_step(model, inputs)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[k])

    model.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, inputs, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.grad is None for p in model.parameters())
    assert not states_equal(before, model)


def test_model_output_finds_the_tensor():
    t = torch.ones(2)
    assert model_output(t) is t
    assert model_output((t,)) is t
    assert model_output({"sample": t}) is t
    assert model_output(diffusers.models.modeling_outputs.Transformer2DModelOutput(sample=t)) is t
    with pytest.raises(TypeError):
        model_output(object())


# ------------------------------------------------------------------------------------------------------ errors


def test_bad_load_arguments_are_named():
    with pytest.raises(ValueError, match=r"flux.*dit.*folder"):
        load_model("not-a-preset")
    with pytest.raises(ValueError, match=r"size.*tiny.*small.*full"):
        load_model("flux", size="huge")
    with pytest.raises(ValueError, match="dtype"):
        load_model("flux", dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype"):
        load_model("flux", dtype="float32")


def test_folder_without_diffusers_files_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    cached_tiny("dit").save_config(tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_default_dtype_is_restored_when_construction_fails(monkeypatch):
    def boom(**config):
        raise RuntimeError("construction failed")

    monkeypatch.setattr(diffusers, "FluxTransformer2DModel", boom)
    with pytest.raises(RuntimeError, match="construction failed"):
        load_model("flux", dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(
    ("name", "sizes", "named"),
    [
        ("flux", {"depth": 3}, r"depth.*height, width, text_len"),
        ("dit", {"text_len": 8}, r"text_len.*height, width"),
        ("flux", {"height": 40}, "height"),
        ("sd3", {"width": 24}, "width"),
        ("sd3", {"height": 1024}, "height"),  # beyond the tiny position embedding
        ("auraflow", {"width": 512}, "width=512 exceeds the 256 px"),  # a 16x16 table of positions
        ("cogview4", {"text_len": 20}, "text_len=20 must be a multiple of 16"),
        ("z-image", {"height": 40}, r"height=40 must be a multiple of 16 \(8x VAE, patch 2\)"),
        ("z-image", {"text_len": 200}, r"text_len=200 needs 226 RoPE positions; the config's axes_lens has 128"),
        ("z-image", {"width": 1040}, r"width=1040 needs 65 RoPE positions"),
        ("lumina2", {"text_len": 64}, r"text_len=64 needs 65 RoPE positions; the config's axes_lens has 64"),
        ("lumina2", {"height": 24}, "height=24"),
        ("ltx-video", {"width": 48}, "width"),
        ("ltx-video", {"frames": 10}, "frames"),
        ("ltx-2", {"height": 48}, "height"),
        ("ltx-2", {"frames": 12}, "frames"),
        ("ltx-2", {"text_len": 64}, "text_len=64 must be a multiple of 128"),
        ("wan", {"frames": 6}, "frames"),
        ("wan2.2-ti2v-5b", {"height": 48}, r"height=48 must be a multiple of 32 \(16x VAE, patch 2\)"),
        ("sd3.5-medium", {"height": 1024}, "height"),  # beyond the tiny position embedding
        ("sdxl", {"width": 36}, "width"),
        ("hunyuanvideo", {"frames": 8}, "frames"),
        ("hunyuanvideo", {"height": 40}, "height"),
        ("mochi", {"frames": 9}, r"frames=9 must be 6\*k\+1"),
        ("mochi", {"width": 40}, "width"),
        ("hunyuanvideo-1.5", {"frames": 8}, "frames"),
        ("hunyuanvideo-1.5", {"height": 24}, "height"),
        ("cogvideox-5b", {"width": 24}, "width"),
        ("cogvideox-2b", {"text_len": 9}, r"text_len=9 must be 8 \(max_text_seq_length\)"),
        ("unet", {"text_len": 0}, "text_len"),
        ("pixart", {"height": 32.0}, "height"),
        ("dit", {"height": 32, "width": 64}, "height=32 and width=64"),
    ],
)
def test_bad_sizes_are_named(name, sizes, named):
    with pytest.raises(ValueError, match=named):
        make_inputs(cached_tiny(name), **sizes)


def test_bad_batch_size_and_unknown_model_class_are_named():
    with pytest.raises(ValueError, match="batch_size"):
        make_inputs(cached_tiny("wan"), batch_size=0)
    with pytest.raises(ValueError, match="Linear"):
        preset_of(torch.nn.Linear(2, 2))


def test_train_step_names_inputs_that_do_not_fit():
    model = load_model("flux")
    inputs = make_inputs(model)
    with pytest.raises(ValueError, match=r"inputs has keys .* does not take: \['foo'\]"):
        train_step(model, {**inputs, "foo": 1})
    partial = {k: v for k, v in inputs.items() if k != "hidden_states"}
    with pytest.raises(ValueError, match=r"inputs is missing \['hidden_states'\]"):
        train_step(model, partial)
    with pytest.raises(TypeError, match="inputs must be a mapping"):
        train_step(model, [inputs["hidden_states"]])


def test_the_diffusers_floor_is_declared_and_a_missing_model_class_says_so(monkeypatch):
    import dataclasses
    import re
    from pathlib import Path

    import diffusers

    from memkit import models

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'"diffusers>=([\d.]+)"', pyproject).group(1) == models.DIFFUSERS_FLOOR
    # as WanTransformer3DModel on diffusers 0.32: a class this diffusers does not have
    monkeypatch.setattr(diffusers, "__version__", "0.32.2")
    absent = dataclasses.replace(PRESETS["wan"], model_class="NoSuchTransformerModel")
    with pytest.raises(
        RuntimeError,
        match=r"preset 'wan' needs diffusers' NoSuchTransformerModel, which diffusers "
        r"0.32.2 does not have: memkit supports diffusers >= 0.35",
    ):
        models._build(absent, "tiny", torch.float32, 0, torch.device("cpu"))
