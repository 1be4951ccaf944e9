"""LoRA through peft: freeze the base model and train low-rank adapters beside chosen linear layers.

The memory of a LoRA fine-tune is mostly the frozen base (its weights, no gradients, no optimizer state) plus the
activations; the adapters' weights, gradients and optimizer state are small (full Flux, rank 16 on the attention
projections: 18.7M trainable parameters beside 11.9B frozen). What does *not* shrink: activations (the base's
inputs are still kept for the adapters' backward and for the input gradient). DoRA (``dora=True``) is the trap:
it materialises each adapted layer's whole weight (and its norm) in every forward, one weight-sized temporary per
layer, kept for the backward.

This is peft itself (``model.add_adapter(LoraConfig(...))``, as diffusers' ``train_dreambooth_lora_*`` scripts
call it), not a re-implementation. Under fake tensors (:func:`memkit.estimate`) peft's own code runs too; the one
thing torch refuses there, ``Module.to()`` on fake parameters (it must swap them, and a fake parameter carries a
weakref), is done by :func:`memkit._torch_compat.fake_module_to` for the duration of ``add_adapter``.

Example:
    >>> with memkit.LoRA(rank=16).apply(model) as handle:     # the preset's default targets
    ...     memkit.train_step(model, inputs)                   # only the adapters train
    >>> memkit.estimate("flux", optimizations=[memkit.LoRA(rank=16)]).meta["trainable_parameters"]
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..handle import Handle

__all__ = ["DEFAULT_TARGETS", "LoRA", "default_targets"]

ADAPTER = "memkit"
"""The adapter's name in peft (``model.peft_config`` key, ``...lora_A.memkit.weight``)."""

DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    # diffusers' examples/dreambooth/train_dreambooth_lora_flux.py (its default without --lora_layers)
    "FluxTransformer2DModel": (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ),  # fmt: skip
    # train_dreambooth_lora_sd3.py (SD3 and SD3.5; "attn.to_k" leaves SD3.5 Medium's second attention, attn2, out)
    "SD3Transformer2DModel": (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ),  # fmt: skip
    # train_dreambooth_lora_sana.py (PixArt's successor; PixArt has no LoRA script of its own)
    "PixArtTransformer2DModel": ("to_k", "to_q", "to_v"),
    "SanaTransformer2DModel": ("to_k", "to_q", "to_v"),
    # train_dreambooth_lora.py (the UNet script); train_dreambooth_lora_sdxl.py's ["to_k", "to_q", "to_v", "to_out.0"]
    # for SDXL, whose UNet has no add_k_proj or add_v_proj: the same layers
    "UNet2DConditionModel": ("to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_v_proj"),
    # diffusers' examples/cogvideo/train_cogvideox_lora.py; finetrainers' docs/training/cogvideox.md
    "CogVideoXTransformer3DModel": ("to_k", "to_q", "to_v", "to_out.0"),
    # finetrainers' docs/training/hunyuan_video.md (--target_modules to_q to_k to_v to_out.0); diffusers has no
    # HunyuanVideo LoRA script. The names also reach the token refiner's attention, as in finetrainers' count.
    "HunyuanVideoTransformer3DModel": ("to_k", "to_q", "to_v", "to_out.0"),
    # train_dreambooth_lora_flux2.py: the attention projections, and the single blocks' fused QKV+MLP input and
    # output projections (named block by block, as the script does: "to_out" alone is the double blocks' ModuleList)
    "Flux2Transformer2DModel": (
        "to_k",
        "to_q",
        "to_v",
        "to_out.0",
        "to_qkv_mlp_proj",
        *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)),
    ),
    # train_dreambooth_lora_hidream.py (its default without --lora_layers): HiDream's to_out is a Linear, not a
    # ModuleList, and peft matches "to_out" to the image stream's projection alone (not to_out_t). memkit has no
    # HiDream preset (memkit.naming: no estimate of it), but compare measures it with these.
    "HiDreamImageTransformer2DModel": ("to_k", "to_q", "to_v", "to_out"),
}
"""Model class -> the modules diffusers' LoRA training script for that family targets by default. Classes not
listed (Wan, LTX-Video, DiT, Mochi, HunyuanVideo 1.5) get :data:`ATTENTION`, the attention projections finetrainers
and diffusers' ``train_dreambooth_lora_qwen_image.py`` target, as do ``train_dreambooth_lora_z_image.py`` (Z-Image)
and ``train_dreambooth_lora_lumina2.py`` (Lumina2) without ``--lora_layers``; Mochi's own script (cogvideox-factory's
``training/mochi-1/args.py``, ``--target_modules`` default) targets the same four; LTX-2 too, as Lightricks'
ltx-trainer recommends for audio-video training (``packages/ltx-trainer/docs/configuration-reference.md``: every
attention of both streams and between them). HunyuanVideo 1.5 has no LoRA script in diffusers or finetrainers."""

ATTENTION = ("to_k", "to_q", "to_v", "to_out.0")

_INIT = ("gaussian", "true", "false")


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """The modules LoRA adapts in ``model`` when no ``targets`` are given (see :data:`DEFAULT_TARGETS`).

    Example:
        >>> memkit.optimizations.lora.default_targets(memkit.load_model("wan"))
        ('to_k', 'to_q', 'to_v', 'to_out.0')
    """
    return DEFAULT_TARGETS.get(type(model).__name__, ATTENTION)


def _require_peft():
    if importlib.util.find_spec("peft") is None:
        raise ImportError('LoRA needs peft: pip install "memkit[finetune]" (or pip install peft)')
    import peft

    return peft


@dataclass(frozen=True, kw_only=True)
class LoRA:
    """Train low-rank adapters (peft's LoRA) beside the ``targets`` linear layers; the base model is frozen.

    Saves the base's gradients and optimizer state (for AdamW in fp32: 12 of a full fine-tune's 16 bytes per
    parameter beyond the weights) at the cost of a few small matmuls per adapted layer; activations stay. DoRA
    adds one weight-sized temporary per adapted layer in the forward (kept for the backward).

    Example:
        >>> memkit.LoRA(rank=16, targets=("to_q", "to_k", "to_v", "to_out.0")).apply(model)
        >>> memkit.LoRA.parse("16:alpha=32:targets=to_q,to_v")
    """

    rank: int = 16
    """The adapters' rank r (>= 1): each adapted ``Linear(in, out)`` gains ``r * (in + out)`` trainable
    parameters."""
    alpha: float | None = None
    """peft's ``lora_alpha`` (> 0; the update is scaled by alpha / rank). None: equal to ``rank``, as diffusers'
    scripts default."""
    dropout: float = 0.0
    """peft's ``lora_dropout`` on each adapter's input, in [0, 1): above 0 it keeps a dropout mask per adapted
    layer for the backward."""
    targets: tuple[str, ...] | None = None
    """Module names (or name suffixes, peft's ``target_modules``) to adapt; None: the model family's default
    (:data:`DEFAULT_TARGETS`). Each must match a module of the model."""
    init: Literal["gaussian", "true", "false"] = "gaussian"
    """peft's ``init_lora_weights``: ``"gaussian"`` (diffusers' scripts) or ``"true"`` (peft's default, Kaiming A)
    leave B at zero, so the model's output is the base's at the start; ``"false"`` initialises both randomly."""
    dora: bool = False
    """Weight-decomposed LoRA (peft's ``use_dora``): a trainable magnitude per output row, and the adapted weight
    materialised in every forward."""
    dtype: torch.dtype | None = None
    """The adapters' dtype. None: the base layer's, as peft makes them (diffusers' scripts in bf16); a float
    dtype casts them after adding, as the scripts' ``cast_training_params(model, torch.float32)`` does under fp16
    mixed precision."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        if self.alpha is not None and (
            isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0
        ):
            raise ValueError(f"alpha must be a number > 0 or None (= rank), got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.targets is not None:
            if isinstance(self.targets, str) or not all(isinstance(t, str) and t for t in self.targets):
                raise ValueError(f"targets must be a tuple of module names or None, got {self.targets!r}")
            if not self.targets:
                raise ValueError("targets must name at least one module, or be None for the model's default")
            object.__setattr__(self, "targets", tuple(self.targets))
        if self.init not in _INIT:
            raise ValueError(f"init must be one of {list(_INIT)}, got {self.init!r}")
        if self.dora not in (True, False):
            raise ValueError(f"dora must be True or False, got {self.dora!r}")
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None (the base layer's), got {self.dtype!r}")

    def apply(self, model: nn.Module) -> Handle:
        """Freeze ``model`` and add the adapters (peft's ``add_adapter``); returns the handle that takes them out
        and restores every parameter's ``requires_grad``."""
        peft = _require_peft()
        from .._torch_compat import fake_module_to

        if self.targets is not None:
            targets = self.targets
            _check_targets(model, targets)
        else:  # a script's list names layers some variants of the family lack (the UNet's add_k_proj)
            names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
            targets = tuple(t for t in default_targets(model) if any(_matches(n, t) for n in names))
            if not targets:
                raise ValueError(
                    f"none of the default targets {list(default_targets(model))} is a linear layer of "
                    f"{type(model).__name__}: give targets (its linear layers: {linear_names(model)[:20]})"
                )
        _refuse_split_feedforward(model, targets)
        if getattr(model, "peft_config", None):
            raise ValueError(
                f"model already has peft adapters {sorted(model.peft_config)}: memkit.LoRA adds its own to a model "
                "without any"
            )
        flags = [(p, p.requires_grad) for p in model.parameters()]
        missing = object()
        saved = {k: model.__dict__.get(k, missing) for k in ("peft_config", "_hf_peft_config_loaded")}

        def undo() -> None:
            _remove_adapters(model)
            for k, v in saved.items():
                if v is missing:
                    model.__dict__.pop(k, None)
                else:
                    model.__dict__[k] = v
            for p, flag in flags:
                p.requires_grad_(flag)

        config = peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha if self.alpha is not None else self.rank,
            lora_dropout=float(self.dropout),
            target_modules=list(targets),
            init_lora_weights={"gaussian": "gaussian", "true": True, "false": False}[self.init],
            use_dora=self.dora,
        )
        try:
            model.requires_grad_(False)
            with fake_module_to():
                if hasattr(model, "add_adapter"):  # diffusers' models: what the training scripts call
                    model.add_adapter(config, adapter_name=ADAPTER)
                else:
                    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
                # the scripts' own upcast (a tensor's .to works on fake tensors too); beside weights stored in fp8
                # (Quantize("fp8-storage")) peft would make the adapters fp8 too: they take the compute dtype
                dtype = self.dtype or model.__dict__.get("_memkit_compute_dtype")
                if dtype is not None:
                    from diffusers.training_utils import cast_training_params

                    cast_training_params(model, dtype=dtype)
        except BaseException:
            undo()
            raise
        return Handle(undo, name=str(self))

    @classmethod
    def parse(cls, value: str) -> LoRA:
        """The config a command-line or widget value names: ``"RANK[:alpha=A][:targets=a,b][:dropout=P]
        [:init=gaussian|true|false][:dora][:dtype=float32]"``.

        Example:
            >>> memkit.LoRA.parse("16:alpha=32:targets=to_q,to_v:dora")
            LoRA(rank=16, alpha=32.0, ..., targets=('to_q', 'to_v'), dora=True)
        """
        head, *opts = value.split(":")
        usage = "lora value must be RANK[:alpha=A][:targets=a,b,c][:dropout=P][:init=I][:dora][:dtype=D]"
        try:
            rank = int(head)
        except ValueError:
            raise ValueError(f"{usage} (e.g. '16', '16:alpha=32'), got {value!r}") from None
        kwargs: dict = {}
        for opt in opts:
            key, eq, val = opt.partition("=")
            if key == "dora" and not eq:
                kwargs["dora"] = True
            elif key == "alpha" and eq:
                kwargs["alpha"] = _number("alpha", val)
            elif key == "dropout" and eq:
                kwargs["dropout"] = _number("dropout", val)
            elif key == "targets" and eq:
                kwargs["targets"] = tuple(t.strip() for t in val.split(",") if t.strip())
            elif key == "init" and eq:
                kwargs["init"] = val
            elif key == "dtype" and eq:
                dtype = getattr(torch, val, None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"lora dtype must be a torch dtype name such as 'float32', got {val!r}")
                kwargs["dtype"] = dtype
            else:
                raise ValueError(f"{usage}; unknown option {opt!r} in {value!r}")
        return cls(rank=rank, **kwargs)

    def __str__(self) -> str:
        parts = [str(self.rank)]
        if self.alpha is not None:
            parts.append(f"alpha={self.alpha:g}")
        if self.dropout:
            parts.append(f"dropout={self.dropout:g}")
        if self.targets is not None:
            parts.append("targets=" + ",".join(self.targets))
        if self.init != "gaussian":
            parts.append(f"init={self.init}")
        if self.dora:
            parts.append("dora")
        if self.dtype is not None:
            parts.append("dtype=" + str(self.dtype).replace("torch.", ""))
        return "lora:" + ":".join(parts)


def _number(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"lora {name} must be a number, got {text!r}") from None


def linear_names(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s ``nn.Linear`` layers with block indices folded (``blocks.*.attn.to_q``):
    what LoRA can target, listed once per kind.

    Example:
        >>> memkit.optimizations.lora.linear_names(model)[:3]
    """
    seen: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            seen[re.sub(r"\.\d+\.", ".*.", f".{name}.").strip(".")] = None
    return list(seen)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule for a list of target_modules


def _check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    unknown = [t for t in targets if not any(_matches(n, t) for n in names)]
    if unknown:
        kinds = linear_names(model)
        raise ValueError(
            f"targets {unknown} match no linear layer of {type(model).__name__}; its linear layers are "
            f"{kinds[:40]}{' ...' if len(kinds) > 40 else ''} (a target matches a name or its last parts)"
        )


def _refuse_split_feedforward(model: nn.Module, targets: tuple[str, ...]) -> None:
    """A feed-forward layer that FFSplit already replaced computes from its captured weights, past any adapter."""
    from .feedforward import find_mlps

    for name, module, _ in find_mlps(model):
        if "forward" not in module.__dict__:
            continue
        inside = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and n]
        hit = [f"{name}.{n}" for n in inside if any(_matches(f"{name}.{n}", t) for t in targets)]
        if hit:
            raise ValueError(
                f"LoRA targets {hit[:3]} lie in a feed-forward layer that ff-split has split: its split forward "
                "reads the weights directly and would skip the adapters. Apply LoRA first, or leave the "
                "feed-forward layers out of targets (e.g. targets=to_q,to_k,to_v,to_out.0)"
            )


def _remove_adapters(model: nn.Module) -> None:
    """Put every peft-wrapped layer's base layer back where the wrapper is (peft's own ``get_base_layer``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, BaseTunerLayer):
                setattr(module, child_name, child.get_base_layer())


def refuse_adapters_in_feedforward(model: nn.Module) -> None:
    """For :class:`memkit.FFSplit`: a split forward reads the layers' weights directly, so an adapter (peft's LoRA) in a
    feed-forward layer would be skipped, or the layer not recognised and silently left whole: a ValueError."""
    from diffusers.models.attention import FeedForward

    for name, module in model.named_modules():
        if not isinstance(module, FeedForward):
            continue
        adapted = [n for n, m in module.named_modules() if type(m).__module__.startswith("peft.")]
        if adapted:
            raise ValueError(
                f"ff-split cannot split {name}: LoRA adapters sit in it ({name}.{adapted[0]}), and the split forward "
                "would skip them; give LoRA targets outside the feed-forward layers (e.g. targets=to_q,to_k,to_v,"
                "to_out.0)"
            )
