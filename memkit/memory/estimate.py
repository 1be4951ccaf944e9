"""Estimate a step's memory without allocating it: the same tracker, run on fake tensors.

Under ``FakeTensorMode`` every op computes only shapes, dtypes and strides, so a 12B-parameter model's
training step runs in seconds and a few hundred MiB of RAM while the tracker adds up the storages it would
have allocated. Fake CPU tensors are used (not the meta device: meta picks the math attention path and
overestimates; not fake "cuda": that crashes on a CPU build).

What an estimate for ``device="cuda"`` models: the caching allocator's rounding (every block a multiple of
512 bytes), so the peak compares with ``torch.cuda.max_memory_allocated``. What it does not model: the
CUDA context (~300–500 MiB per process, outside the allocator), cuBLAS/cuDNN workspaces, kernel choices
that differ between CPU and CUDA (attention backends), and fragmentation (reserved > allocated).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from tqdm.auto import tqdm

from .timeline import Timeline
from .tracker import track

_OPTIMIZERS = ("adamw", "adam", "sgd")
_CUDA_BLOCK = 512


def make_optimizer(name: str | None, params, *, foreach: bool | None = None) -> torch.optim.Optimizer | None:
    """Build an optimizer by name (``"adamw"``, ``"adam"``, ``"sgd"``) or return None for ``None``."""
    if name is None:
        return None
    params = [p for p in params if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    raise ValueError(f"optimizer must be one of {list(_OPTIMIZERS)} or None, got {name!r}")


def estimate(
    model: str | Callable[[], torch.nn.Module],
    inputs: Callable[[torch.nn.Module], Mapping[str, Any]] | None = None,
    *,
    mode: str = "training",
    optimizations: Sequence[Any] = (),
    dtype: torch.dtype = torch.float32,
    size: str = "full",
    optimizer: str | None = None,
    steps: int = 1,
    batch_size: int = 1,
    device: str = "cpu",
    seed: int = 0,
    progress: bool | None = None,
    **sizes: int,
) -> Timeline:
    """Estimate the memory timeline of one step without allocating real memory (fake tensors).

    Args:
        model: a preset name (built at ``size``, default the released ``"full"`` config) or a callable
            returning a model; it is called inside fake mode, so it must build on CPU and set its dtype by
            construction (``torch.set_default_dtype`` is set to ``dtype`` around the call), never ``.to()``.
        inputs: a callable ``inputs(model)`` returning the forward kwargs, or None for
            ``memkit.make_inputs(model, batch_size, **sizes)``.
        mode: ``"training"`` (forward, loss, backward, optimizer step if any) or ``"inference"``.
        optimizations: optimization objects, applied with ``.apply(model)`` as in a real run.
        dtype: parameter and input dtype.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or None (training only). With None, gradients accumulate
            across steps as in a loop of ``loss.backward()``.
        steps: run this many steps and measure the last, so state that lives across steps (optimizer state,
            accumulated gradients) is counted.
        device: the device being estimated: ``"cpu"`` or ``"cuda"`` (adds the CUDA allocator's 512-byte
            rounding, drops CPU-only kernel buffers, and uses foreach optimizers as torch does on CUDA).
        progress: show a progress bar (build, then each step); None shows it for full-size presets, which
            take ~10–30 s.

    Returns the :class:`Timeline` of the last step; ``timeline.meta`` holds the settings, the parameter count
    and the seconds the estimate took.

    Example:
        >>> tl = memkit.estimate("flux", dtype=torch.bfloat16, optimizations=[memkit.Checkpointing()])
        >>> tl.peak_bytes / 2**30   # GiB
    """
    from ..handle import apply_all
    from ..models import PRESETS, _default_dtype, load_model, make_inputs, train_step

    if mode not in ("training", "inference"):
        raise ValueError(f"mode must be 'training' or 'inference', got {mode!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if optimizer is not None and mode == "inference":
        raise ValueError("optimizer is only used in training; pass optimizer=None with mode='inference'")
    if optimizer is not None and optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(_OPTIMIZERS)} or None, got {optimizer!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"model must be a callable or one of the presets {sorted(PRESETS)}, got {model!r}")
        name = model

        def model_fn():
            return load_model(name, size, dtype=dtype, seed=seed)
    elif callable(model):
        model_fn = model
    else:
        raise TypeError(f"model must be a preset name or a callable returning a model, got {type(model).__name__}")
    if inputs is not None and not callable(inputs):
        raise TypeError("inputs must be a callable inputs(model) -> forward kwargs, or None")

    t0 = time.perf_counter()
    cuda = device == "cuda"
    if progress is None:
        progress = isinstance(model, str) and size == "full"
    label = model if isinstance(model, str) else "model"
    bar = tqdm(total=steps + 1, desc=f"estimate {label}", unit="stage", disable=not progress, leave=False)
    with bar, FakeTensorMode(), _default_dtype(dtype):
        bar.set_postfix_str("building the model")
        net = model_fn()
        if not isinstance(net, torch.nn.Module):
            raise TypeError(f"model() must return a torch.nn.Module, got {type(net).__name__}")
        handle = apply_all(net, optimizations)
        try:
            kwargs = inputs(net) if inputs is not None else make_inputs(net, batch_size, seed=seed, **sizes)
            opt = make_optimizer(optimizer, net.parameters(), foreach=cuda) if mode == "training" else None

            def step():
                if mode == "training":
                    train_step(net, kwargs, opt)
                else:
                    with torch.no_grad():
                        net(**kwargs)

            bar.update()
            for i in range(steps - 1):
                bar.set_postfix_str(f"step {i + 1}/{steps}")
                step()
                bar.update()
            bar.set_postfix_str(f"step {steps}/{steps} (tracked)")
            with track(
                net,
                optimizer=opt,
                inputs=kwargs,
                alloc_granularity=_CUDA_BLOCK if cuda else None,
                device="cuda" if cuda else None,
            ) as timeline:
                step()
            bar.update()
        finally:
            handle.remove()
        params = sum(p.numel() for p in net.parameters())
    timeline.meta.update(
        estimate=True,
        model=model if isinstance(model, str) else getattr(model, "__name__", "model"),
        size=size if isinstance(model, str) else None,
        mode=mode,
        dtype=str(dtype).replace("torch.", ""),
        optimizer=optimizer,
        steps=steps,
        device=device,
        optimizations=[str(o) for o in optimizations],
        parameters=params,
        seconds=time.perf_counter() - t0,
    )
    return timeline
