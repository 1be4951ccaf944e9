"""The video presets: LTX-Video, LTX-2 (audio and video), Wan 2.1 and 2.2, HunyuanVideo, CogVideoX, Mochi and
HunyuanVideo 1.5. Each preset's input builder sits right above its config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._base import _latent, _latent_frames, _Maker, _preset


# fmt: off
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


def _ltx2_inputs(cfg: Mapping, b: int, s: Mapping[str, int], make: _Maker) -> dict[str, Any]:
    # LTX2Pipeline: the video VAE's 32x spatial, 8x temporal latents of 128 channels, packed into tokens; the audio
    # VAE's latent (8 channels x 64/4 mel bins, packed to 128 features) one token per 4 mel frames of 160 samples at
    # 16 kHz, as long as the video at the pipeline's 24 fps; the text connectors' outputs (the prompt padded to
    # max_sequence_length, every position filled: registers replace the padding, so their int64 mask is all ones),
    # one for each stream; the timestep on the scheduler's 0-1000 scale, shared by both streams. The pipeline also
    # passes video_coords and audio_coords: the rotary positions that transformer.rope makes from these same sizes and
    # fps, which the forward makes itself when they are left out (float32 whatever the model's dtype).
    p, pt = cfg["patch_size"], cfg["patch_size_t"]
    h, w = _latent(s, "height", 32, p) // p, _latent(s, "width", 32, p) // p
    f = _latent_frames(s, 8)
    if f % pt:
        raise ValueError(f"frames={s['frames']} gives {f} latent frames, not a multiple of patch_size_t={pt}")
    f //= pt
    if s["text_len"] % _LTX2_REGISTERS:
        raise ValueError(
            f"text_len={s['text_len']} must be a multiple of {_LTX2_REGISTERS}: LTX-2's text connectors tile "
            f"{_LTX2_REGISTERS} learnable registers over the padded prompt"
        )
    fps = 24.0  # the pipeline's frame_rate
    per_second = cfg["audio_sampling_rate"] / cfg["audio_hop_length"] / cfg["audio_scale_factor"]
    audio_frames = round(s["frames"] / fps * per_second)
    mask = torch.ones((b, s["text_len"]), dtype=torch.int64, device=make.device)
    return {
        "hidden_states": make.randn(b, f * h * w, cfg["in_channels"]),
        "audio_hidden_states": make.randn(b, audio_frames, cfg["audio_in_channels"]),
        "encoder_hidden_states": make.randn(b, s["text_len"], cfg["caption_channels"]),
        "audio_encoder_hidden_states": make.randn(b, s["text_len"], cfg["caption_channels"]),
        "timestep": make.timestep(b),
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask,  # the pipeline passes the one mask twice
        "num_frames": f,
        "height": h,
        "width": w,
        "fps": fps,
        "audio_num_frames": audio_frames,
    }


_LTX2_REGISTERS = 128  # LTX2TextConnectors' video/audio_connector_num_learnable_registers in Lightricks/LTX-2
# diffusers' scripts/convert_ltx2_to_diffusers.py, get_ltx2_transformer_config("2.0"): the transformer/config.json of
# Lightricks/LTX-2 (converted from ltx-2-19b-dev.safetensors)
_LTX2_FULL = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                  attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
                  base_height=2048, base_width=2048, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
                  audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64,
                  audio_cross_attention_dim=2048, audio_scale_factor=4, audio_pos_embed_max_pos=20,
                  audio_sampling_rate=16000, audio_hop_length=160, num_layers=48, activation_fn="gelu-approximate",
                  qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
                  attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True,
                  causal_offset=1, timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000,
                  rope_type="split")


# The audio+video transformer: a video stream and an audio stream, each with self-attention, text cross-attention
# and a feed-forward per block, joined by audio-to-video and video-to-audio attention. Its cross-modal rotary
# table splits audio_cross_attention_dim over num_attention_heads: the two streams keep one head count.
_LTX2 = _preset(
    "ltx-2",
    "LTX2VideoTransformer3DModel",
    "LTX-2 audio+video transformer (18.9B at full size; the 19B of the paper)",
    {
        "tiny": dict(_LTX2_FULL, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
                     audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
                     num_layers=2, caption_channels=32),
        "small": dict(_LTX2_FULL, num_attention_heads=8, attention_head_dim=64, cross_attention_dim=512,
                      audio_num_attention_heads=8, audio_attention_head_dim=32, audio_cross_attention_dim=256,
                      num_layers=8),
        "full": _LTX2_FULL,
    },
    {
        "tiny": dict(height=64, width=64, frames=9, text_len=128),
        "small": dict(height=256, width=256, frames=17, text_len=128),
        # LTX2Pipeline's defaults: 512x768 px, 121 frames (5 s at 24 fps), max_sequence_length 1024
        "full": dict(height=512, width=768, frames=121, text_len=1024),
    },
    _ltx2_inputs,
    "Lightricks/LTX-2",
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
