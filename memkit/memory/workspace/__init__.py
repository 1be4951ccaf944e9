"""Memory that kernels allocate inside themselves and free before returning.

A dispatch mode sees an op's outputs but not the buffers its kernel allocates internally. Most ops have
none; the ones below do, and on a small model they set the peak. They are counted as a ``temporary``
allocation freed right after the op's outputs are allocated, which gives the op's true peak whatever order
the kernel used. Two ways to know them:

- **Formulas**, where torch's own kernel source sizes the buffers from the arguments alone: CPU flash
  attention on the paths without oneDNN packing (``attention.py``: fp32 everywhere, bf16/fp16 while oneDNN
  runs at most AVX2, fp16 up to AVX512_CORE_BF16), and Python scalars wrapped into tensors. Free, and usable
  on fake tensors without running anything.
- **Learned from the allocator** (``learned.py``), where the kernel sizes its scratch from what Python cannot
  see (oneDNN's blocking follows the ISA, thread count and cache sizes): half-precision matmuls and flash
  attention from AVX512_CORE up (AMX included), every convolution (im2col columns of the slow path, oneDNN
  scratch), and every matmul and attention call on a non-x86 CPU. Each call signature is run once in a
  worker process under the profiler; the answer is cached.

``cpu_path.py`` says which path this process takes. A call whose buffers can be neither computed nor learned
is listed in ``timeline.meta["lower_bound_ops"]``: its figure is then a lower bound. Not modelled at all:
casts a CPU kernel makes of tensor operands of mixed dtypes; buffers allocated on worker threads beyond the
first (CPU flash-attention backward: ``qSplitSize`` floats per extra thread, which the profiler does not see
either); CUDA library workspaces (cuBLAS, cuDNN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import attention, cpu_path, learned
from .scalars import _wrapped_scalars

aten = torch.ops.aten

_CPU: dict[object, Callable] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", attention.flash_cpu_forward),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", attention.flash_cpu_backward),
):
    _packet = getattr(aten, _name, None)
    if _packet is not None:
        _CPU[_packet.default] = _fn


WorkspaceFn = Callable[[tuple, dict, object], int]

# Ops whose CPU kernels allocate internal buffers that only the allocator knows on some paths: learned per
# call signature (learned.py). Convolutions always (im2col columns of the slow path, oneDNN scratch); matmuls and
# flash attention where cpu_path.modelled() says no formula covers the path.
LEARNED_OPS = frozenset({"convolution", "convolution_backward"})


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _needs_learning(name: str, args) -> bool:
    if name in LEARNED_OPS:
        return True
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return t is not None and t.device.type == "cpu" and not cpu_path.modelled(name, t.dtype)


def _learnable(name: str) -> bool:
    return name in LEARNED_OPS or name in cpu_path.MATMUL_OPS or name in cpu_path.ATTENTION_OPS


def workspace_fn(func, device: str | None = None) -> WorkspaceFn | None:
    """The function giving the bytes of internal buffers ``func`` allocates and frees while producing its
    outputs, ``fn(args, kwargs, out) -> int``; None when it has none (the common case, decided once per op).

    ``device`` is the device being measured (an estimate for CUDA runs on fake CPU tensors): CPU kernels'
    buffers and CPU-side wrapped numbers count only for CPU. On a path no formula models, the bytes are
    learned from the allocator (``learned.py``); where that is impossible they count as 0 and
    :func:`lower_bound_fn` flags the call.
    """
    if device is not None and not device.startswith("cpu"):
        return None
    slots = tuple(i for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor" and not a.kwarg_only)
    name = _op_name(func)
    formula = _CPU.get(func)
    learnable = _learnable(name)
    if formula is None and not slots and not learnable:
        return None

    def fn(args, kwargs, out) -> int:
        n = _wrapped_scalars(slots, args) if slots else 0
        if learnable and _needs_learning(name, args):
            return n + (learned.learned_bytes(func, args, kwargs) or 0)
        return n + formula(args, kwargs, out) if formula is not None else n

    return fn


def lower_bound_fn(func, device: str | None = None) -> Callable[[tuple, dict], bool] | None:
    """A predicate ``fn(args, kwargs) -> bool``, True when this call of ``func`` runs a kernel path whose
    internal buffers are neither modelled nor learned (the tracked figure is then a lower bound); None for ops
    that allocate no internal buffers on any path, or whose formula covers every path."""
    if device is not None and not device.startswith("cpu"):
        return None
    name = _op_name(func)
    if not _learnable(name):
        return None

    def unknown(args, kwargs) -> bool:
        return _needs_learning(name, args) and learned.learned_bytes(func, args, kwargs) is None

    return unknown
