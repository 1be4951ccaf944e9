"""The model presets: each one's diffusers class, its config at three sizes, and its inputs.

A preset is everything memkit needs to build a model and feed it: the diffusers class behind Flux, SD3 (3.5 Large
and Medium share its class), LTX-Video, LTX-2, Wan (2.1 14B and 1.3B, 2.2 TI2V-5B and an A14B expert share one
class), HunyuanVideo, CogVideoX (5b and 2b), Mochi 1, HunyuanVideo 1.5, the SD1.5 and SDXL UNets, PixArt-Sigma, DiT,
Sana, Qwen-Image, FLUX.2, Chroma, AuraFlow, CogView4, Z-Image or Lumina-Image 2.0, its config at each size (``tiny``:
tests; ``small``: 30-100M parameters, benchmarks; ``full``: the released config), the default input sizes, and the
function that builds the forward's keyword arguments from pixel and token sizes. Each preset's input builder sits
right above its config, in the file of its kind (``mmdit.py``: joint text-image attention; ``image.py``:
cross-attention or a class label; ``video.py``: video with text cross-attention; ``video_joint.py``: joint text-video
attention), so adding a model is one block there and one name in the menu below; ``_base.py`` holds `Preset` and the
builders' helpers.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ._base import SIZES, InputBuilder, Preset, _Maker
from .image import _DIT, _PIXART, _SANA, _SDXL, _UNET
from .mmdit import (
    _AURAFLOW,
    _CHROMA,
    _COGVIEW4,
    _FLUX,
    _FLUX2,
    _LUMINA2,
    _QWEN_IMAGE,
    _SD3,
    _SD35_LARGE,
    _SD35_MEDIUM,
    _Z_IMAGE,
)
from .video import _LTX, _LTX2, _WAN, _WAN22_T2V_A14B, _WAN22_TI2V_5B, _WAN_1_3B
from .video_joint import _COGVIDEOX_2B, _COGVIDEOX_5B, _HUNYUAN_VIDEO, _HUNYUAN_VIDEO15, _MOCHI

__all__ = ["PRESETS", "SIZES", "InputBuilder", "Preset", "_Maker"]

_ALL = (
    _FLUX, _SD3, _SD35_LARGE, _SD35_MEDIUM, _LTX, _LTX2, _WAN, _WAN_1_3B, _WAN22_TI2V_5B, _WAN22_T2V_A14B,
    _HUNYUAN_VIDEO, _COGVIDEOX_5B, _COGVIDEOX_2B, _MOCHI, _HUNYUAN_VIDEO15, _UNET, _SDXL, _PIXART, _DIT, _SANA,
    _QWEN_IMAGE, _FLUX2, _CHROMA, _AURAFLOW, _COGVIEW4, _Z_IMAGE, _LUMINA2,
)  # fmt: skip
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _ALL})
"""Preset name -> `Preset`, in menu order."""
