"""The image presets that read the text through cross-attention or a class label: the SD1.5 and SDXL UNets,
PixArt-Sigma, DiT and Sana. Each preset's input builder sits right above its config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._base import _latent, _Maker, _preset

# fmt: off
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
# fmt: on
