"""Diffusion transformers with random weights at three sizes, their inputs, and one training step.

Every measurement in memkit needs a model and inputs of the right shapes. The presets build the diffusers
classes behind Flux, SD3, LTX-Video, Wan, the SD1.5 UNet, PixArt-Sigma and DiT from configs, never from the
hub:

- ``tiny``: two blocks and a few hundred thousand parameters, so tests run a full step in milliseconds;
- ``small``: 30-100M parameters, enough for timings and memory curves that mean something on a laptop;
- ``full``: the released config (Flux-dev is 11.9B parameters). Build it inside
  ``torch._subclasses.fake_tensor.FakeTensorMode`` to estimate memory without allocating any; building it for
  real needs the RAM of the real model.

``make_inputs`` gives every keyword the forward needs, in the model's dtype and on its device, at realistic
sizes for the preset size (full: 1024x1024 images for Flux, SD3 and PixArt; 512x512 for the UNet; 256x256 for
DiT; 480x704 px x 41 frames for LTX-Video; 480x832 px x 17 frames for Wan).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import diffusers
import huggingface_hub
import safetensors.torch
import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "PRESETS",
    "SIZES",
    "Preset",
    "check_inputs",
    "load_model",
    "make_inputs",
    "model_output",
    "preset_of",
    "train_step",
]

SIZES = ("tiny", "small", "full")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class Preset:
    """A diffusers model class, its config at each size, and the default sizes of its inputs.

    Example:
        >>> p = memkit.PRESETS["flux"]
        >>> p.model_class, p.description, p.input_sizes["full"]
    """

    name: str
    """Key in `PRESETS`."""
    model_class: str
    """Name of the class in `diffusers`, e.g. ``"FluxTransformer2DModel"``."""
    configs: Mapping[str, Mapping[str, Any]]
    """Size (one of `SIZES`) -> keyword arguments of the class."""
    description: str
    """One line for menus and reports."""
    input_sizes: Mapping[str, Mapping[str, int]]
    """Size -> default `make_inputs` sizes: ``height``/``width`` in pixels, ``frames``, ``text_len`` in tokens.
    Its keys are the only size keywords the preset accepts."""


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType({k: _frozen(v) if isinstance(v, Mapping) else v for k, v in mapping.items()})


def _preset(name: str, model_class: str, description: str, configs: dict, input_sizes: dict) -> Preset:
    return Preset(name, model_class, _frozen(configs), description, _frozen(input_sizes))


# fmt: off
# The configs read as tables; the formatter would put every keyword on its own line.
_FLUX = _preset(
    "flux",
    "FluxTransformer2DModel",
    "FLUX.1-dev transformer (11.9B at full size)",
    {
        "tiny": dict(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
        "small": dict(in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64, num_attention_heads=8,
                      joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                      axes_dims_rope=(8, 28, 28)),
        # black-forest-labs/FLUX.1-dev transformer/config.json
        "full": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                     axes_dims_rope=(16, 56, 56)),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=512),  # T5 max_sequence_length of FLUX.1-dev
    },
)

_SD3 = _preset(
    "sd3",
    "SD3Transformer2DModel",
    "Stable Diffusion 3 Medium MMDiT (2.0B at full size)",
    {
        "tiny": dict(sample_size=4, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                     pooled_projection_dim=32, pos_embed_max_size=16),
        "small": dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=4,
                      attention_head_dim=64, num_attention_heads=8, joint_attention_dim=4096,
                      caption_projection_dim=512, pooled_projection_dim=2048, pos_embed_max_size=96),
        # stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json
        "full": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                     attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                     caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=333),  # 77 CLIP + 256 T5 tokens
    },
)

_LTX = _preset(
    "ltx-video",
    "LTXVideoTransformer3DModel",
    "LTX-Video 0.9 transformer (1.9B at full size)",
    {
        "tiny": dict(in_channels=128, out_channels=128, num_attention_heads=2, attention_head_dim=16,
                     cross_attention_dim=32, num_layers=2, caption_channels=32),
        "small": dict(in_channels=128, out_channels=128, num_attention_heads=8, attention_head_dim=64,
                      cross_attention_dim=512, num_layers=8, caption_channels=4096),
        # Lightricks/LTX-Video transformer/config.json
        "full": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                     attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
                     qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                     caption_channels=4096, attention_bias=True, attention_out_bias=True),
    },
    {
        "tiny": dict(height=64, width=64, frames=9, text_len=8),
        "small": dict(height=256, width=256, frames=17, text_len=64),
        "full": dict(height=480, width=704, frames=41, text_len=128),
    },
)

_WAN = _preset(
    "wan",
    "WanTransformer3DModel",
    "Wan2.1 T2V 14B transformer (14.3B at full size)",
    {
        "tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=1024),
        "small": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16,
                      out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=2048, num_layers=8,
                      rope_max_seq_len=1024),
        # Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (the 1.3B model: 12 heads, ffn 8960, 30 layers)
        "full": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    },
    {
        "tiny": dict(height=32, width=32, frames=5, text_len=8),
        "small": dict(height=128, width=128, frames=9, text_len=64),
        "full": dict(height=480, width=832, frames=17, text_len=512),
    },
)

_SD_DOWN = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
_SD_UP = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
_UNET = _preset(
    "unet",
    "UNet2DConditionModel",
    "Stable Diffusion 1.5 UNet (860M at full size)",
    {
        "tiny": dict(sample_size=4, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                     down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                     up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1, norm_num_groups=8,
                     cross_attention_dim=16, attention_head_dim=2),
        "small": dict(sample_size=32, in_channels=4, out_channels=4, down_block_types=_SD_DOWN, up_block_types=_SD_UP,
                      block_out_channels=(64, 128, 256, 256), layers_per_block=2, cross_attention_dim=768,
                      attention_head_dim=8),
        # stable-diffusion-v1-5/stable-diffusion-v1-5 unet/config.json
        "full": dict(sample_size=64, in_channels=4, out_channels=4, down_block_types=_SD_DOWN, up_block_types=_SD_UP,
                     block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, norm_num_groups=32,
                     cross_attention_dim=768, attention_head_dim=8),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=77),
        "full": dict(height=512, width=512, text_len=77),
    },
)

_PIXART = _preset(
    "pixart",
    "PixArtTransformer2DModel",
    "PixArt-Sigma XL-2 1024 transformer (0.6B at full size)",
    {
        "tiny": dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
                     cross_attention_dim=32, sample_size=4, patch_size=2, caption_channels=32,
                     use_additional_conditions=False),
        "small": dict(num_attention_heads=8, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=8,
                      cross_attention_dim=512, sample_size=32, patch_size=2, caption_channels=4096,
                      use_additional_conditions=False),
        # PixArt-alpha/PixArt-Sigma-XL-2-1024-MS transformer/config.json (no micro-conditions)
        "full": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                     cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
                     activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                     norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096, interpolation_scale=2,
                     use_additional_conditions=False),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=300),  # T5 max_sequence_length of PixArt-Sigma
    },
)

_DIT = _preset(
    "dit",
    "DiTTransformer2DModel",
    "DiT-XL/2 256 class-conditional transformer (750M at full size in diffusers, 675M in the paper)",
    {
        "tiny": dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
                     sample_size=4, patch_size=2),
        # DiT-S/2 of the DiT paper (33M)
        "small": dict(num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=12,
                      sample_size=32, patch_size=2),
        # facebook/DiT-XL-2-256 transformer/config.json. diffusers gives each of the 28 blocks its own copy of the
        # timestep and class embedder (2.77M parameters each), hence 750M where the paper counts 675M.
        "full": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                     sample_size=32, patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                     norm_type="ada_norm_zero", norm_elementwise_affine=False),
    },
    {
        "tiny": dict(height=32, width=32),
        "small": dict(height=256, width=256),
        "full": dict(height=256, width=256),
    },
)

# fmt: on

PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (_FLUX, _SD3, _LTX, _WAN, _UNET, _PIXART, _DIT)})
_PRESET_BY_CLASS = {p.model_class: p.name for p in PRESETS.values()}


# ----------------------------------------------------------------------------------------------------- loading


def load_model(
    name_or_path: str | os.PathLike,
    size: str = "tiny",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Build a preset with random weights, or load a diffusers model saved in a local folder.

    A preset is built from its config at ``size`` with weights drawn from ``seed`` (same seed, bit-identical
    ``state_dict``; the caller's RNG is untouched), directly in ``dtype`` and on ``device``, in train mode.
    Parameters a model initialises to all zeros (output projections, norm biases) get small random values so
    every parameter receives a gradient: this is a model for measuring, not for sampling. Inside
    ``FakeTensorMode`` nothing is allocated, which is how ``"full"`` sizes are meant to be used; building a full
    model for real takes the memory of the real model (48 GB for Flux in float32).

    Any other ``name_or_path`` must be a folder written by ``save_pretrained`` (``config.json`` with
    ``_class_name`` and ``diffusion_pytorch_model*.safetensors``, sharded or not). The class is built from the
    config as a preset is, every parameter in ``dtype``, and filled from the files: the result computes bit for
    bit like the model that was saved. ``size`` and ``seed`` do not apply, and the network is never used. A
    name that is not a preset and not a folder but looks like a hub id (``"owner/name"``) is downloaded with
    ``huggingface_hub`` and loaded the same way from its ``transformer/`` or ``unet/`` folder. A preset name
    wins over a folder of the same name.

    Example:
        >>> model = load_model("flux", "tiny", dtype=torch.bfloat16)
        >>> loss = train_step(model, make_inputs(model))
        >>> with FakeTensorMode(): big = load_model("flux", "full")  # 11.9B parameters, no memory
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, one of {_DTYPES}, got {dtype!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be a floating torch.dtype, one of {_DTYPES}, got {dtype}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    device = torch.device(device)
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return _build(PRESETS[name_or_path], size, dtype, seed, device)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _load_folder(path, dtype, device)
    if isinstance(name_or_path, str) and _HUB_ID.fullmatch(name_or_path) and not name_or_path.startswith("."):
        return _load_hub(name_or_path, dtype, device)
    raise ValueError(
        f"unknown model {os.fspath(name_or_path)!r}: use a preset ({', '.join(PRESETS)}) "
        "or a local folder holding a diffusers config.json and safetensors weights"
    )


def _build(preset: Preset, size: str, dtype: torch.dtype, seed: int, device: torch.device) -> torch.nn.Module:
    cls = getattr(diffusers, preset.model_class)
    # Construct in the target dtype and device: `module.to()` would allocate twice and fails on fake tensors.
    with _default_dtype(dtype), _forked_rng(device), device:
        torch.manual_seed(seed)
        model = cls(**preset.configs[size])
        _fill_zero_parameters(model)
    model._memkit_preset, model._memkit_size = preset.name, size
    return model.train()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _forked_rng(device: torch.device) -> contextlib.AbstractContextManager:
    accelerator = device.type not in ("cpu", "meta")
    return torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type)


@torch.no_grad()
def _fill_zero_parameters(model: torch.nn.Module, std: float = 0.02) -> None:
    # A zero-initialised output projection blocks every gradient upstream of it, which would make the
    # gradient checks of the optimizations vacuous.
    for p in model.parameters():
        if not is_fake(p) and p.device.type != "meta" and not p.any():
            p.normal_(0.0, std)


def _load_folder(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    # Built like a preset, then filled from the files. diffusers' `from_pretrained` without `accelerate` (not a
    # memkit dependency) returns float32 SD3 weights when asked for bfloat16, refuses Wan in bfloat16, and leaves
    # CPU tensors off the allocator's alignment, which moves outputs by ~1e-7 from the model that was saved.
    config_file = path / "config.json"
    class_name = json.loads(config_file.read_text()).get("_class_name") if config_file.is_file() else None
    cls = getattr(diffusers, class_name, None) if isinstance(class_name, str) else None
    if cls is None:
        raise ValueError(f"{path} holds no diffusers config.json with a known _class_name (got {class_name!r})")
    index = path / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [path / "diffusion_pytorch_model.safetensors"]
    if not all(f.is_file() for f in files):
        raise ValueError(f"{path} holds no diffusion_pytorch_model .safetensors weights: use save_pretrained()")
    skip_init = getattr(diffusers.models.modeling_utils, "no_init_weights", contextlib.nullcontext)
    with _default_dtype(dtype), device, skip_init():
        model = cls.from_config(cls.load_config(path))
    missing, unexpected = set(model.state_dict()), set()
    for file in files:
        state = safetensors.torch.load_file(file)
        unexpected |= set(model.load_state_dict(state, strict=False).unexpected_keys)
        missing -= set(state)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit {class_name}: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    return _tag(model)


def _load_hub(repo_id: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    patterns = ["config.json", "diffusion_pytorch_model*", "transformer/*", "unet/*"]  # not the text encoders
    root = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    for folder in (root / "transformer", root / "unet", root):  # a pipeline's denoiser, or a model repo
        if (folder / "config.json").is_file():
            return _load_folder(folder, dtype, device)
    raise ValueError(f"{repo_id} has no transformer/ or unet/ folder with a config.json")


def _tag(model: torch.nn.Module) -> torch.nn.Module:
    name = _PRESET_BY_CLASS.get(type(model).__name__)
    if name is not None:
        model._memkit_preset, model._memkit_size = name, _matching_size(model, PRESETS[name])
    return model.train()


def _matching_size(model: torch.nn.Module, preset: Preset) -> str:
    """The preset size whose config the model's config matches; ``"full"`` for any other checkpoint."""

    def plain(value: Any) -> Any:
        return json.loads(json.dumps(value))

    config = getattr(model, "config", {})
    for size in SIZES:
        if all(plain(config.get(k)) == plain(v) for k, v in preset.configs[size].items()):
            return size
    return "full"


def preset_of(model: torch.nn.Module) -> str:
    """Name of the preset a model belongs to: the one `load_model` recorded, else found by its class.

    Used by `make_inputs` to know the shapes a model expects. Wrappers such as ``torch.compile`` are seen
    through.

    Example:
        >>> preset_of(load_model("wan"))
        'wan'
        >>> preset_of(diffusers.DiTTransformer2DModel(**PRESETS["dit"].configs["tiny"]))  # by class: 'dit'
    """
    model = getattr(model, "_orig_mod", model)
    name = getattr(model, "_memkit_preset", None) or _PRESET_BY_CLASS.get(type(model).__name__)
    if name is None:
        raise ValueError(f"no memkit preset for {type(model).__name__}; known classes: {', '.join(_PRESET_BY_CLASS)}")
    return name


# ------------------------------------------------------------------------------------------------------ inputs


def make_inputs(model: torch.nn.Module, batch_size: int = 1, seed: int = 0, **sizes: int) -> dict[str, Any]:
    """The keyword arguments of ``model(**inputs)``, random but deterministic for ``seed``, with realistic shapes.

    Sizes are in pixels and tokens, as a user thinks of them: ``height``, ``width`` (pixels; the latent is
    what the preset's VAE makes of them, /8 or /32 for LTX-Video, and must split into whole patches),
    ``frames`` (video presets; 4k+1 for Wan, 8k+1 for LTX-Video) and ``text_len`` (text tokens; not for DiT).
    Defaults follow the size the model was built at (see ``PRESETS[name].input_sizes``); a model loaded from a
    folder that matches no preset config gets the full-size defaults. Float tensors are in the model's dtype
    and on its device; the global RNG is untouched; works inside ``FakeTensorMode``. The output is requested as
    a tuple (``return_dict=False``): use `model_output` to get the tensor.

    Example:
        >>> model = load_model("ltx-video")
        >>> inputs = make_inputs(model, batch_size=2, height=64, width=96, frames=17)
        >>> model_output(model(**inputs)).shape  # (2, 3 * 2 * 3, 128)
    """
    name = preset_of(model)
    defaults = PRESETS[name].input_sizes[_size_of(model)]
    unknown = sorted(set(sizes) - set(defaults))
    if unknown:
        raise ValueError(f"unknown size {', '.join(unknown)} for preset {name!r}; allowed: {', '.join(defaults)}")
    for key, value in {"batch_size": batch_size, **sizes}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    param = next(p for p in model.parameters() if p.is_floating_point())
    make = _Maker(param.dtype, param.device, seed)
    inputs = _INPUTS[name](model.config, batch_size, {**defaults, **sizes}, make)
    return inputs | {"return_dict": False}


def _size_of(model: torch.nn.Module) -> str:
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "_memkit_size", None) or _matching_size(model, PRESETS[preset_of(model)])


class _Maker:
    """Tensor factories bound to a dtype, a device and a private generator."""

    def __init__(self, dtype: torch.dtype, device: torch.device, seed: int) -> None:
        self.dtype, self.device = dtype, device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, dtype=self.dtype, device=self.device)

    def timestep(self, batch_size: int, scale: float = 1000.0) -> torch.Tensor:
        return torch.rand(batch_size, generator=self.generator, device=self.device).mul(scale).to(self.dtype)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(high, shape, generator=self.generator, device=self.device)

    def full(self, shape: tuple[int, ...], value: float) -> torch.Tensor:
        return torch.full(shape, value, dtype=self.dtype, device=self.device)


def _latent(sizes: Mapping[str, int], key: str, vae: int, patch: int) -> int:
    """Latent extent of a pixel size, checked to split into whole patches."""
    value = sizes[key]
    if value % (vae * patch):
        raise ValueError(f"{key}={value} must be a multiple of {vae * patch} ({vae}x VAE, patch {patch})")
    return value // vae


def _latent_frames(sizes: Mapping[str, int], vae_t: int) -> int:
    frames = sizes["frames"]
    if (frames - 1) % vae_t:
        raise ValueError(f"frames={frames} must be {vae_t}*k+1: the video VAE keeps the first frame apart")
    return (frames - 1) // vae_t + 1


def _flux_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # The pipeline packs 2x2 latent pixels of 16 channels into one 64-channel token.
    h, w = _latent(s, "height", 8, 2) // 2, _latent(s, "width", 8, 2) // 2
    rows, cols = torch.meshgrid(torch.arange(h, device=make.device), torch.arange(w, device=make.device), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3)  # (0, row, col) per token
    inputs = {
        "hidden_states": make.randn(b, h * w, cfg["in_channels"]),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["joint_attention_dim"]),
        "pooled_projections": make.randn(b, cfg["pooled_projection_dim"]),
        "timestep": make.timestep(b, scale=1.0),
        "img_ids": img_ids.to(make.dtype),
        "txt_ids": make.full((s["text_len"], 3), 0.0),
    }
    if cfg["guidance_embeds"]:
        inputs["guidance"] = make.full((b,), 3.5)
    return inputs


def _sd3_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    p, limit = cfg["patch_size"], cfg["pos_embed_max_size"]
    h, w = _latent(s, "height", 8, p), _latent(s, "width", 8, p)
    for key, extent in (("height", h), ("width", w)):
        if limit and extent // p > limit:
            raise ValueError(f"{key}={s[key]} exceeds the {limit * p * 8} px the position embedding covers")
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], h, w),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["joint_attention_dim"]),
        "pooled_projections": make.randn(b, cfg["pooled_projection_dim"]),
        "timestep": make.timestep(b),
    }


def _ltx_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    p, pt = cfg["patch_size"], cfg["patch_size_t"]
    h, w = _latent(s, "height", 32, p) // p, _latent(s, "width", 32, p) // p
    f = _latent_frames(s, 8)
    if f % pt:
        raise ValueError(f"frames={s['frames']} gives {f} latent frames, not a multiple of patch_size_t={pt}")
    f //= pt
    return {
        "hidden_states": make.randn(b, f * h * w, cfg["in_channels"]),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["caption_channels"]),
        "timestep": make.timestep(b),
        "encoder_attention_mask": make.full((b, s["text_len"]), 1.0),
        "num_frames": f,
        "height": h,
        "width": w,
        # What LTXPipeline passes at its default 25 fps: (temporal VAE ratio / fps, spatial, spatial).
        "rope_interpolation_scale": (8 / 25, 32, 32),
    }


def _wan_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    pt, ph, pw = cfg["patch_size"]
    h, w, f = _latent(s, "height", 8, ph), _latent(s, "width", 8, pw), _latent_frames(s, 4)
    if f % pt:
        raise ValueError(f"frames={s['frames']} gives {f} latent frames, not a multiple of patch {pt}")
    limit = cfg["rope_max_seq_len"]
    for key, extent in (("frames", f // pt), ("height", h // ph), ("width", w // pw)):
        if extent > limit:
            raise ValueError(f"{key}={s[key]} gives {extent} positions, over rope_max_seq_len={limit}")
    inputs = {
        "hidden_states": make.randn(b, cfg["in_channels"], f, h, w),
        "timestep": make.timestep(b),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["text_dim"]),
    }
    if cfg.get("image_dim"):  # image-to-video checkpoints: 257 CLIP image tokens
        inputs["encoder_hidden_states_image"] = make.randn(b, 257, cfg["image_dim"])
    return inputs


def _unet_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    h, w = _latent(s, "height", 8, 1), _latent(s, "width", 8, 1)
    return {
        "sample": make.randn(b, cfg["in_channels"], h, w),
        "timestep": make.timestep(b),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["cross_attention_dim"]),
    }


def _pixart_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    p = cfg["patch_size"]
    h, w = _latent(s, "height", 8, p), _latent(s, "width", 8, p)
    micro = cfg["use_additional_conditions"]
    if micro is None:  # PixArtTransformer2DModel's own rule
        micro = cfg["sample_size"] == 128
    added = {"resolution": None, "aspect_ratio": None}
    if micro:
        resolution = torch.cat([make.full((b, 1), s["height"]), make.full((b, 1), s["width"])], dim=1)
        added = {"resolution": resolution, "aspect_ratio": make.full((b, 1), s["height"] / s["width"])}
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], h, w),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["caption_channels"]),
        "encoder_attention_mask": make.full((b, s["text_len"]), 1.0),
        "timestep": make.timestep(b),
        "added_cond_kwargs": added,
    }


def _dit_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    p = cfg["patch_size"]
    h, w = _latent(s, "height", 8, p), _latent(s, "width", 8, p)
    if h != w:
        raise ValueError(f"height={s['height']} and width={s['width']} must be equal: DiT unpatchifies squares only")
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], h, w),
        "timestep": make.timestep(b),
        "class_labels": make.randint(cfg["num_embeds_ada_norm"], b),
    }


_INPUTS: dict[str, Callable[[Mapping, int, Mapping[str, int], _Maker], dict[str, Any]]] = {
    "flux": _flux_inputs,
    "sd3": _sd3_inputs,
    "ltx-video": _ltx_inputs,
    "wan": _wan_inputs,
    "unet": _unet_inputs,
    "pixart": _pixart_inputs,
    "dit": _dit_inputs,
}


# -------------------------------------------------------------------------------------------------------- step


def model_output(out: Any) -> torch.Tensor:
    """The prediction tensor in whatever a diffusers forward returned: a tensor, ``.sample``, or a tuple.

    Example:
        >>> out = model(**make_inputs(model))
        >>> model_output(out).shape
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and "sample" in out:
        return out["sample"]
    if isinstance(getattr(out, "sample", None), torch.Tensor):
        return out.sample
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")


def check_inputs(model: torch.nn.Module, inputs: Any) -> None:
    """Raise a ValueError naming ``inputs`` when its keys don't fit ``model.forward`` (unknown or missing).

    Shapes are checked by the model itself; build inputs with :func:`make_inputs` to get them right.

    Example:
        >>> check_inputs(model, {"hidden_states": x})   # ValueError: inputs is missing 'timestep', ...
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a mapping of forward keyword arguments, got {type(inputs).__name__}")
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(inputs) - set(params))
    if unknown:
        raise ValueError(
            f"inputs has keys that {type(model).__name__}.forward does not take: {unknown}; it takes {sorted(params)}"
        )
    missing = sorted(
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and n not in inputs
    )
    if missing:
        raise ValueError(f"inputs is missing {missing} for {type(model).__name__}.forward; see memkit.make_inputs")


def train_step(
    model: torch.nn.Module, inputs: Mapping[str, Any], optimizer: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    """One forward, backward and (optionally) optimizer step; returns the loss, detached.

    The loss is ``mean(output ** 2)`` in float32: a stand-in for the diffusion loss with the same memory shape
    (activations kept for backward, one gradient per parameter) without needing targets. Without an
    optimizer, gradients accumulate across calls as in a plain loop; with one, it steps and frees them
    (``zero_grad(set_to_none=True)``), so they do not count towards the next step's peak.

    Example:
        >>> model = load_model("sd3")
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> loss = train_step(model, make_inputs(model), optimizer)
    """
    check_inputs(model, inputs)
    loss = model_output(model(**inputs)).float().pow(2).mean()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()
