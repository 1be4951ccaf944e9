"""The model presets: each one's diffusers class, its config at three sizes, and its inputs.

A preset is everything memkit needs to build a model and feed it: the diffusers class behind Flux, SD3 (3.5 Large
and Medium share its class), LTX-Video, Wan (2.1 14B and 1.3B, 2.2 TI2V-5B and an A14B expert share one class),
HunyuanVideo, CogVideoX (5b and 2b), the SD1.5 and SDXL UNets, PixArt-Sigma, DiT, Sana, Qwen-Image, FLUX.2, Chroma,
AuraFlow or CogView4, its config at each size (``tiny``: tests; ``small``: 30-100M parameters, benchmarks; ``full``:
the released config),
the default input sizes, and the function that builds the forward's keyword arguments from pixel and token sizes.
Each preset's input builder sits right above its config, so adding a model is one block in this file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["PRESETS", "SIZES", "Preset"]

SIZES = ("tiny", "small", "full")

InputBuilder = Callable[[Mapping[str, Any], int, Mapping[str, int], "_Maker"], dict[str, Any]]


@dataclass(frozen=True)
class Preset:
    """A diffusers model class, its config at each size, the default sizes of its inputs, and how to build them.

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
    inputs: InputBuilder
    """``inputs(config, batch_size, sizes, make) -> forward kwargs``: shapes from the model's config and the
    pixel/token ``sizes``, tensors from ``make`` (the dtype, device and generator of `memkit.make_inputs`)."""
    hub_id: str = ""
    """The released model's hub id (``"black-forest-labs/FLUX.1-dev"``): the preset answers to it, offline, its
    ``full`` config being that repository's ``transformer/config.json`` (or ``unet/``)."""


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType({k: _frozen(v) if isinstance(v, Mapping) else v for k, v in mapping.items()})


def _preset(
    name: str,
    model_class: str,
    description: str,
    configs: dict,
    input_sizes: dict,
    inputs: InputBuilder,
    hub_id: str = "",
) -> Preset:
    return Preset(name, model_class, _frozen(configs), description, _frozen(input_sizes), inputs, hub_id)


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


# fmt: off
# The configs read as tables; the formatter would put every keyword on its own line.
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
    _flux_inputs,
    "black-forest-labs/FLUX.1-dev",
)



def _flux2_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # Flux2Pipeline: the VAE compresses 8x into 32 channels, 2x2 of which it patchifies and packs into one token of
    # in_channels (128); the prompt is Mistral-Small's hidden states of three layers side by side (joint_attention_dim,
    # 3 x 5120), padded to max_sequence_length; position ids (t, h, w, l) per token: (0, row, col, 0) for the image,
    # (0, 0, 0, i) for the text; the timestep in [0, 1] and the distilled guidance (guidance_scale=4.0)
    h, w = _latent(s, "height", 8, 2) // 2, _latent(s, "width", 8, 2) // 2
    arange = functools.partial(torch.arange, device=make.device)
    zero = arange(1)
    inputs = {
        "hidden_states": make.randn(b, h * w, cfg["in_channels"]),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["joint_attention_dim"]),
        "timestep": make.timestep(b, scale=1.0),
        "img_ids": torch.cartesian_prod(zero, arange(h), arange(w), zero).expand(b, -1, -1),
        "txt_ids": torch.cartesian_prod(zero, zero, zero, arange(s["text_len"])).expand(b, -1, -1),
    }
    if cfg["guidance_embeds"]:
        inputs["guidance"] = make.full((b,), 4.0)
    return inputs


_FLUX2 = _preset(
    "flux2-dev",
    "Flux2Transformer2DModel",
    "FLUX.2-dev transformer (32.2B at full size)",
    {
        "tiny": dict(in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=32, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)),
        "small": dict(in_channels=128, num_layers=2, num_single_layers=4, attention_head_dim=64, num_attention_heads=8,
                      joint_attention_dim=15360, axes_dims_rope=(16, 16, 16, 16)),
        # black-forest-labs/FLUX.2-dev transformer/config.json (diffusers' scripts/convert_flux2_to_diffusers.py,
        # "flux2-dev"; the class defaults)
        "full": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                     num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                     mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=512),  # the pipeline's default size and max_sequence_length
    },
    _flux2_inputs,
    "black-forest-labs/FLUX.2-dev",
)


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
    _sd3_inputs,
    "stabilityai/stable-diffusion-3-medium-diffusers",
)


# stabilityai/stable-diffusion-3.5-large and -medium transformer/config.json (diffusers' scripts/
# convert_sd3_to_diffusers.py reads each from the checkpoint: QK RMS norm; Medium's MMDiT-X blocks 0-12 attend over
# the image tokens a second time, "dual_attention_layers")
_SD35_FULL = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
                  joint_attention_dim=4096, pooled_projection_dim=2048, qk_norm="rms_norm")
_SD35_SIZES = {  # StableDiffusion3Pipeline's defaults: 1024x1024 px, 77 CLIP + 256 T5 tokens
    "tiny": dict(height=32, width=32, text_len=8),
    "small": dict(height=256, width=256, text_len=64),
    "full": dict(height=1024, width=1024, text_len=333),
}


_SD35_LARGE = _preset(
    "sd3.5-large",
    "SD3Transformer2DModel",
    "Stable Diffusion 3.5 Large MMDiT (8.1B at full size)",
    {
        "tiny": dict(sample_size=4, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                     pooled_projection_dim=32, pos_embed_max_size=16, qk_norm="rms_norm"),
        "small": dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=5,
                      attention_head_dim=64, num_attention_heads=8, joint_attention_dim=4096,
                      caption_projection_dim=512, pooled_projection_dim=2048, pos_embed_max_size=96,
                      qk_norm="rms_norm"),
        "full": dict(_SD35_FULL, num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                     pos_embed_max_size=192, dual_attention_layers=()),
    },
    _SD35_SIZES,
    _sd3_inputs,
    "stabilityai/stable-diffusion-3.5-large",
)


_SD35_MEDIUM = _preset(
    "sd3.5-medium",
    "SD3Transformer2DModel",
    "Stable Diffusion 3.5 Medium MMDiT-X (2.2B at full size; 2.5B with its position table)",
    {
        "tiny": dict(sample_size=4, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                     pooled_projection_dim=32, pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=(0,)),
        "small": dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=5,
                      attention_head_dim=64, num_attention_heads=8, joint_attention_dim=4096,
                      caption_projection_dim=512, pooled_projection_dim=2048, pos_embed_max_size=96,
                      qk_norm="rms_norm", dual_attention_layers=(0,)),
        "full": dict(_SD35_FULL, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                     pos_embed_max_size=384, dual_attention_layers=tuple(range(13))),
    },
    _SD35_SIZES,
    _sd3_inputs,
    "stabilityai/stable-diffusion-3.5-medium",
)


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
    _ltx_inputs,
    "Lightricks/LTX-Video",
)


def _wan_latents(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker, vae: int) -> dict[str, Any]:
    pt, ph, pw = cfg["patch_size"]
    h, w, f = _latent(s, "height", vae, ph), _latent(s, "width", vae, pw), _latent_frames(s, 4)
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


def _wan_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # WanPipeline with Wan2.1's VAE: 8x spatial, 4x temporal, 16 channels; UMT5 text (4096 wide)
    return _wan_latents(cfg, b, s, make, vae=8)


def _wan22_ti2v_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # WanPipeline(expand_timesteps=True) with Wan2.2's VAE: 16x spatial, 4x temporal, 48 channels; one timestep per
    # token (batch, tokens), the first frame's tokens at 0 for image-to-video: the time embedding and its six
    # modulations are per token, not per sample
    inputs = _wan_latents(cfg, b, s, make, vae=16)
    _, _, f, h, w = inputs["hidden_states"].shape
    pt, ph, pw = cfg["patch_size"]
    inputs["timestep"] = inputs["timestep"][:, None].expand(b, (f // pt) * (h // ph) * (w // pw))
    return inputs


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
        # Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (the 1.3B model: preset wan2.1-1.3b)
        "full": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    },
    {
        "tiny": dict(height=32, width=32, frames=5, text_len=8),
        "small": dict(height=128, width=128, frames=9, text_len=64),
        "full": dict(height=480, width=832, frames=17, text_len=512),
    },
    _wan_inputs,
    "Wan-AI/Wan2.1-T2V-14B-Diffusers",
)


# Wan-AI/Wan2.1-T2V-14B-Diffusers and the checkpoints below, transformer/config.json (diffusers'
# scripts/convert_wan_to_diffusers.py gives each: "Wan-T2V-1.3B", "Wan2.2-TI2V-5B", "Wan2.2-T2V-A14B")
_WAN_FULL = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# WanPipeline's defaults: 480x832 px, 81 frames, max_sequence_length 512
_WAN_SIZES = {
    "tiny": dict(height=32, width=32, frames=5, text_len=8),
    "small": dict(height=128, width=128, frames=9, text_len=64),
    "full": dict(height=480, width=832, frames=81, text_len=512),
}


_WAN_1_3B = _preset(
    "wan2.1-1.3b",
    "WanTransformer3DModel",
    "Wan2.1 T2V 1.3B transformer (1.4B at full size)",
    {
        "tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2, rope_max_seq_len=1024),
        "small": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16,
                      out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=2240, num_layers=6,
                      rope_max_seq_len=1024),
        "full": dict(_WAN_FULL, num_attention_heads=12, ffn_dim=8960, num_layers=30, in_channels=16, out_channels=16),
    },
    _WAN_SIZES,
    _wan_inputs,
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
)


_WAN22_TI2V_5B = _preset(
    "wan2.2-ti2v-5b",
    "WanTransformer3DModel",
    "Wan2.2 TI2V 5B transformer, 48-channel latents of its 16x VAE (5.0B at full size)",
    {
        "tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=48,
                     out_channels=48, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=1024),
        "small": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=48,
                      out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=2304, num_layers=6,
                      rope_max_seq_len=1024),
        "full": dict(_WAN_FULL, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48),
    },
    {
        "tiny": dict(height=64, width=64, frames=5, text_len=8),
        "small": dict(height=256, width=256, frames=9, text_len=64),
        # the model card's diffusers example, its 720P: 704x1280 px, 121 frames (WanPipeline's own 480x832 x 81
        # frames are the 480P of the other Wan checkpoints); max_sequence_length 512
        "full": dict(height=704, width=1280, frames=121, text_len=512),
    },
    _wan22_ti2v_inputs,
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
)


# Wan2.2 T2V A14B is two experts of this one architecture (transformer/ for the high-noise steps, transformer_2/ for
# the low-noise ones: 2 x 14.3B); a fine-tune trains one expert at a time, so the preset is one expert. Its config
# is Wan2.1-T2V-14B's: a model of it built outside memkit is the "wan" preset, with the same inputs.
_WAN22_T2V_A14B = _preset(
    "wan2.2-t2v-a14b",
    "WanTransformer3DModel",
    "Wan2.2 T2V A14B, one of its two expert transformers (14.3B each at full size; one is trained at a time)",
    {
        "tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=32, ffn_dim=80, num_layers=2, rope_max_seq_len=1024),
        "small": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16,
                      out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=2048, num_layers=7,
                      rope_max_seq_len=1024),
        "full": dict(_WAN_FULL, num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16, out_channels=16),
    },
    _WAN_SIZES,
    _wan_inputs,
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
)


def _hunyuan_video_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # HunyuanVideoPipeline: 8x spatial, 4x temporal VAE of 16 channels; LLaMA hidden states (4096 wide) with their
    # attention mask; CLIP's pooled output (768); the guidance scale times 1000 as the distilled guidance embedding.
    p, pt = cfg["patch_size"], cfg["patch_size_t"]
    h, w, f = _latent(s, "height", 8, p), _latent(s, "width", 8, p), _latent_frames(s, 4)
    if f % pt:
        raise ValueError(f"frames={s['frames']} gives {f} latent frames, not a multiple of patch_size_t={pt}")
    inputs = {
        "hidden_states": make.randn(b, cfg["in_channels"], f, h, w),
        "timestep": make.timestep(b),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["text_embed_dim"]),
        "encoder_attention_mask": make.full((b, s["text_len"]), 1.0),
        "pooled_projections": make.randn(b, cfg["pooled_projection_dim"]),
    }
    if cfg["guidance_embeds"]:
        inputs["guidance"] = make.full((b,), 6.0 * 1000.0)  # the pipeline's default guidance_scale=6.0, x1000
    return inputs


_HUNYUAN_VIDEO = _preset(
    "hunyuanvideo",
    "HunyuanVideoTransformer3DModel",
    "HunyuanVideo transformer (12.8B at full size; 13B in the paper)",
    {
        "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                     num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     guidance_embeds=True, text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(4, 6, 6)),
        "small": dict(in_channels=16, out_channels=16, num_attention_heads=8, attention_head_dim=64, num_layers=2,
                      num_single_layers=4, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                      guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                      rope_axes_dim=(16, 24, 24)),
        # hunyuanvideo-community/HunyuanVideo transformer/config.json (diffusers 0.32.0.dev0; the converted tencent/
        # HunyuanVideo that diffusers' docs and finetrainers load)
        "full": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                     rope_theta=256.0, rope_axes_dim=(16, 56, 56)),
    },
    {
        "tiny": dict(height=32, width=32, frames=5, text_len=8),
        "small": dict(height=128, width=128, frames=9, text_len=64),
        # finetrainers' memory tables (49x512x768); the pipeline's LLaMA max_sequence_length
        "full": dict(height=512, width=768, frames=49, text_len=256),
    },
    _hunyuan_video_inputs,
    "hunyuanvideo-community/HunyuanVideo",
)


def _resize_crop_region(grid: tuple[int, int], base_width: int, base_height: int) -> tuple[tuple[int, int], ...]:
    """pipeline_cogvideox.get_resize_crop_region_for_grid, the same arithmetic: importing the pipeline module loads
    transformers (seconds) for a dozen lines (tests/test_models.py checks the rotary tables equal the pipeline's)."""
    h, w = grid
    if h / w > base_height / base_width:
        height, width = base_height, int(round(base_height / h * w))
    else:
        width, height = base_width, int(round(base_width / w * h))
    top, left = int(round((base_height - height) / 2.0)), int(round((base_width - width) / 2.0))
    return (top, left), (top + height, left + width)


def _cogvideox_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # CogVideoXPipeline: 8x spatial, 4x temporal VAE of 16 channels, latents (batch, frames, channels, h, w); T5
    # hidden states padded to max_sequence_length (226).
    p = cfg["patch_size"]
    if cfg["patch_size_t"] is not None:
        raise ValueError("the cogvideox presets are CogVideoX 1.0 checkpoints (patch_size_t=None)")
    h, w, f = _latent(s, "height", 8, p), _latent(s, "width", 8, p), _latent_frames(s, 4)
    if not cfg["use_rotary_positional_embeddings"] and s["text_len"] != cfg["max_text_seq_length"]:
        raise ValueError(
            f"text_len={s['text_len']} must be {cfg['max_text_seq_length']} (max_text_seq_length): the sincos position "
            "table of a CogVideoX without rotary embeddings starts after exactly that many text tokens"
        )
    inputs = {
        "hidden_states": make.randn(b, f, cfg["in_channels"], h, w),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["text_embed_dim"]),
        "timestep": make.timestep(b),
    }
    if cfg["use_rotary_positional_embeddings"]:  # CogVideoXPipeline._prepare_rotary_positional_embeddings (1.0)
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        grid = (h // p, w // p)
        inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(
            embed_dim=cfg["attention_head_dim"],
            crops_coords=_resize_crop_region(grid, cfg["sample_width"] // p, cfg["sample_height"] // p),
            grid_size=grid,
            temporal_size=f,
            device=make.device,
        )
    return inputs


# THUDM/CogVideoX-5b and THUDM/CogVideoX-2b transformer/config.json: the two differ in depth, width and position
# embedding (diffusers' scripts/convert_cogvideox_to_diffusers.py: "For CogVideoX-2B, num_layers is 30. For 5B, it is
# 42"; heads 30 and 48; "For CogVideoX-2B, use_rotary_positional_embeddings is False. For 5B, it is True").
_COGVIDEOX_FULL = dict(activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=64, dropout=0.0,
                       flip_sin_to_cos=True, freq_shift=0, in_channels=16, max_text_seq_length=226,
                       norm_elementwise_affine=True, norm_eps=1e-5, out_channels=16, patch_size=2, sample_frames=49,
                       sample_height=60, sample_width=90, spatial_interpolation_scale=1.875,
                       temporal_compression_ratio=4, temporal_interpolation_scale=1.0, text_embed_dim=4096,
                       time_embed_dim=512, timestep_activation_fn="silu")
_COGVIDEOX_TINY = dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, out_channels=4, time_embed_dim=32,
                       text_embed_dim=32, num_layers=2, sample_width=4, sample_height=4, sample_frames=5,
                       max_text_seq_length=8, patch_size=2)
_COGVIDEOX_SMALL = dict(attention_head_dim=64, num_attention_heads=8, in_channels=16, out_channels=16,
                        time_embed_dim=512, text_embed_dim=4096, num_layers=8, sample_width=16, sample_height=16,
                        sample_frames=9, max_text_seq_length=64, patch_size=2)
# The pipeline's defaults: sample_height x 8 by sample_width x 8 px, sample_frames, T5 padded to 226 tokens; also
# finetrainers' memory tables (49x480x720).
_COGVIDEOX_SIZES = {
    "tiny": dict(height=32, width=32, frames=5, text_len=8),
    "small": dict(height=128, width=128, frames=9, text_len=64),
    "full": dict(height=480, width=720, frames=49, text_len=226),
}


_COGVIDEOX_5B = _preset(
    "cogvideox-5b",
    "CogVideoXTransformer3DModel",
    "CogVideoX-5b transformer (5.6B at full size)",
    {
        "tiny": dict(_COGVIDEOX_TINY, use_rotary_positional_embeddings=True),
        "small": dict(_COGVIDEOX_SMALL, use_rotary_positional_embeddings=True),
        "full": dict(_COGVIDEOX_FULL, num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True),
    },
    _COGVIDEOX_SIZES,
    _cogvideox_inputs,
    "THUDM/CogVideoX-5b",
)


_COGVIDEOX_2B = _preset(
    "cogvideox-2b",
    "CogVideoXTransformer3DModel",
    "CogVideoX-2b transformer (1.7B at full size; the 2B of its name)",
    {
        "tiny": dict(_COGVIDEOX_TINY, use_rotary_positional_embeddings=False),
        "small": dict(_COGVIDEOX_SMALL, use_rotary_positional_embeddings=False),
        "full": dict(_COGVIDEOX_FULL, num_attention_heads=30, num_layers=30, use_rotary_positional_embeddings=False),
    },
    _COGVIDEOX_SIZES,
    _cogvideox_inputs,
    "THUDM/CogVideoX-2b",
)


_SD_DOWN = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")


_SD_UP = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")


def _unet_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    h, w = _latent(s, "height", 8, 1), _latent(s, "width", 8, 1)
    inputs = {
        "sample": make.randn(b, cfg["in_channels"], h, w),
        "timestep": make.timestep(b),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["cross_attention_dim"]),
    }
    if cfg["addition_embed_type"] == "text_time":  # StableDiffusionXLPipeline's micro-conditioning
        # the second text encoder's pooled output beside six sizes in pixels, each embedded addition_time_embed_dim
        # wide: (original height, width, crop top, left, target height, width), no crop, original = target
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        sizes = torch.tensor([s["height"], s["width"], 0, 0, s["height"], s["width"]], device=make.device)
        inputs["added_cond_kwargs"] = {
            "text_embeds": make.randn(b, pooled),
            "time_ids": sizes.to(make.dtype).repeat(b, 1),
        }
    return inputs


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
    _unet_inputs,
    "stable-diffusion-v1-5/stable-diffusion-v1-5",
)


_SDXL_DOWN = ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")


_SDXL_UP = ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")


_SDXL = _preset(
    "sdxl",
    "UNet2DConditionModel",
    "Stable Diffusion XL base 1.0 UNet (2.6B at full size)",
    {
        "tiny": dict(sample_size=4, in_channels=4, out_channels=4, block_out_channels=(16, 24),
                     down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                     up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1, norm_num_groups=8,
                     cross_attention_dim=32, attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2),
                     use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                     projection_class_embeddings_input_dim=32 + 6 * 8),
        "small": dict(sample_size=32, in_channels=4, out_channels=4, down_block_types=_SDXL_DOWN,
                      up_block_types=_SDXL_UP, block_out_channels=(64, 128, 256), layers_per_block=2,
                      attention_head_dim=(1, 2, 4), transformer_layers_per_block=(1, 2, 2), cross_attention_dim=2048,
                      use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                      projection_class_embeddings_input_dim=1280 + 6 * 256),
        # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json: CLIP ViT-L and OpenCLIP bigG hidden states
        # concatenated (768 + 1280), bigG's pooled output (1280) beside the six size embeddings
        "full": dict(sample_size=128, in_channels=4, out_channels=4, down_block_types=_SDXL_DOWN,
                     up_block_types=_SDXL_UP, block_out_channels=(320, 640, 1280), layers_per_block=2,
                     norm_num_groups=32, attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10),
                     cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
                     addition_embed_type_num_heads=64, addition_time_embed_dim=256,
                     projection_class_embeddings_input_dim=2816),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=77),
        "full": dict(height=1024, width=1024, text_len=77),  # the pipeline's default: sample_size x 8 px; CLIP's 77
    },
    _unet_inputs,
    "stabilityai/stable-diffusion-xl-base-1.0",
)


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
    _pixart_inputs,
    "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
)


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
    _dit_inputs,
    "facebook/DiT-XL-2-256",
)


def _sana_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # SanaPipeline: the DC-AE compresses 32x into 32 latent channels; patch 1; Gemma-2 text, 300 tokens
    p = cfg["patch_size"]
    h, w = _latent(s, "height", 32, p), _latent(s, "width", 32, p)
    inputs = {
        "hidden_states": make.randn(b, cfg["in_channels"], h, w),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["caption_channels"]),
        "encoder_attention_mask": make.full((b, s["text_len"]), 1.0),
        "timestep": make.timestep(b),
    }
    if cfg["guidance_embeds"]:  # the distilled Sprint models
        inputs["guidance"] = make.full((b,), 4.5)
    return inputs


_SANA = _preset(
    "sana",
    "SanaTransformer2DModel",
    "Sana 1.6B 1024px linear-attention DiT (1.6B at full size)",
    {
        "tiny": dict(in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                     num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
                     caption_channels=32, sample_size=4, patch_size=1),
        "small": dict(in_channels=32, out_channels=32, num_attention_heads=12, attention_head_dim=64, num_layers=8,
                      num_cross_attention_heads=12, cross_attention_head_dim=64, cross_attention_dim=768,
                      caption_channels=2304, sample_size=8, patch_size=1),
        # Efficient-Large-Model/Sana_1600M_1024px_diffusers transformer/config.json (diffusers' class defaults)
        "full": dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                     num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                     caption_channels=2304, mlp_ratio=2.5, sample_size=32, patch_size=1, norm_eps=1e-6),
    },
    {
        "tiny": dict(height=64, width=64, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=300),  # SanaPipeline's max_sequence_length
    },
    _sana_inputs,
    "Efficient-Large-Model/Sana_1600M_1024px_diffusers",
)


def _qwen_image_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # QwenImagePipeline packs 2x2 latent pixels of 16 channels into one 64-channel token (VAE 8x, patch 2); the
    # prompt is Qwen2.5-VL's hidden states, unpadded for one prompt, so no mask (the pipeline drops an all-ones one)
    p = cfg["patch_size"]
    h, w = _latent(s, "height", 8, p) // p, _latent(s, "width", 8, p) // p
    inputs = {
        "hidden_states": make.randn(b, h * w, cfg["in_channels"]),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["joint_attention_dim"]),
        "timestep": make.timestep(b, scale=1.0),
        "img_shapes": [[(1, h, w)]] * b,
    }
    if cfg["guidance_embeds"]:
        inputs["guidance"] = make.full((b,), 4.0)
    return inputs


_QWEN_IMAGE = _preset(
    "qwen-image",
    "QwenImageTransformer2DModel",
    "Qwen-Image 20B MMDiT (20.4B at full size)",
    {
        "tiny": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        "small": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=4, attention_head_dim=64,
                      num_attention_heads=8, joint_attention_dim=3584, axes_dims_rope=(8, 28, 28)),
        # Qwen/Qwen-Image transformer/config.json (diffusers' class defaults)
        "full": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                     axes_dims_rope=(16, 56, 56)),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=512),  # the pipeline's max_sequence_length: the longest prompt
    },
    _qwen_image_inputs,
    "Qwen/Qwen-Image",
)

def _chroma_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # ChromaPipeline: Flux's packing (8x VAE of 16 channels, 2x2 latent pixels per 64-channel token, (0, row, col)
    # ids, zero text ids), T5 only, padded to max_sequence_length, and an attention mask over text and image tokens
    # (the pipeline masks the padding but its first token: the mask's values do not change the memory)
    h, w = _latent(s, "height", 8, 2) // 2, _latent(s, "width", 8, 2) // 2
    rows, cols = torch.meshgrid(torch.arange(h, device=make.device), torch.arange(w, device=make.device), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3)
    return {
        "hidden_states": make.randn(b, h * w, cfg["in_channels"]),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["joint_attention_dim"]),
        "timestep": make.timestep(b, scale=1.0),
        "img_ids": img_ids.to(make.dtype),
        "txt_ids": make.full((s["text_len"], 3), 0.0),
        "attention_mask": make.full((b, s["text_len"] + h * w), 1.0),
    }


_CHROMA = _preset(
    "chroma",
    "ChromaTransformer2DModel",
    "Chroma transformer, FLUX.1-schnell pruned, an approximator for modulation (8.9B at full size)",
    {
        "tiny": dict(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
                     approximator_hidden_dim=32, approximator_layers=1),
        # six single blocks: more than the memoization probe keeps (the small estimate checks its cut)
        "small": dict(in_channels=64, num_layers=2, num_single_layers=6, attention_head_dim=64, num_attention_heads=8,
                      joint_attention_dim=4096, axes_dims_rope=(8, 28, 28), approximator_num_channels=64,
                      approximator_hidden_dim=512, approximator_layers=2),
        # lodestones/Chroma transformer/config.json (diffusers' class defaults; lodestones/Chroma1-HD has the same)
        "full": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
                     approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=512),  # the pipeline's default size and max_sequence_length
    },
    _chroma_inputs,
    "lodestones/Chroma",
)


def _auraflow_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # AuraFlowPipeline: SDXL's VAE (8x, 4 channels), patches of 2 inside the model, Pile-T5 hidden states (2048 wide)
    # padded to max_sequence_length (256), the timestep in [0, 1]. The position table is a square grid of
    # pos_embed_max_size patches, centred on the image
    p, side = cfg["patch_size"], math.isqrt(cfg["pos_embed_max_size"])
    h, w = _latent(s, "height", 8, p), _latent(s, "width", 8, p)
    for key, extent in (("height", h), ("width", w)):
        if extent // p > side:
            raise ValueError(f"{key}={s[key]} exceeds the {side * p * 8} px the position embedding covers")
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], h, w),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["joint_attention_dim"]),
        "timestep": make.timestep(b, scale=1.0),
    }


_AURAFLOW = _preset(
    "auraflow",
    "AuraFlowTransformer2DModel",
    "AuraFlow v0.3 MMDiT (6.8B at full size)",
    {
        "tiny": dict(sample_size=4, patch_size=2, in_channels=4, out_channels=4, num_mmdit_layers=1,
                     num_single_dit_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                     caption_projection_dim=32, pos_embed_max_size=256),
        "small": dict(sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_mmdit_layers=2,
                      num_single_dit_layers=4, attention_head_dim=64, num_attention_heads=8, joint_attention_dim=2048,
                      caption_projection_dim=512, pos_embed_max_size=1024),
        # fal/AuraFlow-v0.3 transformer/config.json: diffusers' class defaults (its scripts/convert_aura_flow_to_
        # diffusers.py builds the class with them) but the position table: 96x96 patches, v0.3's 1536 px sides
        "full": dict(sample_size=64, patch_size=2, in_channels=4, out_channels=4, num_mmdit_layers=4,
                     num_single_dit_layers=32, attention_head_dim=256, num_attention_heads=12,
                     joint_attention_dim=2048, caption_projection_dim=3072, pos_embed_max_size=9216),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=256),  # the pipeline's defaults; max_sequence_length
    },
    _auraflow_inputs,
    "fal/AuraFlow-v0.3",
)


def _cogview4_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # CogView4Pipeline: an 8x VAE of 16 channels, patches of 2 inside the model; GLM-4's hidden states (4096 wide) of
    # the prompt as long as it is, left-padded to a multiple of 16 tokens; SDXL-like size conditions (original and
    # target size, crop corner); the timestep on the scheduler's 0-1000 scale
    p = cfg["patch_size"]
    h, w = _latent(s, "height", 8, p), _latent(s, "width", 8, p)
    if s["text_len"] % 16:
        raise ValueError(f"text_len={s['text_len']} must be a multiple of 16: the pipeline pads the prompt so")
    size = torch.tensor([[s["height"], s["width"]]], dtype=make.dtype, device=make.device).repeat(b, 1)
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], h, w),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["text_embed_dim"]),
        "timestep": make.timestep(b),
        "original_size": size,
        "target_size": size.clone(),
        "crop_coords": make.full((b, 2), 0.0),
    }


_COGVIEW4 = _preset(
    "cogview4",
    "CogView4Transformer2DModel",
    "CogView4-6B transformer (6.4B at full size; the 6B of its name)",
    {
        "tiny": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                     num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
                     pos_embed_max_size=16, sample_size=4),
        "small": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=6, attention_head_dim=64,
                      num_attention_heads=8, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                      pos_embed_max_size=128, sample_size=32),
        # THUDM/CogView4-6B transformer/config.json (diffusers' scripts/convert_cogview4_to_diffusers.py)
        "full": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=28, attention_head_dim=128,
                     num_attention_heads=32, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                     pos_embed_max_size=128, sample_size=128, rope_axes_dim=(256, 256)),
    },
    {
        "tiny": dict(height=32, width=32, text_len=16),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=1024),  # the pipeline's defaults; max_sequence_length
    },
    _cogview4_inputs,
    "THUDM/CogView4-6B",
)

# fmt: on

_ALL = (
    _FLUX, _SD3, _SD35_LARGE, _SD35_MEDIUM, _LTX, _WAN, _WAN_1_3B, _WAN22_TI2V_5B, _WAN22_T2V_A14B, _HUNYUAN_VIDEO,
    _COGVIDEOX_5B, _COGVIDEOX_2B, _UNET, _SDXL, _PIXART, _DIT, _SANA, _QWEN_IMAGE, _FLUX2, _CHROMA, _AURAFLOW,
    _COGVIEW4,
)  # fmt: skip
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _ALL})
"""Preset name -> `Preset`, in menu order."""
