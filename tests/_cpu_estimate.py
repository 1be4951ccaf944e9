"""``memkit.estimate`` with the settings of a real CPU step in these tests: fp32, on the CPU, no optimizer, the
first step alone, wherever a test gives none of its own.

The tests that hold an estimate against a real CPU run (tracked by the same tracker) need the estimate to be of
that very step. The library's defaults are those of the question users ask (a bf16 AdamW step on a GPU, first and
steady step); these tests ask another one, so they say which.
"""

from __future__ import annotations

import torch

import memkit

CPU_STEP = {"device": "cpu", "dtype": torch.float32}


def estimate_cpu(*args, **kwargs):
    """``memkit.estimate(*args, **kwargs)`` with fp32, ``device="cpu"``, ``optimizer=None`` and (in training)
    ``steps=1`` where not given."""
    for k, v in CPU_STEP.items():
        kwargs.setdefault(k, v)
    if "step" not in kwargs:
        kwargs.setdefault("optimizer", None)
        if kwargs.get("mode", "training") == "training":
            kwargs.setdefault("steps", 1)
    return memkit.estimate(*args, **kwargs)
