"""EMA of the weights: a shadow copy that follows the model slowly, updated after every optimizer step.

The shadows cost one more copy of the parameters (category ``ema``): on the device (``mode="device"``), or in
CPU memory (``"offload"``: streamed through a bounded device buffer for the update, pinned and non-blocking
when CUDA is available; ``"cpu_only"``: parameters are copied down and the update runs on the CPU). The
update is one in-place ``torch._foreach_lerp_`` (no full temporary copy, unlike diffusers' ``EMAModel``);
tensors whose dtype or device differ from their shadow's go through a buffer of at most ``chunk_mb``.
``update_every=N`` updates on every Nth step with the decay raised to N, so the averaging horizon in steps
stays the same (the "EMA weights on CPU" write-up; diffusers PR #7685).

``EMA`` is the config (what ``compare``, ``estimate`` and the CLI take); ``EMA.apply(model)`` builds an
:class:`EMAState` (the averager, a drop-in for diffusers' ``EMAModel``) reachable as ``handle.ema``.

Example:
    >>> handle = memkit.EMA(decay=0.999).apply(model)
    >>> memkit.Step(optimizer="adamw").bind(model, handle).run(inputs)   # one step, then the EMA update
    >>> with handle.ema.swapped_into(model): validate(model)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from ..handle import Handle
from ._ema_state import EMAState
from ._ema_update import _lerp, _lerp_staged  # noqa: F401  (importable from here, as before the split)

__all__ = ["EMA", "EMAState", "diffusers_check"]

_MODES = ("device", "offload", "cpu_only")
_SCHEDULES = ("diffusers", "constant")


@dataclass(frozen=True, kw_only=True)
class EMA:
    """An exponential moving average of a model's weights, updated after each step.

    Costs one copy of the parameters (in ``dtype``) and one pass over memory per update; saves nothing: it is
    what ``mode`` moves off the accelerator that matters (``"offload"``/``"cpu_only"`` keep the whole EMA in
    CPU memory). ``str(config)`` is ``"ema:<mode>"`` (plus ``":every=N"``), what :meth:`parse` reads.

    Example:
        >>> handle = memkit.EMA(decay=0.999, mode="cpu_only", update_every=4).apply(model)
        >>> for _ in range(8): runner.run(inputs)      # runner = memkit.Step(...).bind(model, handle)
        >>> handle.ema.copy_to(model)
    """

    decay: float = 0.9999
    """The largest decay (diffusers' ``decay``); with ``schedule="constant"`` the decay of every update."""
    mode: Literal["device", "offload", "cpu_only"] = "device"
    """Where the shadows live and where the update runs: ``"device"`` (beside the parameters), ``"offload"``
    (CPU memory, streamed through a device buffer of ``chunk_mb``), ``"cpu_only"`` (CPU memory, the update on
    the CPU). On a CPU-only machine all three keep the shadows in CPU memory and compute alike."""
    foreach: bool = True
    """``torch._foreach_lerp_`` over all tensors (fewer kernel launches); False: a per-tensor loop. Same shadows."""
    update_every: int = 1
    """Update on every Nth step only, with the decay raised to the Nth power (the same horizon in steps)."""
    schedule: Literal["diffusers", "constant"] = "diffusers"
    """``"diffusers"``: diffusers ``EMAModel``'s ``min(decay, (1+t)/(10+t))`` (or its warmup), clamped below by
    ``min_decay``; ``"constant"``: exactly ``decay`` on every update after ``update_after_step``."""
    min_decay: float = 0.0
    """The smallest decay of the diffusers schedule."""
    update_after_step: int = 0
    """Steps before averaging starts; until then the shadows copy the parameters."""
    use_ema_warmup: bool = False
    """diffusers' warmup: ``1 - (1 + t / inv_gamma) ** -power`` instead of ``(1+t)/(10+t)``."""
    inv_gamma: float = 1.0
    """Warmup: inverse multiplicative factor (diffusers' default 1)."""
    power: float = 2 / 3
    """Warmup: exponent (diffusers' default 2/3)."""
    dtype: torch.dtype | None = None
    """Shadow dtype for floating parameters; None: each parameter's own (e.g. ``torch.float32`` for a bf16 model)."""
    chunk_mb: float = 32.0
    """Bound of the staging buffer (MiB) for tensors whose dtype or device differs from their shadow's; the
    buffer is also at most 1/64 of those shadows' bytes (at least 64 Ki elements)."""

    def __post_init__(self) -> None:
        if not isinstance(self.decay, (int, float)) or not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay!r}")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {list(_MODES)}, got {self.mode!r}")
        if not isinstance(self.update_every, int) or isinstance(self.update_every, bool) or self.update_every < 1:
            raise ValueError(f"update_every must be an int >= 1, got {self.update_every!r}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {list(_SCHEDULES)}, got {self.schedule!r}")
        if not 0.0 <= self.min_decay <= 1.0:
            raise ValueError(f"min_decay must be in [0, 1], got {self.min_decay!r}")
        if not isinstance(self.update_after_step, int) or self.update_after_step < 0:
            raise ValueError(f"update_after_step must be an int >= 0, got {self.update_after_step!r}")
        if self.foreach not in (True, False):
            raise ValueError(f"foreach must be True or False, got {self.foreach!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if not self.chunk_mb > 0:
            raise ValueError(f"chunk_mb must be > 0, got {self.chunk_mb!r}")

    def build(self, parameters: torch.nn.Module | Iterable[torch.Tensor]) -> EMAState:
        """The averager for ``parameters`` (or a model's), shadows created now; no handle, no hooks.

        Example:
            >>> ema = memkit.EMA(decay=0.999).build(model)
            >>> ema.step(model, step=1)
        """
        return EMAState(parameters, config=self)

    def apply(self, model: torch.nn.Module) -> Handle:
        """Create the shadows; the handle updates them after each step and owns them (category ``ema``).

        The model itself is not changed; ``remove()`` drops the shadows. ``handle.ema`` is the :class:`EMAState`.

        Example:
            >>> with memkit.EMA(mode="offload").apply(model) as handle:
            ...     memkit.Step(optimizer="adamw").bind(model, handle).run(inputs)
            >>> handle.ema.shadow_params   # still readable after remove()
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        state = self.build(model)
        handle = Handle(
            lambda: None,
            name=str(self),
            owned=lambda: {"ema": state.shadow_params},
            after_step=lambda: state.step(model),
        )
        handle.ema = state
        return handle

    @classmethod
    def parse(cls, value: str) -> EMA:
        """The config a command-line or widget value names: ``"<mode>"`` or ``"<mode>:every=N"``.

        Example:
            >>> memkit.EMA.parse("cpu_only:every=4")
            EMA(decay=0.9999, mode='cpu_only', ..., update_every=4, ...)
        """
        mode, _, rest = value.partition(":")
        if not rest:
            return cls(mode=mode)
        key, _, number = rest.partition("=")
        if key != "every" or not number.isdigit():
            raise ValueError(f"ema value must be '<mode>' or '<mode>:every=N' (N an int >= 1), got {value!r}")
        return cls(mode=mode, update_every=int(number))

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, model: torch.nn.Module | None = None, **overrides: Any
    ) -> EMAState:
        """An averager read from a folder written by :meth:`EMAState.save_pretrained` (or diffusers'
        ``EMAModel.save_pretrained``): shadows from the safetensors weights, settings from ``config.json``.

        ``model`` gives the parameters' order (their names); a folder memkit wrote records it, one diffusers
        wrote does not (its weights file also holds buffers), so pass the model for those.

        Example:
            >>> ema = memkit.EMA.from_pretrained("out/ema")
            >>> ema = memkit.EMA.from_pretrained("diffusers-ema", model=transformer)
            >>> ema.copy_to(model)
        """
        from safetensors.torch import load_file

        path = os.fspath(path)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"path {path!r} holds no .safetensors file")
        tensors: dict[str, torch.Tensor] = {}
        for name in files:
            tensors.update(load_file(os.path.join(path, name)))
        if model is not None:
            names = [n for n, _ in model.named_parameters()]
        elif "_memkit_parameter_names" in config:
            names = config["_memkit_parameter_names"]
        else:
            raise ValueError(
                f"path {path!r} does not record the parameters' order (not written by memkit): pass model=, "
                "the model whose parameters the shadows follow"
            )
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(
                f"path {path!r} holds no weights for {missing[:5]} ({len(missing)} missing): another model"
            )
        settings = {f.name: config[f.name] for f in fields(cls) if f.name in config and f.name not in ("dtype",)}
        state = EMAState([tensors[n] for n in names], config=cls(**{**settings, **overrides}))
        state.names = list(names)
        state.optimization_step = int(config.get("optimization_step", 0))
        return state

    def __str__(self) -> str:
        return f"ema:{self.mode}" + (f":every={self.update_every}" if self.update_every != 1 else "")


def diffusers_check(
    initial: Callable[[], torch.nn.Module], **settings: Any
) -> Callable[[torch.nn.Module, Handle], dict[str, float]]:
    """A :class:`memkit.Variant` check: the variant's shadows against diffusers' ``EMAModel(**settings)`` built
    from ``initial()``'s weights and stepped once on the model after the compared step (what ``compare`` runs).

    Two columns: ``max |Δema|``, and ``Δema / Δparam``, the same difference over how far the step moved the
    parameters (one optimizer step moves them by about its learning rate, so the raw difference can never
    exceed that, right or wrong; the ratio is ~1 for an EMA that ignores its schedule, 0 for a correct one).

    Example:
        >>> check = diffusers_check(lambda: memkit.load_model("flux"), decay=0.9)
        >>> memkit.Variant(optimizations=[memkit.EMA(decay=0.9)], check=check)   # column "max |Δema|"
    """
    from diffusers.training_utils import EMAModel

    @torch.no_grad()  # differences of trained weights: no graph, and no warning for float() of a tensor needing grad
    def check(model: torch.nn.Module, handle: Handle) -> dict[str, float]:
        start = initial()
        moved = max(
            (
                float((a.float() - b.float()).abs().max())
                for a, b in zip(model.parameters(), start.parameters(), strict=True)
            ),
            default=0.0,
        )
        ref = EMAModel(start.parameters(), **settings)
        ref.step(model.parameters())
        shadows = handle.owned()["ema"]
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(shadows, ref.shadow_params, strict=True)]
        worst = max(diffs, default=0.0)
        return {"max |Δema|": worst, "Δema / Δparam": worst / moved if moved > 0 else worst}

    return check
