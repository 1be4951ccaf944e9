"""Gradient (activation) checkpointing as a memkit optimization, block by block.

Checkpointing a block keeps only its inputs during the forward and recomputes its activations during the
backward: activation memory drops to about one block's worth, at the cost of a second forward through the
checkpointed blocks (~20–35% more step time for "all"). Checkpointing only some blocks is a trade between
the two ends (diffusers PR #10611's LTX-Video table: none 26.7 GB at 1.68 it/s, every 4th 22.2 GB at 1.66,
every 2nd 17.7 GB at 1.54, all 9.3 GB at 1.36). It does nothing in inference (no backward, nothing kept).

Blocks: on a diffusers model, the modules its own forward hands to ``_gradient_checkpointing_func`` (the
transformer blocks; UNet's resnets and attention transformer blocks), numbered in module order
(``model.named_modules()``). On any other ``nn.Module``: the blocks of its longest ``nn.ModuleList``, or of the
list ``blocks=`` names.

Providers: ``"torch"``, non-reentrant ``torch.utils.checkpoint`` (diffusers' default); ``"selective"``, torch's
selective activation checkpointing that keeps the outputs of matmuls, convolutions and attention (the
expensive ops) and recomputes the rest (norms, activations, adds): more memory than ``"torch"``, much less
recompute; ``"offload"``, like ``"torch"`` but the inputs a block keeps for its recompute wait in CPU memory
(copied down in the forward, pinned and non-blocking from CUDA, and back for the recompute): the device keeps
none of a checkpointed block's inputs, for one host round trip of them per step. On the CPU it moves nothing and
is ``"torch"``.
"""

from __future__ import annotations

import functools
import re
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from ..blocks import diffusers_blocks, find_blocks, is_diffusers_model, module_list_blocks  # noqa: F401  (importable from here, as before)
from ..handle import Handle
from ..memory.tracker import off_device
from ._common import planned_cuda as _planned_cuda
from ._common import warn_once as _warn_once

if TYPE_CHECKING:
    from ..planning import CheckpointPlan

PATTERN_FORMS = ("none", "all", "every:N", "skip-every:N", "first:K", "last:K")
"""The string forms of a pattern; a tuple of block indices or a callable ``(index, block) -> bool`` also work."""
PROVIDERS = ("torch", "selective", "offload")

_FORM = re.compile(r"^(every|skip-every|first|last):(\d+)$")
_aten = torch.ops.aten
# Outputs selective checkpointing keeps: the ops that cost compute; everything else is recomputed.
_SAVE = {
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
}


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _offload_target(device: torch.device) -> torch.device | None:
    """Where provider "offload" keeps the saved inputs of a block on ``device``: CPU memory, or None when they
    are there already (a CPU run; in an estimate for ``"cuda"`` CPU tensors stand for device ones and move).
    (Tests point CPU tensors at a separate CPU copy to watch the mechanism without a GPU.)"""
    return None if device.type == "cpu" and not _planned_cuda() else torch.device("cpu")


def _to_host(t: torch.Tensor, host: torch.device) -> torch.Tensor:
    # From CUDA a non-blocking copy to the CPU lands in pinned memory (aten's _to_copy pins its output); only
    # the copy back reads it, ordered on the same stream, so nothing waits. The copy asks for a gradient when
    # the input did: the recompute must save the same tensors as the forward (matmuls save per requires_grad).
    # Made under off_device(): trackers count it in host memory, not in the device's timeline.
    with off_device():
        copy = t.detach().to(host, non_blocking=t.is_cuda, copy=True)
    return copy.requires_grad_(t.requires_grad)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=device.type == "cuda", copy=True)


# id(original) -> (weakref to it, its version when copied, its host copy). Blocks share tensors (the text
# states, the timestep embedding, the rotary tables go to every block): each is copied down once while it lives
# and is unchanged, not once per block.
_host_copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _forget(key: int, _ref=None) -> None:
    _host_copies.pop(key, None)


def _host_copy(x: torch.Tensor, host: torch.device) -> torch.Tensor:
    key = id(x)
    hit = _host_copies.get(key)
    if hit is not None and hit[0]() is x and hit[1] == x._version and hit[2].requires_grad == x.requires_grad:
        return hit[2]
    copy = _to_host(x, host)
    _host_copies[key] = (weakref.ref(x, functools.partial(_forget, key)), x._version, copy)
    return copy


def _run_offloaded(fn: Callable, *args, **kwargs):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    targets = [_offload_target(x.device) if isinstance(x, torch.Tensor) else None for x in leaves]
    if not any(targets):
        _warn_once(
            "checkpointing provider='offload': the blocks' inputs are in CPU memory already, so nothing moves "
            "and it checkpoints as provider='torch'"
        )
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    host = [_host_copy(x, target) if target is not None else x for x, target in zip(leaves, targets, strict=True)]
    devices = [x.device if target is not None else None for x, target in zip(leaves, targets, strict=True)]
    # Zero-byte tensors on the blocks' devices, first among checkpoint's arguments: it stashes and restores
    # their RNG state (dropout recomputes the same mask) and takes their autocast, as it would from the inputs.
    markers = [torch.empty(0, device=d) for d in dict.fromkeys(d for d in devices if d is not None)]
    live = [(args, kwargs)]
    del args, kwargs, leaves  # from here only the host copies (and ``live``, until the forward) hold them

    def run(*flat):
        if live:  # the forward: the block reads its own inputs, nothing to copy back
            a, k = live.pop()
        else:  # the recompute in the backward: the host copies come back to the block's devices, once each
            back: dict[int, torch.Tensor] = {}
            for x, d in zip(flat[len(markers) :], devices, strict=True):
                if d is not None and id(x) not in back:
                    back[id(x)] = _to_device(x, d)
            moved = [back[id(x)] if d is not None else x for x, d in zip(flat[len(markers) :], devices, strict=True)]
            a, k = pytree.tree_unflatten(moved, spec)
        return fn(*a, **k)

    return torch.utils.checkpoint.checkpoint(run, *markers, *host, use_reentrant=False)


def _run_checkpointed(provider: str, fn: Callable, *args, **kwargs):
    if provider == "offload":
        return _run_offloaded(fn, *args, **kwargs)
    if provider == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _check_pattern(pattern) -> None:
    if callable(pattern):
        return
    if isinstance(pattern, str):
        if pattern in ("none", "all"):
            return
        m = _FORM.match(pattern)
        if m and int(m.group(2)) >= 1:
            return
        raise ValueError(
            f"pattern must be one of {list(PATTERN_FORMS)} (N, K >= 1), a tuple of block indices or a "
            f"callable (index, block) -> bool, got {pattern!r}"
        )
    if isinstance(pattern, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in pattern):
        return
    raise TypeError(
        f"pattern must be a string, a sequence of block indices or a callable, got {type(pattern).__name__}"
    )


def _selected(pattern, blocks: Sequence[torch.nn.Module]) -> list[bool]:
    n = len(blocks)
    if callable(pattern):
        return [bool(pattern(i, b)) for i, b in enumerate(blocks)]
    if pattern == "none":
        return [False] * n
    if pattern == "all":
        return [True] * n
    if isinstance(pattern, str):
        form, k = _FORM.match(pattern).groups()
        k = int(k)
        rule = {
            "every": lambda i: i % k == 0,
            "skip-every": lambda i: i % k != 0,
            "first": lambda i: i < k,
            "last": lambda i: i >= n - k,
        }[form]
        if form in ("first", "last") and k > n:
            raise ValueError(f"pattern {pattern!r} names {k} blocks, but the model has {n}")
        return [rule(i) for i in range(n)]
    bad = [i for i in pattern if not 0 <= i < n]
    if bad:
        raise ValueError(f"pattern names blocks {bad} that do not exist: the model has {n} blocks (0..{n - 1})")
    chosen = set(pattern)
    return [i in chosen for i in range(n)]


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Recompute chosen blocks' activations in the backward instead of storing them.

    On a diffusers model it works through diffusers' own ``enable_gradient_checkpointing``, deciding per block,
    so the model runs the code path diffusers users run; on another module it wraps the chosen blocks'
    ``forward``. ``remove()`` restores each module's previous checkpointing flag and function, and every
    wrapped ``forward``.

    Example:
        >>> handle = memkit.Checkpointing(pattern="every:2").apply(model)
        >>> memkit.train_step(model, inputs)   # about half the blocks' activations, half the extra forward
        >>> handle.remove()
    """

    pattern: str | tuple[int, ...] | Callable[[int, torch.nn.Module], bool] = "all"
    """Which blocks: ``"all"``, ``"none"``, ``"every:N"`` (blocks 0, N, 2N, ...), ``"skip-every:N"`` (all but
    those), ``"first:K"``, ``"last:K"``, a tuple of block indices, or a callable ``(index, block) -> bool``."""
    provider: str = "torch"
    """How a chosen block is checkpointed: ``"torch"`` (recompute everything), ``"selective"`` (keep matmul,
    convolution and attention outputs, recompute the rest) or ``"offload"`` (as ``"torch"``, its kept inputs in
    CPU memory until the recompute; on the CPU the same as ``"torch"``)."""
    blocks: str | None = None
    """For a model that is not a diffusers model: the name of its ``nn.ModuleList`` of blocks (default: the
    longest)."""
    budget_bytes: int | None = None
    """A memory budget in bytes instead of a pattern (``pattern="auto"``): the fewest blocks, spread evenly,
    whose estimated peak fits it (:func:`memkit.plan_checkpointing`). ``estimate`` plans for its own step and
    sizes; ``apply(model)`` plans for a diffusers model's default inputs and dtype on its device (use
    :meth:`plan` or :func:`memkit.plan_checkpointing` to plan for other inputs)."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None:
            budget = self.budget_bytes
            if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
                raise ValueError(f"budget_bytes must be a positive int (bytes) or None, got {budget!r}")
            if self.pattern not in ("all", "auto"):  # "all" is the default: budget_bytes alone means "auto"
                raise ValueError(
                    f"give a pattern or budget_bytes, not both: pattern={self.pattern!r} with budget_bytes={budget}"
                )
            object.__setattr__(self, "pattern", "auto")
        elif self.pattern == "auto":
            raise ValueError("pattern='auto' needs budget_bytes=, the memory budget to fit (bytes)")
        if self.pattern == "auto":
            if self.provider not in PROVIDERS:
                raise ValueError(f"provider must be one of {list(PROVIDERS)}, got {self.provider!r}")
            return
        _check_pattern(self.pattern)
        if isinstance(self.pattern, list):
            object.__setattr__(self, "pattern", tuple(self.pattern))
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {list(PROVIDERS)}, got {self.provider!r}")
        if self.blocks is not None and not isinstance(self.blocks, str):
            raise TypeError(f"blocks must be the name of an nn.ModuleList or None, got {type(self.blocks).__name__}")

    def plan(self, model: torch.nn.Module, **kwargs: Any) -> CheckpointPlan:
        """The pattern ``budget_bytes`` chooses for ``model`` (a diffusers model: planned on a fake copy built
        from its config, so nothing is allocated). ``kwargs`` are :func:`memkit.plan_checkpointing`'s
        (``inputs``, ``step``, sizes...); by default the model's dtype, its device (``"cuda"`` or ``"cpu"``)
        and ``make_inputs``' default inputs.

        Example:
            >>> plan = memkit.Checkpointing(budget_bytes=16 * 2**30).plan(transformer, height=1024, width=1024)
            >>> plan.config.apply(transformer)
        """
        from ..planning import plan_checkpointing

        if self.budget_bytes is None:
            raise ValueError("plan() needs budget_bytes=, the memory budget to fit (bytes)")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not (callable(getattr(type(model), "from_config", None)) and hasattr(model, "config")):
            raise TypeError(
                f"budget_bytes plans on a fake copy built from a diffusers model's config; {type(model).__name__} "
                "has none: call memkit.plan_checkpointing(lambda: build_model(), budget_bytes, inputs=...) and "
                "apply its plan.config"
            )
        param = next(model.parameters(), None)
        defaults: dict[str, Any] = {}
        if param is not None:
            defaults = {"dtype": param.dtype, "device": "cuda" if param.device.type == "cuda" else "cpu"}
        cls, config = type(model), model.config
        return plan_checkpointing(
            lambda: cls.from_config(config), self.budget_bytes, provider=self.provider, **{**defaults, **kwargs}
        )

    def select(self, model: torch.nn.Module) -> list[tuple[str, bool]]:
        """Every block of ``model`` by name, and whether this pattern checkpoints it.

        Example:
            >>> memkit.Checkpointing(pattern="every:2").select(model)
            [('transformer_blocks.0', True), ('transformer_blocks.1', False), ...]
        """
        if self.pattern == "auto":
            return self.plan(model).config.select(model)
        blocks = self._blocks(model)
        return [
            (name, chosen)
            for (name, _), chosen in zip(blocks, _selected(self.pattern, [b for _, b in blocks]), strict=True)
        ]

    def _blocks(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        return find_blocks(model, name=self.blocks)

    def apply(self, model: torch.nn.Module) -> Handle:
        """Turn checkpointing on for the chosen blocks of ``model``; returns the handle that turns it off."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if self.pattern == "auto":
            plan = self.plan(model)
            if not plan.fits:
                warnings.warn(f"budget_bytes: {plan}; checkpointing every block, the least memory", stacklevel=2)
            return plan.config.apply(model)
        blocks = self._blocks(model)
        chosen = _selected(self.pattern, [b for _, b in blocks])
        if is_diffusers_model(model) and self.blocks is None:
            return self._apply_diffusers(model, {id(b) for (_, b), c in zip(blocks, chosen, strict=True) if c})
        return self._apply_wrapped([b for (_, b), c in zip(blocks, chosen, strict=True) if c])

    def _apply_diffusers(self, model: torch.nn.Module, chosen: set[int]) -> Handle:
        missing = object()
        saved = [
            (m, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", missing))
            for m in model.modules()
            if hasattr(m, "gradient_checkpointing")
        ]
        provider = self.provider

        def func(module, *args, **kwargs):
            if id(module) in chosen:
                return _run_checkpointed(provider, module.__call__, *args, **kwargs)
            return module(*args, **kwargs)

        model.enable_gradient_checkpointing(gradient_checkpointing_func=func)

        def undo() -> None:
            for m, flag, old in saved:
                m.gradient_checkpointing = flag
                if old is missing:
                    del m._gradient_checkpointing_func
                else:
                    m._gradient_checkpointing_func = old

        return Handle(undo, name=str(self))

    def _apply_wrapped(self, blocks: list[torch.nn.Module]) -> Handle:
        provider = self.provider
        previous = []
        for block in blocks:
            had = "forward" in vars(block)
            original = block.forward

            def forward(*args, _original=original, **kwargs):
                if torch.is_grad_enabled():
                    return _run_checkpointed(provider, _original, *args, **kwargs)
                return _original(*args, **kwargs)

            previous.append((block, had, vars(block).get("forward")))
            block.forward = forward

        def undo() -> None:
            for block, had, old in reversed(previous):
                if had:
                    block.forward = old
                else:
                    del block.forward

        return Handle(undo, name=str(self))

    @classmethod
    def parse(cls, value: str) -> Checkpointing:
        """The config a command-line or widget value names: ``PATTERN[@PROVIDER]``, e.g. ``"every:2"``,
        ``"all@selective"``.

        Example:
            >>> memkit.Checkpointing.parse("every:2@selective")
            Checkpointing(pattern='every:2', provider='selective', blocks=None)
        """
        if not isinstance(value, str):
            raise TypeError(f"value must be a string such as 'every:2' or 'all@selective', got {type(value).__name__}")
        pattern, _, provider = value.partition("@")
        return cls(pattern=pattern, provider=provider or "torch")

    def __str__(self) -> str:
        if self.pattern == "auto":
            from ..units import format_bytes

            pattern = f"auto<={format_bytes(self.budget_bytes)}".replace(" ", "")
        elif isinstance(self.pattern, str):
            pattern = self.pattern
        elif callable(self.pattern):
            pattern = getattr(self.pattern, "__name__", "custom")
        else:
            pattern = ",".join(map(str, self.pattern))
        return f"checkpointing:{pattern}" + ("" if self.provider == "torch" else f"@{self.provider}")
