"""The video presets whose text enters by cross-attention: LTX-Video, LTX-2 (audio and video) and Wan 2.1 and 2.2
(``video_joint.py``: those that attend over text and video tokens jointly). Each preset's input builder sits right
above its config."""

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


# fmt: on
