"""bitsandbytes' quantized linear layers put into a model as diffusers' quantizer does, on real and fake tensors.

The layers are diffusers' own choice (``replace_with_bnb_linear`` with ``modules_to_not_convert``: the config's
skipped modules and the class's ``_keep_in_fp32_modules``), the quantization bitsandbytes' own: a real weight goes
through ``Params4bit(...).to(device)`` (``Params4bit._quantize``: ``bitsandbytes.functional.quantize_4bit``), as
diffusers' ``create_quantized_param`` does when it loads a checkpoint.

Two things bitsandbytes cannot do where memkit measures, and what stands in for them here:

- **Fake tensors.** ``Params4bit`` is a ``Parameter`` subclass made with ``Tensor._make_subclass``, which refuses a
  fake tensor (it is already a ``FakeTensor`` object). Under fake mode the modules are built on the meta device with
  fake mode paused, and each weight is quantized by the very function ``Params4bit._quantize`` calls
  (``quantize_4bit``, on the fake weight: bitsandbytes registers fake kernels for its ops); the packed codes become a
  fake ``Parameter`` carrying the attributes ``Params4bit`` has (``quant_state``, ``blocksize``, ``quant_type``...),
  which is all ``Linear4bit.forward``, ``matmul_4bit`` and peft's ``Linear4bit`` read. The 1 KiB dynamic map that
  double quantization takes from bitsandbytes' module-level cache (``name2qmap["dynamic"]``) is built for real and
  entered into fake mode for the call, so the cache never holds a fake tensor. LLM.int8's ``Int8Params`` likewise:
  ``Int8Params._quantize``'s own steps (fp16, ``int8_vectorwise_quant``) on the fake weight, the codes a fake
  ``Parameter`` with its ``CB``, ``SCB`` and ``has_fp16_weights``. Both run under a float32 default dtype, as in a
  training script (bitsandbytes builds its 4-bit code with ``torch.tensor(list)``).
- **The tracker.** ``bitsandbytes::gemm_4bit`` (the 4-bit layers' forward, CPU and CUDA alike) is a Python kernel
  that dequantizes the whole weight in the compute dtype and calls ``linear``: a weight-sized temporary per layer that
  a dispatch mode does not see (it sees the op's output). While a tracker or fake mode is active, each 4-bit layer's
  forward runs under :class:`_SeeKernels`, which runs that very kernel (``_gemm_4bit_default_impl``) so its ops reach
  the tracker.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._optimizer_adapters import _fake_mode, _float32_default


def config(method: str, compute_dtype: torch.dtype):
    """diffusers' ``BitsAndBytesConfig`` for a 4-bit or 8-bit ``method``."""
    from diffusers import BitsAndBytesConfig

    if method == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="fp4" if method == "fp4" else "nf4",
        bnb_4bit_use_double_quant=method == "nf4-dq",
        bnb_4bit_compute_dtype=compute_dtype,
    )


def quantize(model: nn.Module, method: str, compute_dtype: torch.dtype, skip: list[str]) -> list[tuple]:
    """Replace ``model``'s linear layers (but ``skip``) with bitsandbytes' quantized ones; returns ``(parent, name,
    original)`` for each replaced layer, to put back."""
    import bitsandbytes as bnb
    from diffusers.quantizers.bitsandbytes.utils import replace_with_bnb_linear
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    parents = {n: m for n, m in model.named_modules()}
    cfg = config(method, compute_dtype)
    fake = _fake_mode()
    with unset_fake_temporarily() if fake is not None else contextlib.nullcontext():
        replace_with_bnb_linear(model, modules_to_not_convert=list(skip), quantization_config=cfg)
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and name in originals
    ]
    replaced = [(parents[n.rpartition(".")[0]], n.rpartition(".")[2], originals[n]) for n, _ in layers]
    try:
        # bitsandbytes builds its 4-bit code with torch.tensor(list): float32 in a training script, not the default
        # dtype an estimate builds its model under (a bf16 code would be 32 bytes instead of 64 per layer)
        with _float32_default(True):
            _fill(layers, originals, fake)
    except BaseException:
        unquantize(replaced)
        raise
    return replaced


def _fill(layers: list, originals: dict, fake: Any) -> None:
    import bitsandbytes as bnb

    from ._common import weights_replaced

    for name, module in layers:
        old = originals[name]
        if isinstance(module, bnb.nn.Linear4bit):
            _fill_4bit(module, old, fake)
        else:
            _fill_8bit(module, old, fake)
        kept = {p.untyped_storage()._cdata for p in module.parameters()}  # the bias moves over on its storage
        weights_replaced([p for p in old.parameters() if p.untyped_storage()._cdata not in kept])
        # the repacking for bitsandbytes' CPU inference kernel (eval(), no grad, AVX-512 BF16) is for good: a later
        # training forward would silently give no input gradient. Off: CUDA never repacks either.
        module.support_avx512bf16_for_cpu = False
        module.forward = functools.partial(_seen_forward, module)


def unquantize(replaced: list[tuple]) -> None:
    """Put every original layer back where :func:`quantize` replaced it."""
    for parent, child, old in replaced:
        parent._modules[child] = old


def _bias(old: nn.Linear) -> nn.Parameter | None:
    # a new Parameter on the same storage: Linear4bit's forward may recast ``bias.data`` (compute dtype), which must
    # not reach the original layer; frozen, as diffusers' replace_with_bnb_linear freezes the new module
    return None if old.bias is None else nn.Parameter(old.bias.detach(), requires_grad=False)


def _fill_4bit(module: nn.Module, old: nn.Linear, fake: Any) -> None:
    import bitsandbytes as bnb

    meta = module.weight
    kwargs = dict(
        blocksize=meta.blocksize,
        compress_statistics=meta.compress_statistics,
        quant_type=meta.quant_type,
        quant_storage=meta.quant_storage,
    )
    weight = old.weight.detach()
    if fake is None:  # diffusers' create_quantized_param: the library quantizes on .to(device)
        param = bnb.nn.Params4bit(weight, requires_grad=False, module=module, **kwargs).to(weight.device)
    else:
        with _fake_dynamic_map(fake):
            packed, state = bnb.functional.quantize_4bit(weight.contiguous(), **kwargs)
        param = nn.Parameter(packed, requires_grad=False)
        for key, value in dict(kwargs, quant_state=state, bnb_quantized=True, module=module).items():
            setattr(param, key, value)
        module.quant_state = state
    module._parameters["weight"] = param
    module._parameters["bias"] = _bias(old)


def _fill_8bit(module: nn.Module, old: nn.Linear, fake: Any) -> None:
    import bitsandbytes as bnb

    meta = module.weight
    weight = old.weight.detach()
    if fake is None:  # diffusers' create_quantized_param for LLM.int8: Int8Params quantizes on .to(device)
        param = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=meta.has_fp16_weights)
        param = param.to(weight.device)
    else:  # Int8Params._quantize's own steps on the fake weight: fp16, then bitsandbytes' row-wise quantization
        codes, scales, _ = bnb.functional.int8_vectorwise_quant(weight.contiguous().to(torch.float16))
        param = nn.Parameter(codes, requires_grad=False)
        param.CB, param.SCB, param.has_fp16_weights = codes, scales, meta.has_fp16_weights
    module._parameters["weight"] = param
    module._parameters["bias"] = _bias(old)


@contextlib.contextmanager
def _fake_dynamic_map(fake: Any) -> Iterator[None]:
    """bitsandbytes' cached dynamic map (double quantization's code) built for real, a fake copy of it inside."""
    import bitsandbytes.functional as F
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        if "dynamic" not in F.name2qmap:
            F.name2qmap["dynamic"] = F.create_dynamic_map()
        real = F.name2qmap["dynamic"]
    F.name2qmap["dynamic"] = fake.from_tensor(real)
    try:
        yield
    finally:
        F.name2qmap["dynamic"] = real


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of every 4-bit layer's quant state (absmax, code, and with double quantization the offset and the
    second level's absmax and code): the weight's bytes beside the packed codes, which are the parameter."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None or not hasattr(state, "absmax"):
            continue
        out += [state.absmax, state.code]
        if state.nested:
            out += [state.offset, state.state2.absmax, state.state2.code]
    for module in model.modules():  # LLM.int8: the row scales Int8Params keeps beside the int8 weight
        scb = getattr(getattr(module, "weight", None), "SCB", None)
        if isinstance(scb, torch.Tensor):
            out.append(scb)
    return out


def _seen_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    from ..memory.tracker import _active

    forward = type(module).forward
    if not _active and _fake_mode() is None:
        return forward(module, *args, **kwargs)
    with _SeeKernels():
        return forward(module, *args, **kwargs)


class _SeeKernels(TorchDispatchMode):
    """Runs ``bitsandbytes::gemm_4bit`` as bitsandbytes' own Python kernel, whose ops (the dequantized weight, the
    ``linear``) reach the tracker and fake mode below this mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _gemm_op():
            return _gemm_kernel()(*args, **kwargs)
        return func(*args, **kwargs)


@functools.cache
def _gemm_op():
    return torch.ops.bitsandbytes.gemm_4bit.default


@functools.cache
def _gemm_kernel():
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    return _gemm_4bit_default_impl
