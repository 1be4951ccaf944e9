"""Gradient (activation) checkpointing as a memkit optimization.

Checkpointing a block keeps only its inputs during the forward and recomputes its activations during the
backward: activation memory drops to about one block's worth, at the cost of a second forward through the
checkpointed blocks (~20–35% more step time for "all"; diffusers PR #10611's LTX-Video table: 26.7 GB →
9.3 GB at 1.68 → 1.36 it/s). It does nothing in inference (no backward, nothing kept), and nothing on a
model whose blocks diffusers cannot checkpoint (that raises instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from ..handle import Handle

_PATTERNS = ("all",)


def _checkpoint(module: torch.nn.Module, *args):
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Recompute transformer blocks' activations in the backward instead of storing them.

    Wraps diffusers' own ``enable_gradient_checkpointing`` (non-reentrant ``torch.utils.checkpoint``), so
    the model runs exactly the code path diffusers users run. ``remove()`` restores each module's previous
    checkpointing flag and function.

    Example:
        >>> handle = memkit.Checkpointing(pattern="all").apply(model)
        >>> memkit.train_step(model, inputs)   # lower activation peak, one extra forward per block
        >>> handle.remove()
    """

    pattern: str = "all"
    """Which blocks to checkpoint. ``"all"``: every block diffusers can checkpoint."""

    def __post_init__(self) -> None:
        if self.pattern not in _PATTERNS:
            raise ValueError(f"pattern must be one of {list(_PATTERNS)}, got {self.pattern!r}")

    def apply(self, model: torch.nn.Module) -> Handle:
        """Turn checkpointing on for ``model``; returns the handle that turns it back off."""
        if not getattr(model, "_supports_gradient_checkpointing", False):
            raise ValueError(
                f"model ({type(model).__name__}) does not support gradient checkpointing: it must be a diffusers "
                "model with `_supports_gradient_checkpointing = True`"
            )
        missing = object()
        saved = [
            (m, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", missing))
            for m in model.modules()
            if hasattr(m, "gradient_checkpointing")
        ]
        model.enable_gradient_checkpointing(gradient_checkpointing_func=_checkpoint)

        def undo() -> None:
            for m, flag, func in saved:
                m.gradient_checkpointing = flag
                if func is missing:
                    del m._gradient_checkpointing_func
                else:
                    m._gradient_checkpointing_func = func

        return Handle(undo, name=str(self))

    @classmethod
    def parse(cls, value: str) -> Checkpointing:
        """The config a command-line or widget value names: ``"all"``.

        Example:
            >>> memkit.Checkpointing.parse("all")
            Checkpointing(pattern='all')
        """
        return cls(pattern=value)

    def __str__(self) -> str:
        return f"checkpointing:{self.pattern}"
