"""Side by side: :class:`memkit.Offload` and diffusers' ``apply_group_offloading`` (in memory, and to disk) on the
same model, each measured against the model without offloading.

Three differences per variant: the inference output, the gradients of one training step, and ``state_dict()``
read while the weights are offloaded; plus the case diffusers' disk path gets wrong across models: a second
model offloaded to the same folder as a first. A row passes when all three are within ``tolerance``.

Example:
    >>> rows = diffusers_check("flux")
    >>> print(table(rows))
"""

from __future__ import annotations

import copy
import math
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["VARIANTS", "CheckRow", "diffusers_available", "diffusers_check", "table"]

VARIANTS = ("memkit-disk", "memkit-disk-reused", "diffusers-memory", "diffusers-disk", "diffusers-disk-reused")
"""What :func:`diffusers_check` runs by default (diffusers' rows need ``accelerate`` installed)."""


def diffusers_available() -> bool:
    """Whether diffusers' group offloading can run here (it needs ``accelerate``).

    Example:
        >>> variants = VARIANTS if diffusers_available() else ("memkit-disk", "memkit-disk-reused")
    """
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


@dataclass(frozen=True)
class CheckRow:
    """One variant's largest absolute differences against the model without offloading."""

    variant: str
    d_output: float
    """Inference output."""
    d_grad: float
    """Gradients after one forward and backward (training)."""
    d_state_dict: float
    """``state_dict()`` values, read after a forward (the weights offloaded)."""
    tolerance: float

    @property
    def passed(self) -> bool:
        return all(d <= self.tolerance for d in (self.d_output, self.d_grad, self.d_state_dict))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k, v in a.items():
        w = b.get(k)
        if w is None or w.shape != v.shape:
            return math.inf
        worst = max(worst, (v.float() - w.float()).abs().max().item() if v.numel() else 0.0)
    return worst


def _measure(model: nn.Module, inputs: dict, reference: dict) -> tuple[float, float, float]:
    from ..step import model_output

    with torch.no_grad():
        out = model_output(model(**inputs))
    d_output = (out - reference["output"]).abs().max().item()
    model.zero_grad(set_to_none=True)
    model_output(model(**inputs)).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    d_grad = _max_diff(reference["grads"], grads)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model(**inputs)  # leave it offloaded
    d_state = _max_diff(reference["state"], model.state_dict())
    return d_output, d_grad, d_state


def _reference(model: nn.Module, inputs: dict) -> dict:
    from ..step import model_output

    with torch.no_grad():
        output = model_output(model(**inputs)).clone()
    model_output(model(**inputs)).float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"output": output, "grads": grads, "state": state}


# the oldest diffusers whose group offloading this check was run against (0.40 fails inside diffusers' disk offload)
_DIFFUSERS_CHECKED = (0, 41)


def _release(version: str) -> tuple[int, ...]:
    """``"0.41.0.dev0"`` -> ``(0, 41)``: the major and minor numbers of a version string."""
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def diffusers_check(
    model: str | Callable[[], nn.Module] = "flux",
    *,
    tolerance: float = 1e-6,
    seed: int = 0,
    variants: Sequence[str] = VARIANTS,
) -> list[CheckRow]:
    """Run memkit's disk offload and diffusers' group offloading on copies of one model; one row each.

    ``model``: a preset name (tiny) or a callable returning a model (called twice: the reused-folder row needs a
    second, differently seeded model, so a callable should build fresh random weights each call). Variants:
    ``"memkit-disk"``, ``"memkit-disk-reused"`` (memkit given one folder for two models), ``"diffusers-memory"``
    (``apply_group_offloading`` to CPU memory), ``"diffusers-disk"`` (``offload_to_disk_path``),
    ``"diffusers-disk-reused"`` (a second model offloaded to the first one's folder).

    Example:
        >>> [r.variant for r in diffusers_check("flux") if not r.passed]
    """
    from ..models import load_model, make_inputs
    from .offload import Offload

    def build(s: int) -> nn.Module:
        if isinstance(model, str):
            return load_model(model, seed=s)
        torch.manual_seed(s)
        return model()

    if any(v.startswith("diffusers") for v in variants):
        if not diffusers_available():
            raise ImportError("diffusers' group offloading needs accelerate: pip install accelerate")
        import diffusers

        if _release(diffusers.__version__) < _DIFFUSERS_CHECKED:
            raise RuntimeError(
                f"diffusers_check compares with diffusers' group offloading as diffusers >= 0.41 does it (disk "
                f"offload in training fails earlier, before the rows it checks); this is diffusers "
                f"{diffusers.__version__}: pip install 'diffusers>=0.41', or pass variants=('memkit-disk', "
                "'memkit-disk-reused')"
            )
        from diffusers.hooks import apply_group_offloading
    base = build(seed)
    inputs = make_inputs(base, seed=seed)
    reference = _reference(base, inputs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="memkit-offload-check-") as folder:
        for name in variants:
            m = copy.deepcopy(base)
            ref = reference
            handle = None
            if name == "memkit-disk":
                handle = Offload(to="disk", path=folder).apply(m)
            elif name == "memkit-disk-reused":
                first = build(seed + 1)
                first_handle = Offload(to="disk", path=folder).apply(first)
                handle = Offload(to="disk", path=folder).apply(m)
            elif name == "diffusers-memory":
                apply_group_offloading(m, onload_device="cpu", offload_type="block_level", num_blocks_per_group=1)
            elif name in ("diffusers-disk", "diffusers-disk-reused"):
                sub = f"{folder}/{name}"
                if name == "diffusers-disk-reused":
                    first = build(seed + 1)
                    apply_group_offloading(
                        first, onload_device="cpu", offload_type="block_level", num_blocks_per_group=1,
                        offload_to_disk_path=sub,
                    )  # fmt: skip
                    with torch.no_grad():
                        first(**inputs)
                apply_group_offloading(
                    m, onload_device="cpu", offload_type="block_level", num_blocks_per_group=1,
                    offload_to_disk_path=sub,
                )  # fmt: skip
            else:
                raise ValueError(
                    "variants must name 'memkit-disk', 'memkit-disk-reused', 'diffusers-memory', 'diffusers-disk' "
                    f"or 'diffusers-disk-reused', got {name!r}"
                )
            rows.append(CheckRow(name, *_measure(m, inputs, ref), tolerance))
            if handle is not None:
                handle.remove()
            if name == "memkit-disk-reused":
                first_handle.remove()
    return rows


def table(rows: Sequence[CheckRow]) -> str:
    """The rows as a fixed-width text table.

    Example:
        >>> print(table(diffusers_check("flux")))
    """
    lines = [f"{'variant':<24} {'d_output':>10} {'d_grad':>10} {'d_state_dict':>12}  result"]
    for r in rows:
        lines.append(
            f"{r.variant:<24} {r.d_output:>10.3g} {r.d_grad:>10.3g} {r.d_state_dict:>12.3g}  "
            + ("pass" if r.passed else "FAIL")
        )
    return "\n".join(lines)
