"""The protocol every optimization follows: a config object whose ``apply(model)`` returns a `Handle`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch


class Handle:
    """Undoes one applied optimization. ``remove()`` restores the model exactly (same module tree,
    ``state_dict`` and outputs, bit for bit); calling it twice is harmless. A handle is also a context
    manager that removes itself on exit.

    Example:
        >>> with memkit.Checkpointing("all").apply(model):
        ...     memkit.train_step(model, inputs)   # checkpointed
        >>> memkit.train_step(model, inputs)       # as before
    """

    def __init__(self, undo: Callable[[], None], *, name: str = "optimization"):
        self._undo: Callable[[], None] | None = undo
        self.name = name

    @property
    def active(self) -> bool:
        """True until ``remove()`` has run."""
        return self._undo is not None

    def remove(self) -> None:
        """Restore the model as it was before ``apply``."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Handle({self.name!r}, active={self.active})"


@runtime_checkable
class Optimization(Protocol):
    """Anything with ``apply(model) -> Handle``: what ``compare``, ``estimate``, widgets and the CLI take.

    Example:
        >>> class Freeze:                  # a user-defined optimization
        ...     def apply(self, model):
        ...         model.requires_grad_(False); return memkit.Handle(lambda: model.requires_grad_(True))
    """

    def apply(self, model: torch.nn.Module) -> Handle: ...


def apply_all(model: torch.nn.Module, optimizations) -> Handle:
    """Apply ``optimizations`` in order and return one handle that removes them in reverse order.

    If one fails to apply, the ones already applied are removed before the error propagates, so the model
    is never left half-changed.
    """
    optimizations = list(optimizations)
    for i, opt in enumerate(optimizations):
        if not isinstance(opt, Optimization):
            raise TypeError(
                f"optimizations[{i}] must have an .apply(model) method (e.g. memkit.Checkpointing('all')), "
                f"got {type(opt).__name__}"
            )
    handles: list[Handle] = []
    try:
        for opt in optimizations:
            handles.append(opt.apply(model))
    except BaseException:
        for h in reversed(handles):
            h.remove()
        raise

    def undo() -> None:
        for h in reversed(handles):
            h.remove()

    return Handle(undo, name=" + ".join(h.name for h in handles) or "none")
