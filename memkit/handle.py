"""The protocol every optimization follows: a config object whose ``apply(model)`` returns a `Handle`.

A handle undoes what ``apply`` did, declares the memory the optimization owns (EMA shadows, offloaded weights,
pinned staging), so ``track``, ``compare`` and ``estimate`` count it in the right category even when it was
allocated before tracking began, and carries the work the optimization does once per step (an EMA update, an
offload write-back), which :class:`memkit.Step` runs after each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch

from .memory.events import check_category

OwnedTensors = Mapping[str, Iterable[torch.Tensor]]


class Handle:
    """Undoes one applied optimization. ``remove()`` restores the model exactly (same module tree,
    ``state_dict`` and outputs, bit for bit); calling it twice is harmless. A handle is also a context
    manager that removes itself on exit.

    Args:
        undo: restores the model; called once, by the first ``remove()``.
        name: how tables and reprs name the optimization, e.g. ``"checkpointing:all"``.
        owned: the memory the optimization owns, category -> tensors (e.g. ``{"ema": shadows}``), or a
            callable returning that mapping (asked each time: the tensors may change, e.g. after an offload).
        after_step: work to do once after each step (called by :class:`memkit.Step`'s runner).

    Example:
        >>> with memkit.Checkpointing().apply(model):
        ...     memkit.train_step(model, inputs)   # checkpointed
        >>> memkit.train_step(model, inputs)       # as before
        >>> h = memkit.Handle(lambda: None, name="ema", owned={"ema": shadows}, after_step=update)
    """

    def __init__(
        self,
        undo: Callable[[], None],
        *,
        name: str = "optimization",
        owned: OwnedTensors | Callable[[], OwnedTensors] | None = None,
        after_step: Callable[[], None] | None = None,
    ):
        if not callable(undo):
            raise TypeError(f"undo must be callable, got {type(undo).__name__}")
        if after_step is not None and not callable(after_step):
            raise TypeError(f"after_step must be callable or None, got {type(after_step).__name__}")
        if owned is not None and not callable(owned):
            _check_owned(owned)
        self._undo: Callable[[], None] | None = undo
        self._owned = owned
        self._after_step = after_step
        self.name = name

    @property
    def active(self) -> bool:
        """True until ``remove()`` has run."""
        return self._undo is not None

    def owned(self) -> dict[str, list[torch.Tensor]]:
        """The memory this optimization owns, category -> tensors (empty once removed).

        Example:
            >>> handle.owned()   # {"ema": [shadow tensors]}
        """
        if not self.active or self._owned is None:
            return {}
        owned = self._owned() if callable(self._owned) else self._owned
        _check_owned(owned)
        return {category: list(tensors) for category, tensors in owned.items()}

    def after_step(self) -> None:
        """Do the optimization's once-per-step work (nothing for most; nothing once removed)."""
        if self.active and self._after_step is not None:
            self._after_step()

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


def _check_owned(owned: object) -> None:
    if not isinstance(owned, Mapping):
        raise TypeError(f"owned must map a category to tensors, e.g. {{'ema': shadows}}, got {type(owned).__name__}")
    for category in owned:
        check_category(category)


@runtime_checkable
class Optimization(Protocol):
    """Anything with ``apply(model) -> Handle``: what ``compare``, ``estimate``, widgets and the CLI take.

    Example:
        >>> class Freeze:                  # a user-defined optimization
        ...     def apply(self, model):
        ...         model.requires_grad_(False); return memkit.Handle(lambda: model.requires_grad_(True))
    """

    def apply(self, model: torch.nn.Module) -> Handle: ...


def apply_all(model: torch.nn.Module, optimizations: Iterable[Optimization]) -> Handle:
    """Apply ``optimizations`` in order and return one handle that removes them in reverse order, owns what
    they own, and runs their per-step work in order.

    If one fails to apply, the ones already applied are removed (in reverse order) before the error
    propagates, so the model is never left half-changed.

    Example:
        >>> with apply_all(model, [memkit.Checkpointing()]) as handle:
        ...     memkit.Step().bind(model, handle).run(inputs)
    """
    optimizations = list(optimizations)
    for i, opt in enumerate(optimizations):
        if not isinstance(opt, Optimization):
            raise TypeError(
                f"optimizations[{i}] must have an .apply(model) method (e.g. memkit.Checkpointing()), "
                f"got {type(opt).__name__}"
            )
    handles: list[Handle] = []
    try:
        for i, opt in enumerate(optimizations):
            handle = opt.apply(model)
            if not isinstance(handle, Handle):
                raise TypeError(
                    f"optimizations[{i}].apply(model) must return a memkit.Handle, got {type(handle).__name__}"
                )
            handles.append(handle)
    except BaseException:
        for h in reversed(handles):
            h.remove()
        raise

    def undo() -> None:
        for h in reversed(handles):
            h.remove()

    def owned() -> dict[str, list[torch.Tensor]]:
        merged: dict[str, list[torch.Tensor]] = {}
        for h in handles:
            for category, tensors in h.owned().items():
                merged.setdefault(category, []).extend(tensors)
        return merged

    def after_step() -> None:
        for h in handles:
            h.after_step()

    handle = Handle(undo, name=" + ".join(h.name for h in handles) or "none", owned=owned, after_step=after_step)
    handle.parts = tuple(handles)  # each optimization's own handle (an EMA's holds its averager: ``part.ema``)
    return handle
