"""The image presets whose text and image tokens share the attention (MMDiT and its kin): FLUX.1 and FLUX.2, SD3 and
SD3.5, Qwen-Image, Chroma, AuraFlow, CogView4, and the single-stream Z-Image and Lumina-Image 2.0 (text and image
refined apart, then one sequence). Each preset's input builder sits right above its config."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from ._base import _latent, _Maker, _preset


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


def _rope_covers(cfg_lens: Any, s: Mapping[str, int], text_end: int, h: int, w: int) -> None:
    """Raise a ValueError naming the size whose RoPE positions (caption positions up to ``text_end``, then ``h`` x
    ``w`` image tokens) run past the tables the config builds (``axes_lens``): the real model fails to index them."""
    for key, end, limit in (("text_len", text_end, cfg_lens[0]), ("height", h, cfg_lens[1]), ("width", w, cfg_lens[2])):
        if end > limit:
            raise ValueError(f"{key}={s[key]} needs {end} RoPE positions; the config's axes_lens has {limit}")


def _z_image_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # ZImagePipeline and diffusers' train_dreambooth_lora_z_image.py: an 8x VAE of 16 channels, patches of 2 inside
    # the model; each sample's latent (C, 1, H, W) in a list (latents.unsqueeze(2).unbind(0): views of one batch);
    # each prompt Qwen3's hidden states (cap_feat_dim, 2560) of its own tokens only, no padding (a list:
    # prompt_embeds[i][mask[i]]); the timestep (1000 - t) / 1000, in [0, 1]. The model pads the caption to a multiple
    # of 32 and puts the image after it on RoPE's first axis
    p = cfg["all_patch_size"][0]
    h, w = _latent(s, "height", 8, p), _latent(s, "width", 8, p)
    _rope_covers(cfg["axes_lens"], s, -(-s["text_len"] // 32) * 32 + 2, h // p, w // p)
    latents = make.randn(b, cfg["in_channels"], 1, h, w)
    return {
        "x": list(latents.unbind(0)),
        "t": make.timestep(b, scale=1.0),
        "cap_feats": [make.randn(s["text_len"], cfg["cap_feat_dim"]) for _ in range(b)],
    }


_Z_IMAGE = _preset(
    "z-image",
    "ZImageTransformer2DModel",
    "Z-Image-Turbo single-stream DiT (6.2B at full size; the 6B of its model card)",
    {
        # the timestep MLP is 256 -> 1024 -> 256 wide whatever the width (diffusers fixes it): 0.3M of the tiny one
        "tiny": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                     n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=(4, 6, 6),
                     axes_lens=(128, 32, 32)),
        "small": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=512, n_layers=6,
                      n_refiner_layers=2, n_heads=8, n_kv_heads=8, cap_feat_dim=2560, axes_dims=(16, 24, 24),
                      axes_lens=(1536, 512, 512)),
        # Tongyi-MAI/Z-Image-Turbo transformer/config.json: the constants of Tongyi-MAI/Z-Image's src/config/model.py,
        # which its loader (src/utils/loader.py) falls back to for that file's keys; diffusers' class defaults but the
        # RoPE table's caption axis (1536 positions)
        "full": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                     n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                     rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512)),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=512),  # the pipeline's default size and max_sequence_length
    },
    _z_image_inputs,
    "Tongyi-MAI/Z-Image-Turbo",
)


def _lumina2_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # Lumina2Pipeline and diffusers' train_dreambooth_lora_lumina2.py: FLUX's VAE (8x, 16 channels), patches of 2
    # inside the model; Gemma-2's hidden states (cap_feat_dim, 2304) of the system prompt and the prompt, padded to
    # max_sequence_length, and the tokenizer's attention mask (int64); the timestep in [0, 1]. The model
    # sums the mask into each caption's length (.tolist()) and joins that many text tokens to the image: the mask
    # carries its values under fake tensors (make.known), all ones, a prompt that fills max_sequence_length (the most
    # memory)
    p = cfg["patch_size"]
    h, w = _latent(s, "height", 8, p), _latent(s, "width", 8, p)
    _rope_covers(cfg["axes_lens"], s, s["text_len"] + 1, h // p, w // p)
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], h, w),
        "timestep": make.timestep(b, scale=1.0),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["cap_feat_dim"]),
        "encoder_attention_mask": make.mask(b, s["text_len"], dtype=torch.long),
    }


_LUMINA2 = _preset(
    "lumina2",
    "Lumina2Transformer2DModel",
    "Lumina-Image 2.0 unified next-DiT (2.6B at full size)",
    {
        "tiny": dict(sample_size=4, patch_size=2, in_channels=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
                     num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
                     axes_lens=(64, 32, 32), cap_feat_dim=32),
        "small": dict(sample_size=32, patch_size=2, in_channels=16, hidden_size=512, num_layers=6,
                      num_refiner_layers=2, num_attention_heads=8, num_kv_heads=4, multiple_of=256,
                      axes_dim_rope=(16, 24, 24), axes_lens=(300, 512, 512), cap_feat_dim=2304),
        # Alpha-VLLM/Lumina-Image-2.0 transformer/config.json: its GitHub repository's models/model.py
        # (NextDiT_2B_GQA_patch2_Adaln_Refiner: 2304 wide, 26 layers, 24 heads, 8 KV heads, RoPE axes (32, 32, 32) over
        # (300, 512, 512)), the caption width Gemma-2-2B's hidden size (demo.py: cap_feat_dim=text_encoder.config.
        # hidden_size); diffusers' class defaults but cap_feat_dim
        "full": dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                     num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                     ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                     axes_lens=(300, 512, 512), cap_feat_dim=2304),
    },
    {
        "tiny": dict(height=32, width=32, text_len=8),
        "small": dict(height=256, width=256, text_len=64),
        "full": dict(height=1024, width=1024, text_len=256),  # the pipeline's default size and max_sequence_length
    },
    _lumina2_inputs,
    "Alpha-VLLM/Lumina-Image-2.0",
)
# fmt: on
