"""Real CPU training steps tracked one by one: what an estimate's first and steady step are held against.

Example:
    >>> first, steady = real_steps(2, grad_accum=2)        # steps 1 and 2 of a real loop, each its own window
    >>> memkit.estimate(Wide, wide_inputs, device="cpu", dtype=torch.float32, grad_accum=2)
"""

from __future__ import annotations

import torch

import memkit


class Wide(torch.nn.Module):
    """Activations (batch 512 > width 256: twice the weights) alive at the start of each backward beside AdamW's state
    (2x the weights), which the steady step carries and the first does not: the steady step's peak (weights, state,
    activations: 5x the weights) is above the first step's (its update: weights, gradients, state, 4x); a second
    micro-batch's backward also has the first one's gradients (1x the weights) beside it."""

    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x):
        return self.layers(torch.relu(x))


def wide_inputs(model) -> dict[str, torch.Tensor]:
    """The batch :class:`Wide` is measured on."""
    return {"x": torch.ones(512, 256)}


def tracked_steps(runner, inputs, n: int) -> list[memkit.Timeline]:
    """Steps 1..n of ``runner`` on ``inputs``, each tracked in a window of its own."""
    out = []
    for _ in range(n):
        with memkit.track(inputs=inputs, **runner.tracked_objects()) as tl:
            runner.run(inputs)
        out.append(tl)
    return out


def real_steps(n: int, model_fn=Wide, inputs_fn=wide_inputs, **step) -> list[memkit.Timeline]:
    """Steps 1..n of a real CPU training loop of ``memkit.Step(**step)`` (AdamW unless ``optimizer`` is given) on
    ``model_fn()``, each tracked in a window of its own."""
    step.setdefault("optimizer", "adamw")
    torch.manual_seed(0)
    model = model_fn()
    x = inputs_fn(model)
    return tracked_steps(memkit.Step(steps=1, **step).bind(model), x, n)
