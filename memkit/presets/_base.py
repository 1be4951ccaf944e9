"""What a preset is: a diffusers class, its config at three sizes, its default input sizes and its input builder;
and the helpers the builders share (tensor factories, pixel-to-latent conversions)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["SIZES", "InputBuilder", "Preset"]

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

    def mask(self, *shape: int, valid: bool = True, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """An attention mask, every token ``valid`` (or none). Under ``FakeTensorMode`` a fake tensor that keeps its
        values (``memkit._torch_compat.known_constant``): models that drop or reorder padding by ``nonzero`` of the
        mask (Mochi, HunyuanVideo 1.5) or sum it into caption lengths (Lumina2) take their shapes from them."""
        return self.known(lambda: torch.full(shape, valid, dtype=dtype, device=self.device))

    def known(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor ``make()`` builds, its values kept under ``FakeTensorMode`` (see `mask`)."""
        from .._torch_compat import known_constant

        return known_constant(make)


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
