"""The released configs of the pipelines' text encoders and VAEs (`memkit._components` catalogs them per preset), each
with a tiny one of the same class for byte-exact tests.

Only the keys that shape the modules (or that the pipeline reads) are kept; the rest of a config.json is tokenizer
ids, training flags and latent statistics. Presets that share a model share its dict here.
"""

from __future__ import annotations

# google/t5-v1_1-xxl config.json, the text encoder of FLUX.1-dev (text_encoder_2), SD3 (text_encoder_3), LTX-Video,
# PixArt-Sigma, CogVideoX and Chroma: T5EncoderModel builds its encoder half
_T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
)
_T5_TINY = _T5_XXL | dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
# google/umt5-xxl config.json (Wan's text_encoder): a 256k multilingual vocabulary, a position bias in every layer
_UMT5_XXL = _T5_XXL | dict(vocab_size=256384)
_UMT5_TINY = _T5_TINY | dict(vocab_size=1024)

# openai/clip-vit-large-patch14's text_config: SD1.5's, SDXL's and Flux's text_encoder, SD3's with its projection
_CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    projection_dim=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)
# laion/CLIP-ViT-bigG-14-laion2B-39B-b160k's text_config: SDXL's and SD3's text_encoder_2
_CLIP_G = _CLIP_L | dict(
    hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32, num_attention_heads=20,
    hidden_act="gelu",
)  # fmt: skip
_CLIP_TINY = _CLIP_L | dict(
    vocab_size=1000, hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
    num_attention_heads=4, bos_token_id=0, eos_token_id=2, pad_token_id=1,  # inside the tiny vocabulary
)  # fmt: skip

# black-forest-labs/FLUX.1-dev vae/config.json (Chroma's too): 16 latent channels, no quant convs
_FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2,
    act_fn="silu",
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
    force_upcast=True,
)
# stabilityai/stable-diffusion-3-medium-diffusers vae/config.json (3.5's too): Flux's but for scaling and shift
_SD3_VAE = _FLUX_VAE | dict(scaling_factor=1.5305, shift_factor=0.0609)
# stabilityai/stable-diffusion-xl-base-1.0 vae/config.json (PixArt-Sigma's): 4 latent channels with quant convs
_SDXL_VAE = _FLUX_VAE | dict(
    latent_channels=4, scaling_factor=0.13025, shift_factor=None, use_quant_conv=True, use_post_quant_conv=True
)
# stable-diffusion-v1-5 vae/config.json: SDXL's but for its scaling and sample size
_SD15_VAE = _SDXL_VAE | dict(sample_size=512, scaling_factor=0.18215, force_upcast=True)
# tiling starts above sample_size: at 32 it cuts a 64 px image into overlapping tiles
_KL_TINY = dict(
    block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
    layers_per_block=1, norm_num_groups=8, sample_size=32,
)  # fmt: skip

# Wan-AI/Wan2.1-T2V-14B-Diffusers vae/config.json (Wan2.1 1.3B's and Wan2.2 A14B's too), less its latent statistics
_WAN_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0,
)  # fmt: skip
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: 2x2 pixel patches in, 48 latent channels, 16x spatial (its latent
# statistics, 48 each, only scale the pipeline's latents: zeros and ones here)
_WAN22_VAE = _WAN_VAE | dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_spatial=16, scale_factor_temporal=4, is_residual=True, latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)  # fmt: skip
_WAN_TINY = dict(
    base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
    scale_factor_spatial=4, scale_factor_temporal=2, latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
)  # fmt: skip
_WAN22_TINY = _WAN_TINY | dict(base_dim=16, decoder_base_dim=32, scale_factor_spatial=8)

# Lightricks/LTX-Video vae/config.json (0.9.0): diffusers' AutoencoderKLLTXVideo docs load it with these values
_LTX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=128,
    block_out_channels=[128, 256, 512, 512],
    decoder_block_out_channels=[128, 256, 512, 512],
    layers_per_block=[4, 3, 3, 3, 4],
    decoder_layers_per_block=[4, 3, 3, 3, 4],
    spatio_temporal_scaling=[True, True, True, False],
    decoder_spatio_temporal_scaling=[True, True, True, False],
    decoder_inject_noise=[False] * 5,
    upsample_residual=[False] * 4,
    upsample_factor=[1] * 4,
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    scaling_factor=1.0,
    encoder_causal=True,
    decoder_causal=False,
)
_LTX_TINY = dict(
    latent_channels=8, block_out_channels=[8, 16], decoder_block_out_channels=[8, 16], layers_per_block=[1, 1, 1],
    decoder_layers_per_block=[1, 1, 1], spatio_temporal_scaling=[True, False],
    decoder_spatio_temporal_scaling=[True, False], decoder_inject_noise=[False] * 3, upsample_residual=[False] * 2,
    upsample_factor=[1] * 2, down_block_types=["LTXVideoDownBlock3D"] * 2, downsample_type=["conv"] * 2, patch_size=2,
)  # fmt: skip

# THUDM/CogVideoX-5b vae/config.json (2b's differs in its scaling_factor only, 1.15258426)
_COGVIDEOX_VAE = dict(
    block_out_channels=[128, 256, 256, 512], latent_channels=16, layers_per_block=3, temporal_compression_ratio=4,
    sample_height=480, sample_width=720, scaling_factor=0.7,
)  # fmt: skip
# (its tiling has no say at tiny sizes: tiles of half the full sample size)
_COGVIDEOX_TINY = dict(block_out_channels=[8, 8, 16, 16], latent_channels=4, layers_per_block=1, norm_num_groups=4)
