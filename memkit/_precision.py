"""Mixed precision for :class:`memkit.Step`: fp32 master weights, the forward under ``torch.autocast``, fp16's
gradient scaler.

What "mixed precision bf16" means in accelerate and the diffusers scripts: the weights and the optimizer state in
fp32, the forward's matmuls and convolutions in bf16 (or fp16) through autocast, the loss and the backward outside
it. Autocast casts each fp32 weight to a bf16 copy the first time an op needs it and keeps that copy in its cast
cache until the outermost autocast exits (the end of the forward): a weight used twice is cast once, and the copies
the backward needs stay alive as activations until its backward. fp16 adds ``torch.amp.GradScaler``: the loss is
multiplied by a scale before the backward, the gradients unscaled (in place) before the update, which is skipped
when one is not finite; its state is two 0-dim fp32 tensors (the scale, the growth tracker).

The op lists are the CPU's in an estimate: estimates run on fake CPU tensors, and autocast with
``device_type="cuda"`` on CPU tensors does nothing (torch warns that CUDA is unavailable and disables it; checked on
torch 2.13). Both lists run ``linear``, ``matmul``, ``mm``, ``bmm``, ``baddbmm``, ``addmm`` and the convolutions in
the low dtype, so the weights' cast copies and the matmuls' outputs are the same; they differ where CUDA's list
(torch's AMP docs, "CUDA Ops that can autocast to float32") runs an op in fp32 and the CPU's leaves it in its
input's dtype: ``layer_norm``, ``group_norm``, ``softmax``, ``log_softmax``, ``pow``, ``rsqrt``, ``exp``, ``cumsum``,
``sum``-like reductions (``prod``, ``norm``) among them (checked on torch 2.13's CPU autocast: each returns bf16 for a
bf16 input). On a GPU those ops' outputs are fp32, twice the bytes: an estimate for ``"cuda"`` under mixed precision
counts them at bf16 and may be below a real GPU run by those outputs (the norms' outputs saved for backward above
all). ``scaled_dot_product_attention`` is on the CPU's low-precision list and on neither CUDA list (its inputs come
from bf16 matmuls there anyway).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

MIXED_PRECISION = ("bf16", "fp16")
MixedPrecision = Literal["bf16", "fp16"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(name: str) -> torch.dtype:
    """The dtype autocast computes in for ``mixed_precision=name``."""
    return _DTYPES[name]


def check_master_weights(model: torch.nn.Module, name: str) -> None:
    """Mixed precision keeps fp32 master weights: a ValueError naming ``mixed_precision`` when a trainable
    parameter is not fp32 (frozen ones may be anything, as the LoRA scripts cast the base to bf16)."""
    bad = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad} - {"float32"})
    if bad:
        raise ValueError(
            f"mixed_precision={name!r} keeps the trained weights in float32 (autocast computes in "
            f"{str(_DTYPES[name]).replace('torch.', '')}); this model's trainable parameters are {bad}: build it in "
            "float32 (dtype=torch.float32), train fp32 adapters on a frozen low-precision base "
            "(memkit.LoRA(dtype=torch.float32)), or use mixed_precision=None for pure low-precision weights"
        )


class Scaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose step also runs on fake tensors: whether a gradient was not finite is a value
    (``.item()``), which fake tensors do not have; an estimate measures the step that updates (the one that matters:
    an overflow step skips the update and allocates less)."""

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any):
        from torch._subclasses.fake_tensor import FakeTensor

        if any(isinstance(v, FakeTensor) for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    def state_tensors(self) -> list[torch.Tensor]:
        """The scaler's state that lives across steps (empty before its first ``scale``)."""
        return [t for t in (self._scale, self._growth_tracker) if t is not None]
