"""What a user names a model by, resolved to what an estimate builds: a preset, or a diffusers class and its config.

Users name a model as they found it: a preset (``"flux"``), the released model's hub id
(``"black-forest-labs/FLUX.1-dev"``), a folder written by ``save_pretrained`` (or a pipeline folder with a
``transformer/`` or ``unet/`` subfolder), a ``config.json`` path, or any diffusers hub id. An estimate needs only
the config, never the weights:

- a preset, or a preset's hub id (case-insensitive), answers offline: the preset's ``full`` config is that
  repository's config, shipped with memkit (``Preset.hub_id``);
- a folder or a ``config.json`` is read from disk;
- any other hub id downloads its ``config.json`` alone (``huggingface_hub.hf_hub_download``: ``transformer/``
  first, then ``unet/``, then the repository's root), once, into the hub's cache. Offline, it says it needs the
  network once.

The class comes from the config's ``_class_name`` and must be in the installed diffusers; the inputs of its forward
come from the preset of the same class (its input builder, at the full-size defaults), so a class no preset has is
refused with a pointer to ``inputs=``.

Example:
    >>> resolve("black-forest-labs/FLUX.1-dev").preset              # 'flux', offline
    >>> resolve("path/to/transformer/config.json").class_name       # e.g. 'SanaTransformer2DModel'
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from .presets import PRESETS

__all__ = [
    "ClassSupport",
    "ModelRef",
    "diffusers_classes",
    "preset_parameters",
    "resolve",
    "support_table",
    "unestimable",
]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_SUBFOLDERS = ("transformer", "unet", None)  # a pipeline's denoiser, then a model repository


@dataclass(frozen=True)
class ModelRef:
    """A model as an estimate builds it: a preset, or a diffusers class with its config (one size, its own).

    Example:
        >>> ref = resolve("Wan-AI/Wan2.1-T2V-14B-Diffusers")
        >>> ref.preset, ref.class_name                                  # ('wan', 'WanTransformer3DModel')
    """

    source: str
    """What the user wrote."""
    class_name: str
    """The diffusers class, e.g. ``"SanaTransformer2DModel"``."""
    preset: str | None = None
    """The preset it is (by name or hub id), or None for a config read from disk or the hub."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The class's keyword arguments, for a config that is no preset (empty for a preset: its sizes have theirs)."""


def resolve(name: str | os.PathLike) -> ModelRef:
    """The preset or the (class, config) that ``name`` stands for; a ValueError says why not, naming close matches.

    Args:
        name: a preset name, a preset's hub id, a folder (``save_pretrained``'s, or a pipeline's with
            ``transformer/`` or ``unet/``), a ``config.json`` path, or a diffusers hub id ``"owner/name"``.

    Example:
        >>> resolve("flux")                       # ModelRef(source='flux', class_name='FluxTransformer2DModel', ...)
        >>> resolve("THUDM/CogVideoX-5b")          # a preset's hub id: no network
    """
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
        raise TypeError(f"model must be a preset name, a hub id, a folder or a config.json path, got {name!r}")
    text = os.fspath(name)
    if text in PRESETS:
        return ModelRef(text, PRESETS[text].model_class, preset=text)
    by_hub = {p.hub_id.lower(): p.name for p in PRESETS.values() if p.hub_id}
    if text.rstrip("/").lower() in by_hub:
        preset = by_hub[text.rstrip("/").lower()]
        return ModelRef(text, PRESETS[preset].model_class, preset=preset)
    path = Path(text).expanduser()
    if path.is_file():
        return _from_config_file(path, text)
    if path.is_dir():
        for sub in _SUBFOLDERS:
            candidate = path / sub / "config.json" if sub else path / "config.json"
            if candidate.is_file():
                return _from_config_file(candidate, text)
        raise ValueError(f"{text} holds no config.json (nor transformer/ or unet/ with one)")
    if _HUB_ID.fullmatch(text):
        return _from_hub(text)
    raise ValueError(_unknown(text))


def _close_names(text: str) -> list[str]:
    """The presets' names and hub ids closest to ``text`` (case-insensitive), best first."""
    names = list(PRESETS) + [p.hub_id for p in PRESETS.values() if p.hub_id]
    lowered = {n.lower(): n for n in names}
    return [lowered[m] for m in difflib.get_close_matches(text.lower(), list(lowered), n=4, cutoff=0.5)]


def _unknown(text: str) -> str:
    close = _close_names(text)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return (
        f"unknown model {text!r}: not a preset, a preset's hub id, a folder or a config.json{hint} "
        f"(presets: {', '.join(PRESETS)}; `memkit models` lists them with their hub ids)"
    )


def _from_config_file(path: Path, source: str) -> ModelRef:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON config: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a diffusers config.json (a JSON object with _class_name)")
    return _from_config(config, source, str(path))


def _from_config(config: Mapping[str, Any], source: str, where: str) -> ModelRef:
    import diffusers

    from .models import diffusers_class

    class_name = config.get("_class_name")
    if not isinstance(class_name, str):
        raise ValueError(f"{where} has no _class_name: not a diffusers model config.json")
    if diffusers_class(class_name) is None:
        wrote = config.get("_diffusers_version")
        raise ValueError(
            f"{where} is a {class_name}, which diffusers {diffusers.__version__} does not have"
            + (f" (the config was written by diffusers {wrote})" if wrote else "")
            + ": install a diffusers that has it (pip install -U diffusers)"
        )
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    return ModelRef(source, class_name, config=kwargs)


def _hub_reachable() -> bool:
    """Whether the hub's host name resolves: without a network, huggingface_hub retries each request for ~20 s
    before it looks in its cache; this answers at once (the cache is then read with ``local_files_only``)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except (OSError, UnicodeError):
        return False
    return True


def _from_hub(repo_id: str) -> ModelRef:
    import huggingface_hub
    from huggingface_hub import errors

    offline = (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)
    missing = (errors.EntryNotFoundError, errors.RemoteEntryNotFoundError)
    local = not _hub_reachable()
    for sub in _SUBFOLDERS:
        try:
            file = huggingface_hub.hf_hub_download(repo_id, "config.json", subfolder=sub, local_files_only=local)
        except offline:
            if local and sub is not _SUBFOLDERS[-1]:
                continue  # the cache may hold another subfolder's
            close = ", ".join(_close_names(repo_id))
            raise ValueError(
                f"{repo_id} is not a preset's hub id, and its config.json is not in the hub's cache: memkit needs "
                "the network once to download that one file (never the weights); or pass a local config.json"
                + (f". A preset's hub id close to it: {close}" if close else "")
            ) from None
        except errors.RepositoryNotFoundError:
            why = f"{repo_id}: no such repository on the hub (or a private one). {_unknown(repo_id)}"
            raise ValueError(why) from None
        except missing:
            continue
        return _from_config_file(Path(file), repo_id)
    raise ValueError(f"{repo_id} has no config.json in transformer/, unet/ or its root")


# ----------------------------------------------------------------------------------------------- what is supported


# Classes no inputs make estimable: each one's cell in the support table, and the whole reason.
_UNESTIMABLE: dict[str, tuple[str, str]] = {
    "HiDreamImageTransformer2DModel": (
        "its MoE routing sizes tensors by value",
        "HiDream-I1's mixture-of-experts feed-forward hands each expert the tokens its router picked (boolean-mask "
        "indexing, aten.nonzero, in training mode; aten.bincount in force_inference_output mode, which diffusers' "
        "LoRA script uses): tensor sizes follow the values, which fake tensors do not hold, and so does the real "
        "step's memory",
    ),
}


def unestimable(class_name: str) -> str | None:
    """Why no estimate of a ``class_name`` model can be made, whatever its inputs, or None.

    Example:
        >>> unestimable("HiDreamImageTransformer2DModel")            # "HiDream-I1's mixture-of-experts ..."
    """
    reason = _UNESTIMABLE.get(class_name)
    return reason[1] if reason else None


def _is_denoiser(name: str) -> bool:
    return name.endswith(("Transformer2DModel", "Transformer3DModel")) or name.startswith("UNet")


@dataclass(frozen=True)
class ClassSupport:
    """One transformer or UNet class of the installed diffusers, and what memkit does with it.

    Example:
        >>> [c for c in diffusers_classes() if c.supported][0]       # ClassSupport('DiTTransformer2DModel', ...)
    """

    class_name: str
    presets: tuple[str, ...]
    """The presets of this class (empty: none)."""
    kind: str
    """``"image"`` or ``"video"`` (a ``Transformer3DModel``, or a preset that takes frames), ``"other"``."""
    supported: bool
    """True: memkit builds its inputs (a preset has the class), so any config of it can be estimated."""
    why: str
    """How it is supported, or the named reason it is refused."""
    refused: str = ""
    """Why, in a few words (``"no input builder"``), for a refused class; empty for a supported one."""


def diffusers_classes() -> list[ClassSupport]:
    """Every transformer (``*Transformer2DModel``, ``*Transformer3DModel``) and UNet (``UNet*``) class of the installed
    diffusers, each supported (a preset has it: its inputs are built, any config of it is estimated) or refused
    with the reason. Reads the names only: no class is imported.

    Example:
        >>> sum(c.supported for c in diffusers_classes()), len(diffusers_classes())
    """
    import diffusers

    by_class: dict[str, list[str]] = {}
    for p in PRESETS.values():
        by_class.setdefault(p.model_class, []).append(p.name)
    out = []
    for name in sorted(n for n in dir(diffusers) if _is_denoiser(n)):
        presets = tuple(by_class.get(name, ()))
        video = name.endswith("3DModel") or any("frames" in PRESETS[p].input_sizes["full"] for p in presets)
        kind = "video" if video else "image" if name.endswith("2DModel") or "UNet2D" in name else "other"
        refused = ""
        if presets:
            why = f"preset {', '.join(presets)}; any config of the class is estimated with its inputs"
        elif name in _UNESTIMABLE:
            refused, reason = _UNESTIMABLE[name]
            why = f"refused: {reason}; measure a real step with memkit.compare"
        else:
            refused = "no input builder"
            why = (
                "refused: no preset has this class, so memkit cannot build its forward's inputs; estimate it with "
                "memkit.estimate(config_json, inputs=lambda model: {...})"
            )
        out.append(ClassSupport(name, presets, kind, bool(presets), why, refused))
    return out


@cache
@cache  # a preset's released config does not change in a process: `memkit models` counts ~40 of them
def preset_parameters(name: str) -> int:
    """The parameter count of a preset at full size (the released model), counted on the meta device: no memory.

    Example:
        >>> preset_parameters("flux")                                  # 11_901_408_320
    """
    import torch

    from .models import diffusers_class

    preset = PRESETS[name]
    with torch.device("meta"):
        model = diffusers_class(preset.model_class)(**preset.configs["full"])
    return sum(p.numel() for p in model.parameters())


def support_table() -> str:
    """The README's support table (Markdown): each diffusers class, image or video, its presets, or why it is
    refused. A test checks the README holds exactly this text.

    Example:
        >>> print(support_table())
    """
    rows = ["| class | kind | memkit |", "|---|---|---|"]
    for c in diffusers_classes():
        if c.supported:
            status = f"preset `{'`, `'.join(c.presets)}`"
        else:
            status = f"refused: {c.refused} " + ("(measure with `compare`)" if c.class_name in _UNESTIMABLE else
                                                 "(pass `inputs=`)")  # fmt: skip
        rows.append(f"| `{c.class_name}` | {c.kind} | {status} |")
    return "\n".join(rows)
