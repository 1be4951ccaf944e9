"""Load a model: a preset built with random weights at a size, or real weights from a local folder or the hub;
and make the inputs of its forward.

Every measurement in memkit needs a model and inputs of the right shapes. The presets (`memkit.presets`) build
the diffusers classes behind Flux, SD3 and SD3.5, LTX-Video, LTX-2, Wan 2.1 and 2.2, HunyuanVideo, CogVideoX (5b, 2b),
the SD1.5 and SDXL UNets, PixArt-Sigma, DiT, Sana and Qwen-Image from configs:

- ``tiny``: two blocks and a few hundred thousand parameters, so tests run a full step in milliseconds;
- ``small``: 30-100M parameters, enough for timings and memory curves that mean something on a laptop;
- ``full``: the released config (Flux-dev is 11.9B parameters). Build it inside
  ``torch._subclasses.fake_tensor.FakeTensorMode`` to estimate memory without allocating any; building it for
  real needs the RAM of the real model.

``make_inputs`` gives every keyword the forward needs, in the model's dtype and on its device, at realistic
sizes for the preset size (full: 1024x1024 images for Flux, SD3, SD3.5, SDXL and PixArt; 512x512 for the SD1.5
UNet; 256x256 for DiT; 480x704 px x 41 frames for LTX-Video, 512x768 px x 121 frames (and their 5 s of audio) for
LTX-2 (the pipeline's defaults); 480x832 px x 17 frames for Wan, x 81 frames (the pipeline's default) for Wan2.1-1.3B
and the Wan2.2 A14B expert, 704x1280 px x 121 frames for Wan2.2-TI2V-5B; 512x768 px x 49 frames for HunyuanVideo
and 480x720 px x 49 frames for CogVideoX, as finetrainers' memory tables).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import diffusers
import huggingface_hub
import safetensors.torch
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ._lazy import quiet_imports
from .presets import PRESETS, SIZES, Preset, _Maker

__all__ = ["load_model", "make_inputs", "preset_of"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")

_PRESETS_BY_CLASS: dict[str, tuple[str, ...]] = {}  # CogVideoX-5b and -2b share a class, as SD3 and SD3.5, ...
for _p in PRESETS.values():
    _PRESETS_BY_CLASS[_p.model_class] = (*_PRESETS_BY_CLASS.get(_p.model_class, ()), _p.name)
del _p
# The oldest diffusers memkit's fast tests pass on (0.35.2): every preset's model class (Wan's arrived in 0.33) and
# the Flux single block's forward that the FF split follows (0.35); pyproject.toml declares the same floor
# (tests/test_models.py checks they agree). offload_check.diffusers_check needs 0.41.
DIFFUSERS_FLOOR = "0.35"


# ----------------------------------------------------------------------------------------------------- loading


def load_model(
    name_or_path: str | os.PathLike,
    *,
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Build a preset with random weights, or load a diffusers model saved in a local folder.

    A preset is built from its config at ``size`` with weights drawn from ``seed`` (same seed, bit-identical
    ``state_dict``; the caller's RNG is untouched), directly in ``dtype`` and on ``device``, in train mode.
    Parameters a model initialises to all zeros (output projections, norm biases) get small random values so
    every parameter receives a gradient: this is a model for measuring, not for sampling. Inside
    ``FakeTensorMode`` nothing is allocated, which is how ``"full"`` sizes are meant to be used; building a full
    model for real takes the memory of the real model (48 GB for Flux in float32).

    Any other ``name_or_path`` must be a folder written by ``save_pretrained`` (``config.json`` with
    ``_class_name`` and ``diffusion_pytorch_model*.safetensors``, sharded or not). The class is built from the
    config as a preset is, every parameter in ``dtype``, and filled from the files: the result computes bit for
    bit like the model that was saved. ``size`` and ``seed`` do not apply, and the network is never used. A
    name that is not a preset and not a folder but looks like a hub id (``"owner/name"``) is downloaded with
    ``huggingface_hub`` and loaded the same way from its ``transformer/`` or ``unet/`` folder. A preset name
    wins over a folder of the same name.

    Example:
        >>> model = load_model("flux", size="tiny", dtype=torch.bfloat16)
        >>> loss = train_step(model, make_inputs(model))
        >>> with FakeTensorMode(): big = load_model("flux", size="full")  # 11.9B parameters, no memory
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, one of {_DTYPES}, got {dtype!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be a floating torch.dtype, one of {_DTYPES}, got {dtype}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    device = torch.device(device)
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return _build(PRESETS[name_or_path], size, dtype, seed, device)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _load_folder(path, dtype, device)
    if isinstance(name_or_path, str) and _HUB_ID.fullmatch(name_or_path) and not name_or_path.startswith("."):
        return _load_hub(name_or_path, dtype, device)
    raise ValueError(
        f"unknown model {os.fspath(name_or_path)!r}: use a preset ({', '.join(PRESETS)}) "
        "or a local folder holding a diffusers config.json and safetensors weights"
    )


def config_preset(ref) -> Preset:
    """A `Preset` for a `memkit.naming.ModelRef` read from a config: its one config at every size, and the inputs of
    the preset of its class (that preset's builder at its full-size defaults: build it at size ``"full"``), so
    `make_inputs` feeds it. A class no preset has gets no input builder: `make_inputs` then says to pass
    ``inputs=``.

    Example:
        >>> config_preset(memkit.naming.resolve("path/to/config.json")).configs["full"]
    """
    from dataclasses import replace

    if ref.preset is not None:
        return PRESETS[ref.preset]
    names = _PRESETS_BY_CLASS.get(ref.class_name)
    base = None
    if names:  # of presets sharing the class (CogVideoX-5b and -2b), the one the config is closest to
        base = PRESETS[names[0] if len(names) == 1 else _closest_preset(SimpleNamespace(config=ref.config), names)]
    configs = dict.fromkeys(SIZES, dict(ref.config))
    if base is None:
        return Preset(ref.source, ref.class_name, configs, ref.source, dict.fromkeys(SIZES, {}), None)
    # the preset's name tags the model (make_inputs finds the builder by it); the size "full" its defaults
    sizes = dict.fromkeys(SIZES, base.input_sizes["full"])
    return replace(base, configs=configs, input_sizes=sizes, description=f"{ref.source} ({ref.class_name})")


def diffusers_class(name: str) -> type | None:
    """diffusers' class ``name`` (None where this diffusers has none), its module imported quietly: diffusers imports
    torchao with its quantizers when torchao is installed (:func:`memkit._lazy.quiet_imports`).

    Example:
        >>> diffusers_class("FluxTransformer2DModel")
    """
    with quiet_imports():
        return getattr(diffusers, name, None)


def _build(preset: Preset, size: str, dtype: torch.dtype, seed: int, device: torch.device) -> torch.nn.Module:
    cls = diffusers_class(preset.model_class)
    if cls is None:  # a diffusers older than the one the preset's model arrived in
        raise RuntimeError(
            f"preset {preset.name!r} needs diffusers' {preset.model_class}, which diffusers {diffusers.__version__} "
            f"does not have: memkit supports diffusers >= {DIFFUSERS_FLOOR} "
            f"(pip install 'diffusers>={DIFFUSERS_FLOOR}')"
        )
    # Construct in the target dtype and device: `module.to()` would allocate twice and fails on fake tensors.
    # Fake tensors hold no values: drawing the initial weights of a fake model only costs time (~1 s for Flux).
    fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
    skip_init = getattr(diffusers.models.modeling_utils, "no_init_weights", None) if fake else None
    with _default_dtype(dtype), _forked_rng(device), device, skip_init() if skip_init else contextlib.nullcontext():
        torch.manual_seed(seed)
        model = cls(**preset.configs[size])
        _fill_zero_parameters(model)
    model._memkit_preset, model._memkit_size = preset.name, size
    return model.train()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _forked_rng(device: torch.device) -> contextlib.AbstractContextManager:
    accelerator = device.type not in ("cpu", "meta")
    return torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type)


@torch.no_grad()
def _fill_zero_parameters(model: torch.nn.Module, std: float = 0.02) -> None:
    # A zero-initialised output projection blocks every gradient upstream of it, which would make the
    # gradient checks of the optimizations vacuous.
    for p in model.parameters():
        if not is_fake(p) and p.device.type != "meta" and not p.any():
            p.normal_(0.0, std)


def _load_folder(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    # Built like a preset, then filled from the files. diffusers' `from_pretrained` without `accelerate` (not a
    # memkit dependency) returns float32 SD3 weights when asked for bfloat16, refuses Wan in bfloat16, and leaves
    # CPU tensors off the allocator's alignment, which moves outputs by ~1e-7 from the model that was saved.
    config_file = path / "config.json"
    class_name = json.loads(config_file.read_text()).get("_class_name") if config_file.is_file() else None
    cls = diffusers_class(class_name) if isinstance(class_name, str) else None
    if cls is None:
        raise ValueError(f"{path} holds no diffusers config.json with a known _class_name (got {class_name!r})")
    index = path / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [path / "diffusion_pytorch_model.safetensors"]
    if not all(f.is_file() for f in files):
        raise ValueError(f"{path} holds no diffusion_pytorch_model .safetensors weights: use save_pretrained()")
    skip_init = getattr(diffusers.models.modeling_utils, "no_init_weights", contextlib.nullcontext)
    with _default_dtype(dtype), device, skip_init():
        model = cls.from_config(cls.load_config(path))
    missing, unexpected = set(model.state_dict()), set()
    for file in files:
        state = safetensors.torch.load_file(file)
        unexpected |= set(model.load_state_dict(state, strict=False).unexpected_keys)
        missing -= set(state)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit {class_name}: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    return _tag(model)


def _load_hub(repo_id: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    patterns = ["config.json", "diffusion_pytorch_model*", "transformer/*", "unet/*"]  # not the text encoders
    root = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    for folder in (root / "transformer", root / "unet", root):  # a pipeline's denoiser, or a model repo
        if (folder / "config.json").is_file():
            return _load_folder(folder, dtype, device)
    raise ValueError(f"{repo_id} has no transformer/ or unet/ folder with a config.json")


def _tag(model: torch.nn.Module) -> torch.nn.Module:
    if type(model).__name__ in _PRESETS_BY_CLASS:
        name = preset_of(model)
        model._memkit_preset, model._memkit_size = name, _matching_size(model, PRESETS[name])
    return model.train()


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


@functools.cache
def _class_defaults(class_name: str) -> dict[str, Any]:
    """The keyword defaults of a diffusers class's constructor (its config keys a preset leaves out)."""
    cls = getattr(diffusers, class_name, None)
    if cls is None:
        return {}
    out = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if param.default is not inspect.Parameter.empty:
            with contextlib.suppress(TypeError, ValueError):
                out[name] = _plain(param.default)
    return out


def _exact_size(model: torch.nn.Module, preset: Preset) -> str | None:
    """The preset size whose config the model's config matches, else None. Both are read with the class's defaults
    for the keys they leave out, so a config that sets more than a preset's (SD3.5's ``qk_norm`` beside SD3's tiny
    config) matches the preset that sets it too, not the first whose keys it shares."""
    config = getattr(model, "config", {})
    defaults = _class_defaults(preset.model_class)
    for size in SIZES:
        want = {**defaults, **preset.configs[size]}
        if all(_plain(config.get(k, defaults.get(k))) == _plain(v) for k, v in want.items()):
            return size
    return None


def _matching_size(model: torch.nn.Module, preset: Preset) -> str:
    """The preset size whose config the model's config matches; ``"full"`` for any other checkpoint."""
    return _exact_size(model, preset) or "full"


def _closest_preset(model: torch.nn.Module, names: tuple[str, ...]) -> str:
    """Of presets sharing a class: the one with a size whose config the model's matches, else the one whose full
    config shares most values with the model's (a fine-tune or sibling checkpoint of that release)."""
    exact = [n for n in names if _exact_size(model, PRESETS[n]) is not None]
    if exact:
        return exact[0]
    config = getattr(model, "config", {})

    def shared(name: str) -> int:
        full = PRESETS[name].configs["full"]
        return sum(_plain(config.get(k)) == _plain(v) for k, v in full.items())

    return max(names, key=shared)  # the first of the best on a tie: menu order


def preset_of(model: torch.nn.Module) -> str:
    """Name of the preset a model belongs to: the one `load_model` recorded, else found by its class.

    Used by `make_inputs` to know the shapes a model expects. Wrappers such as ``torch.compile`` are seen
    through. Presets that share a class (``cogvideox-5b`` and ``cogvideox-2b``; ``sd3`` and the SD3.5s; the Wans;
    ``unet`` and ``sdxl``) are told apart by the config: the one with a size whose config the model's matches, else
    the one whose full config it shares most values with. A Wan2.2 A14B expert has Wan2.1-14B's config: it is
    ``wan``, whose inputs are the same.

    Example:
        >>> preset_of(load_model("wan"))
        'wan'
        >>> preset_of(diffusers.DiTTransformer2DModel(**PRESETS["dit"].configs["tiny"]))  # by class: 'dit'
    """
    model = getattr(model, "_orig_mod", model)
    name = getattr(model, "_memkit_preset", None)
    if name is None:
        names = _PRESETS_BY_CLASS.get(type(model).__name__)
        if names is not None:
            name = names[0] if len(names) == 1 else _closest_preset(model, names)
    if name not in PRESETS:
        raise ValueError(
            f"memkit cannot build the inputs of {type(model).__name__}: no preset has this class (the classes it "
            f"feeds: {', '.join(_PRESETS_BY_CLASS)}). Pass them: memkit.estimate(..., inputs=lambda model: "
            "{'hidden_states': ..., ...}) with the keyword arguments of its forward"
        )
    return name


# ------------------------------------------------------------------------------------------------------ inputs


def make_inputs(model: torch.nn.Module, *, batch_size: int = 1, seed: int = 0, **sizes: int) -> dict[str, Any]:
    """The keyword arguments of ``model(**inputs)``, random but deterministic for ``seed``, with realistic shapes.

    Sizes are in pixels and tokens, as a user thinks of them: ``height``, ``width`` (pixels; the latent is
    what the preset's VAE makes of them, /8, /16 for Wan2.2-TI2V-5B and HunyuanVideo 1.5 or /32 for LTX-Video and
    LTX-2, and must split into whole patches), ``frames`` (video presets; 4k+1 for Wan, HunyuanVideo (1.5) and
    CogVideoX, 6k+1 for Mochi, 8k+1 for LTX-Video and LTX-2, whose audio is as long as the video at 24 fps) and
    ``text_len`` (text tokens; not for DiT; exactly 226 for CogVideoX-2b, whose position table follows the padded T5
    prompt; a multiple of 128 for LTX-2, its text connectors' registers). Defaults follow the size the model was
    built at (see ``PRESETS[name].input_sizes``); a model loaded from a folder that matches no preset config gets
    the full-size defaults. Float tensors are in the model's dtype and on its device; the global RNG is
    untouched; works inside ``FakeTensorMode`` (attention masks, and other inputs whose values decide shapes,
    are fake tensors that keep their values: run the model under `memkit._torch_compat.known_values`). The
    output is requested as a tuple (``return_dict=False``): use `model_output` to get the tensor.

    Example:
        >>> model = load_model("ltx-video")
        >>> inputs = make_inputs(model, batch_size=2, height=64, width=96, frames=17)
        >>> model_output(model(**inputs)).shape  # (2, 3 * 2 * 3, 128)
    """
    name = preset_of(model)
    defaults = PRESETS[name].input_sizes[_size_of(model)]
    unknown = sorted(set(sizes) - set(defaults))
    if unknown:
        raise ValueError(f"unknown size {', '.join(unknown)} for preset {name!r}; allowed: {', '.join(defaults)}")
    for key, value in {"batch_size": batch_size, **sizes}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    # the compute dtype: a weight stored in fp8 (Quantize("fp8-storage")) is cast to the model's own around each layer
    param = next(p for p in model.parameters() if p.is_floating_point() and p.element_size() > 1)
    make = _Maker(param.dtype, param.device, seed)
    inputs = PRESETS[name].inputs(model.config, batch_size, {**defaults, **sizes}, make)
    return inputs | {"return_dict": False}


def _size_of(model: torch.nn.Module) -> str:
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "_memkit_size", None) or _matching_size(model, PRESETS[preset_of(model)])
