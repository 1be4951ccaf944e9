"""The optimizer step fused into the backward, for :class:`memkit.Step` (``fused_backward=True``).

What OneTrainer and SimpleTuner call a fused back pass, and torch's tutorial "How to save memory by fusing the
optimizer step into the backward pass": each parameter's update runs in its ``register_post_accumulate_grad_hook``,
as soon as autograd has accumulated its gradient, and the gradient is freed at once. No full set of gradients ever
lives: at most the gradients autograd is still accumulating, and one parameter's update temporaries.

One optimizer for all parameters (its state in one ``optimizer.state``, as memkit tracks it), its ``step`` run on a
view of the parameter's group that holds only that parameter; what the step writes into the group (Prodigy's ``d``)
is written back. Optimizers whose update reads every parameter of a group at once (Prodigy's ``d`` estimate,
Adafactor's nothing, bitsandbytes' nothing) then see one parameter per step: the memory is the same, the values of
Prodigy's step size differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .memory.recording import tag


def _step_one(optimizer: torch.optim.Optimizer, param: torch.Tensor, index: int) -> None:
    groups = optimizer.param_groups
    group = groups[index]
    view = {**group, "params": [param]}
    optimizer.param_groups = [view]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups
        group.update({k: v for k, v in view.items() if k != "params"})


def fuse(optimizer: torch.optim.Optimizer, observers: list[Callable[[torch.Tensor], None]] | None = None) -> list[Any]:
    """Hook each parameter of ``optimizer`` to be updated, and its gradient freed, as soon as the backward has
    accumulated it; returns the hooks' handles (``handle.remove()`` undoes each).

    ``observers``, a list the caller may fill and empty later, are called with each parameter, its gradient
    accumulated and not yet used: the only moment a fused backward's gradient can be seen (``compare`` records it)."""
    handles = []
    observers = [] if observers is None else observers
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:

            def hook(p: torch.Tensor, index: int = index) -> None:
                tag([p.grad], "gradient")  # before it is freed: the trackers' own grad hooks run after this one
                for observe in observers:
                    observe(p)
                _step_one(optimizer, p, index)
                p.grad = None

            handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles
