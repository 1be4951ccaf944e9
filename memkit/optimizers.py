"""The optimizers a :class:`memkit.Step` can run, by name, each the real library's class.

State each keeps after its first step (bytes per parameter element; ``b`` is the parameter's element size, a
``r x c`` matrix has ``r + c`` factor elements; each one's state is counted from its real ``optimizer.state``):

- ``adamw``, ``adam`` (torch): ``2b`` (two moments in the parameter's dtype) and a 4-byte step per parameter.
- ``sgd`` (torch, momentum 0.9): ``b`` (the momentum buffer).
- ``adamw8bit`` (bitsandbytes ``AdamW8bit``): 2 bytes (uint8 moments) plus two fp32 absmax per 256-element block
  (bitsandbytes 0.50's blocksize), and two 256-entry fp32 quantization maps shared by all parameters; parameters
  under 4,096 elements keep two fp32 moments (8 bytes).
- ``paged-adamw8bit`` (bitsandbytes ``PagedAdamW8bit``): the same state. On a GPU, the moments of parameters of
  100,000 elements or more are CUDA managed memory (``cudaMallocManaged``), outside torch's caching allocator:
  they live in host memory until a step touches them and are paged back out under pressure, so they are not in
  ``torch.cuda.max_memory_allocated`` and an estimate for ``"cuda"`` reports them in
  ``timeline.meta["host_bytes"]["optimizer_state"]``. On a CPU there is no paging (bitsandbytes warns once and
  falls back; memkit silences that warning): the same bytes, in the same memory.
- ``adafactor`` (torch ``Adafactor``): row and column factors in the parameter's dtype, ``b (r + c)`` bytes per
  matrix (~0.01x the matrix), a full variance (``b``) for vectors, and a 4-byte step per parameter.
- ``prodigy`` (prodigyopt ``Prodigy``): ``4b``: the two moments, ``s`` and the initial weights ``p0``.
- ``came`` (came-pytorch ``CAME``): a full fp32 first moment (4 bytes, whatever the parameter's dtype) plus fp32
  row and column factors of the second moment and of the instability, ``8 (r + c)`` bytes per matrix; vectors
  keep a full fp32 second moment too; a 0-dim RMS per parameter.
- ``lion`` (bitsandbytes ``Lion``, 32-bit; torch has none): 4 bytes (one fp32 momentum).

The update's temporaries are whatever the step allocates, measured by the tracker like any other op's outputs
(``tests/test_optimizers.py`` holds them against the CPU allocator's own count, from ``torch.profiler``). Where a
library's step hides them or cannot run on fake tensors, memkit adapts how it is run, never what it computes
(``_optimizer_adapters.py``, only while a tracker is active):

- bitsandbytes runs its update as one opaque op (``torch.ops.bitsandbytes.optimizer_update_*``): on CUDA a fused
  kernel that updates in place and allocates nothing; on the CPU a Python kernel that dequantizes the moments to
  fp32, updates and requantizes them. A dispatch mode sees an op's outputs, not what its kernel allocates inside,
  so memkit calls that same Python kernel in the op's place and the tracker sees each of its buffers (the
  parameters come out bit for bit the same). An estimate for ``"cuda"`` leaves the op whole: bitsandbytes' own
  fake kernel, which allocates nothing, as the CUDA kernel does.
- Fake tensors have no values: bitsandbytes' quantization maps (built from Python lists) are built for real and
  handed to fake mode; ``.item()`` of a fake tensor (Prodigy's and Adafactor's statistics, Prodigy's ``p.any()``)
  answers 1 (True). Values steer no allocation there except ``p.any()``: Prodigy keeps a 0-dim ``p0`` for an
  all-zero parameter, which a trained model has none of (nor memkit's presets: ``load_model`` fills them).

Where the optimizer runs (``Step(optimizer_on="cpu")``, ``make_optimizer(..., on="cpu")``): torchao's own
``CPUOffloadOptimizer`` wraps any of the names above. For each trainable parameter of 4,096 elements or more it makes
a pinned host copy and a host gradient buffer (each the parameter's bytes) and one optimizer of that name over the
copy, which keeps its state and steps in CPU memory; the smaller parameters share one optimizer on the device. The
backward copies each gradient to the host as it is accumulated (``offload_gradients=True`` frees the device's
then); the step updates the host copies and copies them back. On the device that removes the state of the offloaded
parameters and, with ``offload_gradients``, their gradients after the backward; in host memory it adds the copies,
gradients, state and the update's CPU temporaries (an estimate for ``"cuda"`` reports them in
``timeline.meta["host_bytes"]``). torchao runs AdamW fused (host and device); the others run their CPU default on the
host (a loop per parameter) and their device default on the device (``foreach`` reaches that one). What the
per-parameter optimizers change: bitsandbytes' 8-bit ones keep two 1 KiB quantization maps per offloaded parameter,
a paged one pages nothing (its state is host memory already), and Prodigy estimates its step size ``d`` per
parameter instead of per group (values, not memory). Without CUDA (this machine; an estimate's fake tensors)
torchao's streams, events and pinned memory are stood in for while its code runs (``_optimizer_adapters.py``).

The optional libraries are the ``finetune`` extra (``pip install "memkit[finetune]"``), imported when an
optimizer that needs one is built; missing, the error names the optimizer, the package and the extra.

Example:
    >>> opt = make_optimizer("adamw8bit", model.parameters())
    >>> with memkit.track(model, optimizer=opt) as tl:
    ...     memkit.train_step(model, inputs, opt)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from ._lazy import quiet_imports

if TYPE_CHECKING:
    import torch

__all__ = [
    "EXTRA",
    "OPTIMIZERS",
    "OPTIMIZER_ON",
    "MissingLibraryError",
    "OptimizerName",
    "OptimizerOn",
    "build_optimizer",
    "make_optimizer",
]

OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "prodigy", "came", "lion")
OptimizerName = Literal["adamw", "adam", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "prodigy", "came", "lion"]
EXTRA = "finetune"
OPTIMIZER_ON = ("device", "cpu")
OptimizerOn = Literal["device", "cpu"]

# name -> (module to import, its pip package); the torch optimizers need none
_LIBRARIES = {
    "adamw8bit": ("bitsandbytes", "bitsandbytes"),
    "paged-adamw8bit": ("bitsandbytes", "bitsandbytes"),
    "lion": ("bitsandbytes", "bitsandbytes"),
    "prodigy": ("prodigyopt", "prodigyopt"),
    "came": ("came_pytorch", "came-pytorch"),
    "cpu": ("torchao.optim.cpu_offload", "torchao"),  # optimizer_on="cpu": torchao's CPUOffloadOptimizer
}


class MissingLibraryError(ImportError):
    """An optimizer's library is not installed; the message names the optimizer, the package and the extra.

    Example:
        >>> make_optimizer("came", params)   # MissingLibraryError: optimizer='came' needs came-pytorch ...
    """


def _import(name: str):
    module, package = _LIBRARIES[name]
    try:
        with quiet_imports():
            return importlib.import_module(module)
    except ImportError as e:
        what = "optimizer_on='cpu'" if name == "cpu" else f"optimizer={name!r}"
        raise MissingLibraryError(
            f"{what} needs {package}, which is not installed (importing {module} failed: {e}); "
            f'install the {EXTRA} extra: pip install "memkit[{EXTRA}]"'
        ) from e


def make_optimizer(
    name: str | None,
    params: Iterable[torch.Tensor],
    *,
    foreach: bool | None = None,
    on: OptimizerOn = "device",
    offload_gradients: bool = False,
) -> torch.optim.Optimizer | None:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) over the ``params`` that require grad; None for None.

    Each is its library's own class with its usual settings (learning rates do not change memory); ``foreach``
    reaches the torch optimizers (AdamW, Adam, SGD, Adafactor), the others have no such switch. The optional
    libraries are imported here: a missing one raises :class:`MissingLibraryError` (an ImportError).

    ``on="cpu"`` wraps it in torchao's ``CPUOffloadOptimizer`` (any name; the ``finetune`` extra):
    one optimizer of that class per parameter of 4,096 elements or more, stepping a pinned host copy of the
    parameter with a host copy of its gradient (``offload_gradients=True``: the device gradient freed as soon as it
    is copied), and one on the device for the smaller ones. See :mod:`memkit._optimizer_adapters` for how it runs
    without CUDA.

    Example:
        >>> opt = make_optimizer("prodigy", model.parameters())
        >>> opt = make_optimizer("adamw", model.parameters(), on="cpu")   # torchao's CPUOffloadOptimizer
    """
    if name is None:
        return None
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)} or None, got {name!r}")
    if on not in OPTIMIZER_ON:
        raise ValueError(f"on must be one of {list(OPTIMIZER_ON)}, got {on!r}")
    params = [p for p in params if p.requires_grad]
    if on == "device":
        if offload_gradients:
            raise ValueError("offload_gradients=True goes with on='cpu' (torchao's CPUOffloadOptimizer)")
        return build_optimizer(name, params, foreach=foreach)
    from ._optimizer_adapters import cpu_offload

    _import("cpu")
    return cpu_offload(name, params, foreach=foreach, offload_gradients=offload_gradients)


def build_optimizer(name: str, params: Iterable[Any], *, foreach: bool | None = None) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (tensors or parameter groups) as they are: no filter on
    ``requires_grad`` (torchao's host copies of the parameters require none).

    Example:
        >>> opt = build_optimizer("adamw", [{"params": [host_copy]}])
    """
    import torch

    from ._optimizer_adapters import seen

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    if name == "adafactor":
        return seen(torch.optim.Adafactor)(params, lr=1e-2, foreach=foreach)
    library = _import(name)
    if name == "adamw8bit":
        return seen(library.optim.AdamW8bit)(params, lr=1e-4)
    if name == "paged-adamw8bit":
        return seen(library.optim.PagedAdamW8bit)(params, lr=1e-4)
    if name == "lion":
        return seen(library.optim.Lion)(params, lr=1e-4)
    if name == "prodigy":
        return seen(library.Prodigy)(params, lr=1.0)
    return seen(library.CAME)(params, lr=1e-4)
