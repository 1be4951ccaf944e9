"""Buffers CPU flash attention (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward)
allocates inside the kernel, following aten/src/ATen/native/cpu/FlashAttentionKernel.cpp."""

from __future__ import annotations

import torch

_REDUCED = (torch.float16, torch.bfloat16)


def _accum_size(dtype: torch.dtype) -> int:
    return 4 if dtype in _REDUCED or dtype == torch.float32 else torch.finfo(dtype).bits // 8


def _splits(q_len: int, kv_len: int) -> tuple[int, int]:
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def flash_cpu_forward(args, kwargs, out) -> int:
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


def flash_cpu_backward(args, kwargs, out) -> int:
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
