"""The video presets that attend over text and video tokens jointly: HunyuanVideo and HunyuanVideo 1.5 (dual- then
single-stream blocks), CogVideoX (an expert transformer over the concatenated tokens) and Mochi 1 (asymmetric joint
attention). Each preset's input builder sits right above its config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._base import _latent, _latent_frames, _Maker, _preset


# fmt: off
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


def _mochi_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # MochiPipeline: 8x spatial, 6x temporal VAE of 12 channels; T5-XXL hidden states (4096 wide) with their boolean
    # mask, every token valid (a prompt of text_len tokens; the pipeline pads to max_sequence_length=256). Its
    # attention keeps each sample's valid text tokens by nonzero of the mask: the mask keeps its values under fake
    # tensors (make.mask).
    p = cfg["patch_size"]
    h, w, f = _latent(s, "height", 8, p), _latent(s, "width", 8, p), _latent_frames(s, 6)
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], f, h, w),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["text_embed_dim"]),
        "timestep": make.timestep(b),
        "encoder_attention_mask": make.mask(b, s["text_len"]),
    }


_MOCHI = _preset(
    "mochi",
    "MochiTransformer3DModel",
    "Mochi 1 preview transformer (10.0B at full size)",
    {
        "tiny": dict(patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2, pooled_projection_dim=32,
                     in_channels=12, text_embed_dim=32, time_embed_dim=16),
        "small": dict(patch_size=2, num_attention_heads=8, attention_head_dim=64, num_layers=6,
                      pooled_projection_dim=256, in_channels=12, text_embed_dim=4096, time_embed_dim=256),
        # genmo/mochi-1-preview transformer/config.json: the class defaults, which diffusers'
        # scripts/convert_mochi_to_diffusers.py builds the released weights into (MochiTransformer3DModel())
        "full": dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48,
                     pooled_projection_dim=1536, in_channels=12, out_channels=None, qk_norm="rms_norm",
                     text_embed_dim=4096, time_embed_dim=256, activation_fn="swiglu", max_sequence_length=256),
    },
    {
        "tiny": dict(height=32, width=32, frames=7, text_len=8),
        "small": dict(height=128, width=128, frames=13, text_len=64),
        # MochiPipeline's defaults: 480x848 px, 19 frames, max_sequence_length 256
        "full": dict(height=480, width=848, frames=19, text_len=256),
    },
    _mochi_inputs,
    "genmo/mochi-1-preview",
)


# HunyuanVideo15Pipeline's fixed token counts: ByT5 glyph-text tokens (tokenizer_2_max_length) and SigLIP image
# tokens (vision_num_semantic_tokens, 27 x 27)
_HV15_GLYPH_TOKENS, _HV15_IMAGE_TOKENS = 256, 729


def _hunyuan_video15_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # HunyuanVideo15Pipeline (text-to-video): 16x spatial, 4x temporal VAE of 32 channels; the latents, the image
    # condition's latents and its mask stacked on channels (32 + 32 + 1 = in_channels; zeros for text-to-video);
    # Qwen2.5-VL hidden states (3584 wide; the pipeline pads the prompt to 1000 tokens) with their mask, every token
    # valid; ByT5 hidden states of the prompt's quoted glyph text (1472 wide, 256 tokens) with their mask, none
    # valid (a prompt without quoted text: the pipeline's zeros); SigLIP image embeddings, zeros for text-to-video,
    # which the transformer tells by torch.all(image_embeds == 0). The masks and image embeddings keep their values
    # under fake tensors (make.mask, make.known): the transformer reorders its text tokens by indexing with masks.
    p, pt = cfg["patch_size"], cfg["patch_size_t"]
    h, w, f = _latent(s, "height", 16, p), _latent(s, "width", 16, p), _latent_frames(s, 4)
    if f % pt:
        raise ValueError(f"frames={s['frames']} gives {f} latent frames, not a multiple of patch_size_t={pt}")
    image = (b, _HV15_IMAGE_TOKENS, cfg["image_embed_dim"])
    return {
        "hidden_states": make.randn(b, cfg["in_channels"], f, h, w),
        "timestep": make.timestep(b),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["text_embed_dim"]),
        "encoder_attention_mask": make.mask(b, s["text_len"], dtype=torch.int64),
        "encoder_hidden_states_2": make.randn(b, _HV15_GLYPH_TOKENS, cfg["text_embed_2_dim"]),
        "encoder_attention_mask_2": make.mask(b, _HV15_GLYPH_TOKENS, valid=False, dtype=torch.int64),
        "image_embeds": make.known(lambda: torch.zeros(image, dtype=make.dtype, device=make.device)),
    }


# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v transformer/config.json: diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py, TRANSFORMER_CONFIGS["480p_t2v"] (the 720p checkpoints differ in
# target_size only: 960)
_HUNYUAN_VIDEO15 = _preset(
    "hunyuanvideo-1.5",
    "HunyuanVideo15Transformer3DModel",
    "HunyuanVideo 1.5 480p text-to-video transformer (8.3B at full size)",
    {
        "tiny": dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                     num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=32, text_embed_2_dim=24,
                     image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=640, task_type="t2v"),
        "small": dict(in_channels=65, out_channels=32, num_attention_heads=8, attention_head_dim=64, num_layers=4,
                      num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=3584, text_embed_2_dim=1472,
                      image_embed_dim=1152, rope_axes_dim=(16, 24, 24), target_size=640, task_type="t2v"),
        "full": dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                     num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                     text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                     rope_axes_dim=(16, 56, 56), use_meanflow=False, target_size=640, task_type="t2v"),
    },
    {
        "tiny": dict(height=32, width=32, frames=5, text_len=8),
        "small": dict(height=128, width=128, frames=9, text_len=64),
        # HunyuanVideo15Pipeline's defaults: 480x848 px (16:9 at target_size 640), 121 frames, 1000 Qwen tokens
        "full": dict(height=480, width=848, frames=121, text_len=1000),
    },
    _hunyuan_video15_inputs,
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
)


# fmt: on
