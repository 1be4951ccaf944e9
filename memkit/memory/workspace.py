"""Memory that kernels allocate inside themselves and free before returning.

A dispatch mode sees an op's outputs but not the buffers its kernel allocates internally. Most ops have
none; the ones below do, and on a small model they set the peak. Each entry gives the bytes of the
transient buffers from the op's arguments, following the kernel source of torch 2.6–2.13. They are counted
as a ``temporary`` allocation freed right after the op's outputs are allocated, which is the order the
kernels use. What is not modelled: casts a CPU kernel makes of tensor operands of mixed dtypes, buffers
a kernel allocates on worker threads beyond the first (CPU flash-attention backward: ``qSplitSize``
floats per extra thread, which the profiler does not see either), oneDNN packing buffers (half precision
on AMX CPUs only), and CUDA library workspaces (cuBLAS, cuDNN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

aten = torch.ops.aten

_REDUCED = (torch.float16, torch.bfloat16)


def _accum_size(dtype: torch.dtype) -> int:
    return 4 if dtype in _REDUCED or dtype == torch.float32 else torch.finfo(dtype).bits // 8


def _splits(q_len: int, kv_len: int) -> tuple[int, int]:
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _flash_cpu_forward(args, kwargs, out) -> int:
    # cpu_flash_attention: per-thread buf (qk, qk_max, qk_sum, dst) in the accumulate type, plus qk in the
    # input type for half precision. q is (batch, heads, q_len, head_dim).
    q, k = args[0], args[1]
    q_len, head_dim, kv_len = q.shape[2], q.shape[3], k.shape[2]
    q_split, kv_split = _splits(q_len, kv_len)
    threads = torch.get_num_threads()
    per_thread = q_split * kv_split + 2 * q_split + q_split * head_dim
    n = threads * per_thread * _accum_size(q.dtype)
    if q.dtype in _REDUCED:
        n += threads * q_split * kv_split * q.element_size()
    return n


def _flash_cpu_backward(args, kwargs, out) -> int:
    # cpu_flash_attention_backward: grad_out made contiguous in (batch, q_len, heads, head_dim) layout,
    # per-thread buf (attn, grad_attn), its half-precision twin, and one dsum row block.
    grad_out, q, k = args[0], args[1], args[2]
    q_len, kv_len = q.shape[2], k.shape[2]
    q_split, kv_split = _splits(q_len, kv_len)
    threads = torch.get_num_threads()
    accum = _accum_size(q.dtype)
    n = threads * 2 * q_split * kv_split * accum + q_split * accum
    if q.dtype in _REDUCED:
        n += threads * 2 * q_split * kv_split * q.element_size()
    if not grad_out.transpose(1, 2).is_contiguous():
        n += grad_out.numel() * grad_out.element_size()
    return n


_CPU: dict[object, Callable] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _flash_cpu_forward),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _flash_cpu_backward),
):
    _packet = getattr(aten, _name, None)
    if _packet is not None:
        _CPU[_packet.default] = _fn


_WRAPPED_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _wrapped_scalars(slots: tuple[int, ...], args) -> int:
    # A Python number passed where the schema takes a Tensor (``x / 2.0``) becomes a 0-dim "wrapped number"
    # tensor: the argument parser allocates one before dispatch, the call below the dispatch mode allocates
    # another, and the kernel casts it to the computation dtype. All three die when the op returns.
    n = 0
    for i in slots:
        if i < len(args) and type(args[i]) in _WRAPPED_DTYPE:
            wrapped = _WRAPPED_DTYPE[type(args[i])]
            n += 2 * wrapped.itemsize
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if tensor is not None:
                common = torch.result_type(tensor, args[i])
                if common != wrapped:
                    n += common.itemsize
    return n


WorkspaceFn = Callable[[tuple, dict, object], int]


def workspace_fn(func, device: str | None = None) -> WorkspaceFn | None:
    """The function giving the bytes of internal buffers ``func`` allocates and frees while producing its
    outputs, ``fn(args, kwargs, out) -> int``; None when it has none (the common case, decided once per op).

    ``device`` is the device being measured (an estimate for CUDA runs on fake CPU tensors): CPU kernels'
    buffers and CPU-side wrapped numbers count only for CPU.
    """
    if device is not None and not device.startswith("cpu"):
        return None
    slots = tuple(i for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor" and not a.kwarg_only)
    kernel = _CPU.get(func)
    if kernel is None and not slots:
        return None
    if kernel is None:
        return lambda args, kwargs, out: _wrapped_scalars(slots, args)
    return lambda args, kwargs, out: _wrapped_scalars(slots, args) + kernel(args, kwargs, out)
