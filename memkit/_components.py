"""The pipeline's other parts: each preset's text encoders and VAE, from the released configs, built and run the way
the diffusers pipeline (or its training script) runs them.

A `Component` is one frozen module of a preset's pipeline (``text_encoder``, ``text_encoder_2``, ``text_encoder_3``,
``vae``): its transformers or diffusers class, its released config (``full``) and a few-layer narrow one of the same
class (``tiny``, for byte-exact tests; both in `memkit._component_configs`), its parameter count and the published
figure it was checked against. `run` feeds it what the pipeline feeds it: token ids padded to the pipeline's length,
pixels to encode, latents to decode. Everything builds at the current default dtype and device, so under
``FakeTensorMode`` (or on ``meta``) nothing is allocated: a T5-XXL encoder of 4.76B parameters builds in ~2 s, and
runs 512 tokens in under 1 s.

Under fake tensors a VAE run at batch 1 can part from the real one by a copy: fake mode gives a size-1 dim another
stride than eager does after a view, and an op that picks its layout from the strides (``group_norm`` after the
AutoencoderKL mid-block's attention) copies in one run only (tests/test_components.py, ``BATCH1_GAPS``).

Example:
    >>> t5 = {c.name: c for c in components("flux")}["text_encoder_2"]
    >>> with FakeTensorMode(), _default_dtype(torch.bfloat16):
    ...     out = run(t5, t5.build(), batch_size=1, sizes={}, part="encode")   # (1, 512, 4096)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ._component_configs import (
    _CLIP_G,
    _CLIP_L,
    _CLIP_TINY,
    _COGVIDEOX_TINY,
    _COGVIDEOX_VAE,
    _FLUX_VAE,
    _KL_TINY,
    _LTX_TINY,
    _LTX_VAE,
    _SD3_VAE,
    _SD15_VAE,
    _SDXL_VAE,
    _T5_TINY,
    _T5_XXL,
    _UMT5_TINY,
    _UMT5_XXL,
    _WAN22_TINY,
    _WAN22_VAE,
    _WAN_TINY,
    _WAN_VAE,
)
from .presets._base import _frozen

__all__ = ["Component", "components", "run"]

Call = Literal["last_hidden_state", "masked", "pooled", "penultimate", "vae"]


@dataclass(frozen=True)
class Component:
    """One frozen part of a preset's pipeline: a text encoder or the VAE.

    Example:
        >>> vae = components("flux")[-1]
        >>> vae.class_name, vae.parameters, vae.published
    """

    preset: str
    """The memkit preset it belongs to (``"flux"``)."""
    name: str
    """The pipeline's attribute: ``"text_encoder"``, ``"text_encoder_2"``, ``"text_encoder_3"`` or ``"vae"``."""
    role: Literal["text_encoder", "vae"]
    library: Literal["transformers", "diffusers"]
    class_name: str
    """``"T5EncoderModel"``, ``"CLIPTextModelWithProjection"``, ``"AutoencoderKLWan"``..."""
    configs: Mapping[str, Mapping[str, Any]]
    """``"tiny"`` and ``"full"`` (the released config) -> the class's config keywords."""
    parameters: int
    """The full config's parameter count (built on ``meta`` and counted)."""
    published: str
    """The published figure the count was checked against, and where it is from."""
    source: str
    """Where the full config comes from."""
    max_length: int | None
    """Text encoders: the tokens the pipeline pads the prompt to; None for a VAE."""
    call: Call = "last_hidden_state"
    """What the pipeline asks of it: ``last_hidden_state`` (T5, SD1.5's CLIP), ``masked`` (T5 given the padding
    mask: Wan, PixArt, Chroma), ``pooled`` (Flux's CLIP), ``penultimate`` (SD3's and SDXL's CLIPs: every hidden state,
    the one before last kept), ``vae``."""

    def build(self, size: Literal["tiny", "full"] = "full") -> torch.nn.Module:
        """The class built from ``configs[size]`` at the current default dtype and device, in eval mode, every
        parameter frozen. Under ``FakeTensorMode`` or on ``meta`` the weights' initialisation is skipped (it would
        only cost time: they hold no values)."""
        if size not in self.configs:
            raise ValueError(f"size={size!r}: a component has sizes {sorted(self.configs)}")
        config = _plain(self.configs[size])
        fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        empty = fake or torch.get_default_device().type == "meta"
        if self.library == "transformers":
            try:
                import transformers
            except ImportError:
                raise ImportError(
                    f"{self.preset}'s {self.name} is a transformers {self.class_name}: pip install "
                    '"memkit[finetune]" (or transformers) to place text encoders'
                ) from None
            try:
                from transformers.initialization import no_init_weights
            except ImportError:  # transformers 4
                from transformers.modeling_utils import no_init_weights

            cls = getattr(transformers, self.class_name)
            with no_init_weights() if empty else contextlib.nullcontext():
                module = cls(cls.config_class(**config))
            module.tie_weights()  # part of the init_weights skipped: T5's encoder embeds with its `shared` table
        else:
            import diffusers
            from diffusers.models.modeling_utils import no_init_weights

            with no_init_weights() if empty else contextlib.nullcontext():
                module = getattr(diffusers, self.class_name)(**config)
        module.requires_grad_(False)
        return module.eval()


def components(preset: str) -> tuple[Component, ...]:
    """The text encoders and the VAE of ``preset``'s pipeline, in the pipeline's order.

    Example:
        >>> [(c.name, c.class_name) for c in components("sd3")]
    """
    if preset not in _CATALOG:
        raise ValueError(f"preset={preset!r} has no catalog of pipeline components; those with one: {list(_CATALOG)}")
    return _CATALOG[preset]


@torch.no_grad()
def run(
    component: Component,
    module: torch.nn.Module,
    *,
    batch_size: int,
    sizes: Mapping[str, int],
    part: str,
    tiling: bool = False,
    slicing: bool = False,
) -> torch.Tensor:
    """Run ``module`` (built by ``component.build``) as the pipeline does, on inputs of the current default dtype.

    A text encoder (``part="encode"``) takes token ids ``(batch_size, max_length)`` and returns what the pipeline
    keeps. A VAE encodes pixels ``(batch, 3, H, W)`` or video ``(batch, 3, frames, H, W)`` at ``sizes``' ``height``,
    ``width`` (and ``frames``) to a latent sample, as the training scripts do (``part="encode"``), or decodes latents
    of the matching shape to pixels (``part="decode"``). ``tiling`` and ``slicing`` switch the VAE's own
    ``enable_tiling()``/``enable_slicing()``: tiles bound the activations of a large image or video by a tile's, at
    the cost of recomputed overlaps; slicing runs the batch one sample at a time.

    Example:
        >>> vae = components("flux")[-1]
        >>> run(vae, vae.build("tiny"), batch_size=1, sizes={"height": 64, "width": 64}, part="decode", tiling=True)
    """
    parts = ("encode", "decode") if component.role == "vae" else ("encode",)
    if part not in parts:
        raise ValueError(f"part={part!r}: a {component.role} runs one of {parts}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    for flag, value in (("tiling", tiling), ("slicing", slicing)):
        if value and not hasattr(module, f"enable_{flag}"):
            raise ValueError(f"{flag}=True: {type(module).__name__} has no enable_{flag}()")
        if hasattr(module, f"enable_{flag}"):
            getattr(module, f"enable_{flag}" if value else f"disable_{flag}")()
    if component.role == "text_encoder":
        return _encode_text(component, module, batch_size)
    if part == "encode":
        x = torch.randn(batch_size, *_pixel_shape(component, sizes))
        return module.encode(x).latent_dist.sample()
    z = torch.randn(batch_size, *_latent_shape(component, module.config, sizes))
    return module.decode(z).sample


def _encode_text(component: Component, module: torch.nn.Module, batch_size: int) -> torch.Tensor:
    ids = torch.randint(module.config.vocab_size, (batch_size, component.max_length), dtype=torch.int64)
    if component.call == "masked":
        # a prompt shorter than the length, as most are: the pipeline pads it, and the mask's zeros make T5 build
        # its attention bias (an all-ones mask lets transformers skip it)
        mask = (torch.arange(component.max_length) < component.max_length - 1).long().expand(batch_size, -1)
        return module(ids, attention_mask=mask).last_hidden_state
    if component.call == "pooled":  # FluxPipeline._get_clip_prompt_embeds
        return module(ids, output_hidden_states=False).pooler_output
    if component.call == "penultimate":  # StableDiffusion3Pipeline/SDXL: hidden_states[-2] (and the pooled output)
        return module(ids, output_hidden_states=True).hidden_states[-2]
    return module(ids)[0]


def _video(component: Component) -> bool:
    return component.class_name != "AutoencoderKL"


def _pixel_shape(component: Component, sizes: Mapping[str, int]) -> tuple[int, ...]:
    keys = ("frames", "height", "width") if _video(component) else ("height", "width")
    missing = [k for k in keys if k not in sizes]
    if missing:
        raise ValueError(f"sizes={dict(sizes)} lacks {missing}: {component.class_name} takes {list(keys)}")
    return (3, *(sizes[k] for k in keys))


def _latent_shape(component: Component, cfg: Any, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The latents a VAE decodes to ``sizes``' pixels: channels, (latent frames,) height, width."""
    _, *pixels = _pixel_shape(component, sizes)
    name = component.class_name
    if name == "AutoencoderKLWan":
        channels, spatial, temporal = cfg.z_dim, cfg.scale_factor_spatial, cfg.scale_factor_temporal
    elif name == "AutoencoderKLLTXVideo":
        channels = cfg.latent_channels
        spatial = cfg.patch_size * 2 ** sum(cfg.spatio_temporal_scaling)
        temporal = cfg.patch_size_t * 2 ** sum(cfg.spatio_temporal_scaling)
    else:  # AutoencoderKL, AutoencoderKLCogVideoX: a 2x downsample between blocks
        channels, spatial = cfg.latent_channels, 2 ** (len(cfg.block_out_channels) - 1)
        temporal = getattr(cfg, "temporal_compression_ratio", 1)
    *frames, height, width = pixels
    for key, value, ratio in (("height", height, spatial), ("width", width, spatial)):
        if value % ratio:
            raise ValueError(f"{key}={value} must be a multiple of {ratio} ({name}'s spatial ratio)")
    if frames and (frames[0] - 1) % int(temporal):
        raise ValueError(f"frames={frames[0]} must be {int(temporal)}*k+1 ({name} keeps the first frame apart)")
    latent_frames = [(frames[0] - 1) // int(temporal) + 1] if frames else []
    return (channels, *latent_frames, height // spatial, width // spatial)


def _plain(value: Any) -> Any:
    """A frozen config back to the dicts and lists the classes take."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# --- the catalog ---------------------------------------------------------------------------------------------------
# `parameters`: counted on meta (tests/test_components.py checks each); `published`: the figure it was checked against.


def _t5(preset: str, name: str, max_length: int, call: Call = "last_hidden_state") -> Component:
    published = (
        "4.76B: T5 v1.1 XXL's encoder, 4,762,310,656 (Wikipedia, T5 (language model), the v1.1 table); FLUX.1-dev's "
        "text_encoder_2 model.safetensors.index.json total_size, 9,524,621,312 B in bf16, / 2"
    )
    configs = {"tiny": _T5_TINY, "full": _T5_XXL}
    source = "google/t5-v1_1-xxl config.json (the pipeline's text encoder subfolder holds the same)"
    return _text(preset, name, "T5EncoderModel", configs, 4_762_310_656, published, source, max_length, call)


def _umt5(preset: str) -> Component:
    published = (
        "5.68B: Wan2.1-T2V-14B-Diffusers' text_encoder model.safetensors.index.json total_size, 11,361,820,672 B "
        "in bf16, / 2"
    )
    configs = {"tiny": _UMT5_TINY, "full": _UMT5_XXL}
    source = "google/umt5-xxl config.json (Wan-AI/Wan2.1-T2V-14B-Diffusers text_encoder)"
    return _text(preset, "text_encoder", "UMT5EncoderModel", configs, 5_680_910_336, published, source, 512, "masked")


def _clip_l(preset: str, name: str, class_name: str, call: Call) -> Component:
    if class_name == "CLIPTextModel":
        count, published = (
            123_060_480,
            "123.1M: stable-diffusion-v1-5's fp32 text_encoder/model.safetensors, 492 MB / 4",
        )
    else:  # the projection adds 768x768
        count, published = 123_650_304, "123.7M: SD3 medium's fp16 text_encoder/model.safetensors, 247 MB / 2"
    configs = {"tiny": _CLIP_TINY, "full": _CLIP_L}
    source = "openai/clip-vit-large-patch14 config.json, text_config"
    return _text(preset, name, class_name, configs, count, published, source, 77, call)


def _clip_g(preset: str) -> Component:
    published = "695M: OpenCLIP bigG/14's text tower; SD3 medium's fp16 text_encoder_2/model.safetensors, 1.39 GB / 2"
    configs = {"tiny": _CLIP_TINY, "full": _CLIP_G}
    source = "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k config.json, text_config"
    return _text(
        preset, "text_encoder_2", "CLIPTextModelWithProjection", configs, 694_659_840, published, source, 77,
        "penultimate",
    )  # fmt: skip


def _kl(preset: str, full: dict, source: str) -> Component:
    if full["latent_channels"] == 16:
        count, published = 83_819_683, "83.8M: FLUX.1-dev's fp32 vae/diffusion_pytorch_model.safetensors, 335 MB / 4"
    else:
        count, published = 83_653_863, "83.7M: sdxl-vae's fp32 diffusion_pytorch_model.safetensors, 335 MB / 4"
    return _vae(preset, "AutoencoderKL", full, _KL_TINY, count, published, source)


def _wan_vae(preset: str) -> Component:
    published = "126.9M: Wan-AI's Wan2.1_VAE.pth, 507,609,880 B in fp32, / 4"
    source = "Wan-AI/Wan2.1-T2V-14B-Diffusers vae/config.json"
    return _vae(preset, "AutoencoderKLWan", _WAN_VAE, _WAN_TINY, 126_892_531, published, source)


def _cogvideox(preset: str, scaling_factor: float) -> tuple[Component, ...]:
    published = "215.6M: the released CogVideoX VAE checkpoint's element count, 215,583,907 (public tallies)"
    source = f"THUDM/{preset.replace('cogvideox', 'CogVideoX')} vae/config.json"
    full = _COGVIDEOX_VAE | dict(scaling_factor=scaling_factor)
    vae = _vae(preset, "AutoencoderKLCogVideoX", full, _COGVIDEOX_TINY, 215_583_907, published, source)
    return (_t5(preset, "text_encoder", 226), vae)


def _text(
    preset: str, name: str, class_name: str, configs: dict, parameters: int, published: str, source: str,
    max_length: int, call: Call,
) -> Component:  # fmt: skip
    return Component(
        preset, name, "text_encoder", "transformers", class_name, _frozen(configs), parameters, published, source,
        max_length, call,
    )  # fmt: skip


def _vae(preset: str, class_name: str, full: dict, tiny: dict, parameters: int, published: str, source: str):
    configs = _frozen({"tiny": full | tiny, "full": full})
    return Component(preset, "vae", "vae", "diffusers", class_name, configs, parameters, published, source, None, "vae")


def _sd3(preset: str) -> tuple[Component, ...]:
    return (
        _clip_l(preset, "text_encoder", "CLIPTextModelWithProjection", "penultimate"),
        _clip_g(preset),
        _t5(preset, "text_encoder_3", 256),  # the preset's text_len, 333, is CLIP's 77 and T5's 256 joined
        _kl(preset, _SD3_VAE, "stabilityai/stable-diffusion-3-medium-diffusers vae/config.json"),
    )


def _wan(preset: str) -> tuple[Component, ...]:
    return (_umt5(preset), _wan_vae(preset))


_LTX_PUBLISHED = "none found: Lightricks publishes no count for the 0.9 VAE (the config is diffusers' documented one)"
_CATALOG: dict[str, tuple[Component, ...]] = {
    "flux": (
        _clip_l("flux", "text_encoder", "CLIPTextModel", "pooled"),
        _t5("flux", "text_encoder_2", 512),
        _kl("flux", _FLUX_VAE, "black-forest-labs/FLUX.1-dev vae/config.json"),
    ),
    "sd3": _sd3("sd3"),
    "sd3.5-large": _sd3("sd3.5-large"),
    "sd3.5-medium": _sd3("sd3.5-medium"),
    "wan": _wan("wan"),
    "wan2.1-1.3b": _wan("wan2.1-1.3b"),
    "wan2.2-t2v-a14b": _wan("wan2.2-t2v-a14b"),
    "wan2.2-ti2v-5b": (
        _umt5("wan2.2-ti2v-5b"),
        _vae(
            "wan2.2-ti2v-5b", "AutoencoderKLWan", _WAN22_VAE, _WAN22_TINY, 704_688_668,
            "704.7M: Wan-AI's Wan2.2_VAE.pth, 2,818,839,170 B in fp32, / 4",
            "Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json",
        ),
    ),
    "ltx-video": (
        _t5("ltx-video", "text_encoder", 128),
        _vae(
            "ltx-video", "AutoencoderKLLTXVideo", _LTX_VAE, _LTX_TINY, 419_193_649, _LTX_PUBLISHED,
            "Lightricks/LTX-Video vae/config.json (0.9.0)",
        ),
    ),
    "pixart": (
        _t5("pixart", "text_encoder", 300, "masked"),
        _kl("pixart", _SDXL_VAE, "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS vae/config.json (SDXL's VAE)"),
    ),
    "chroma": (
        _t5("chroma", "text_encoder", 512, "masked"),
        _kl("chroma", _FLUX_VAE, "lodestones/Chroma vae/config.json (FLUX.1's VAE)"),
    ),
    "unet": (
        _clip_l("unet", "text_encoder", "CLIPTextModel", "last_hidden_state"),
        _kl("unet", _SD15_VAE, "stable-diffusion-v1-5/stable-diffusion-v1-5 vae/config.json"),
    ),
    "sdxl": (
        _clip_l("sdxl", "text_encoder", "CLIPTextModel", "penultimate"),
        _clip_g("sdxl"),
        _kl("sdxl", _SDXL_VAE, "stabilityai/stable-diffusion-xl-base-1.0 vae/config.json"),
    ),
    "cogvideox-5b": _cogvideox("cogvideox-5b", 0.7),
    "cogvideox-2b": _cogvideox("cogvideox-2b", 1.15258426),
}  # fmt: skip
