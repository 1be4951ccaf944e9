"""Quantized base weights: the frozen base stored in 4 bits, 8 bits or fp8, by the libraries that do it.

The base's weights are most of a LoRA fine-tune's memory (full Flux in bf16: 22.2 GiB of 11.9B parameters);
quantizing them is the QLoRA recipe (diffusers' "Flux QLoRA" blog post, ``train_dreambooth_lora_flux.py``'s
``--bnb_quantization_config_path``). Each method is the library's own code, applied as diffusers applies it:

- ``nf4``, ``nf4-dq``, ``fp4``: bitsandbytes' ``Linear4bit`` (diffusers' ``BitsAndBytesConfig(load_in_4bit=True)``):
  two 4-bit codes per byte plus one fp32 absmax per 64 weights (0.5625 bytes per weight); ``nf4-dq`` (double
  quantization) stores the absmax in 8 bits with one fp32 constant per 256 blocks (~0.5079 bytes per weight). Each
  forward and backward dequantizes the whole weight in the compute dtype (a weight-sized temporary per layer, freed
  after its matmul), so the saving is on what lives, not on the peak of one layer.
- ``int8``: bitsandbytes' LLM.int8 ``Linear8bitLt``, frozen (``BitsAndBytesConfig(load_in_8bit=True)``): int8 weights
  plus an fp32 scale per output row. Its training forward on the CPU dequantizes the weight and calls ``linear``
  (``MatMul8bitFp``); on CUDA bitsandbytes takes its int8 matmul (``MatMul8bitLt``), which an estimate (fake CPU
  tensors) does not follow: an estimate for ``"cuda"`` holds the CPU path's temporaries.
- ``int8wo``, ``float8wo``: torchao's ``quantize_`` with ``Int8WeightOnlyConfig`` / ``Float8WeightOnlyConfig``
  (diffusers' ``TorchAoConfig``): int8 or float8 data with a scale per row (int8: and a zero point), dequantized per
  matmul.
- ``fp8-storage``: diffusers' layerwise casting (``model.enable_layerwise_casting``): weights stored in float8 (e4m3,
  or e5m2 with ``fp8="e5m2"``: 1 byte per weight) and cast to the compute dtype around each layer's forward; the
  cast copy is kept for the backward where the layer's input needs a gradient. Convolutions are left out (their
  backward would read the weight after the hook cast it back to fp8, which torch refuses).

The modules diffusers keeps unquantized stay so: for bitsandbytes the config's skipped modules and the class's
``_keep_in_fp32_modules``; for layerwise casting diffusers' default patterns (``pos_embed``, ``patch_embed``,
``norm``, ``proj_in``, ``proj_out``), ``_keep_in_fp32_modules`` and ``_skip_layerwise_casting_patterns``.
Quantized weights do not train (the libraries freeze them): a training step with an optimizer needs
:class:`memkit.LoRA` on top (apply it after ``Quantize``, as the registry and the command line do).

The handle keeps the original layers (and their weights) so that ``remove()`` restores the model bit for bit; they
are not the model's and are not counted (a training script frees them).

Estimates (fake tensors) run the libraries' own code through :mod:`memkit.optimizations._bnb` (bitsandbytes'
``Params4bit``/``Int8Params`` refuse fake tensors; its ``gemm_4bit`` kernel hides a temporary from the tracker) and
follow the CPU dispatch of each library's ops: where CUDA takes another kernel (LLM.int8's int8 matmul above; a
torchao kernel of its own) an estimate for ``"cuda"`` holds the CPU path's temporaries. Estimates are memoized
(bitsandbytes' quant states belong to their blocks as the weights do); LLM.int8 on Flux runs every block (its
probe's events do not split into blocks).

Example:
    >>> with memkit.handle.apply_all(model, [memkit.Quantize(method="nf4"), memkit.LoRA(rank=16)]) as handle:
    ...     memkit.Step(optimizer="adamw").bind(model, handle).run(inputs)      # QLoRA
    >>> memkit.estimate("flux", optimizations=[memkit.Quantize(), memkit.LoRA()]).peak_bytes
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..handle import Handle

__all__ = ["METHODS", "Quantize", "refuse_training_without_adapters"]

METHODS = ("nf4", "nf4-dq", "fp4", "int8", "int8wo", "float8wo", "fp8-storage")
"""The quantization methods, as :attr:`Quantize.method` and ``--quantize`` name them."""

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MARK = "_memkit_quantized"
_LIBRARY = {
    "nf4": "bitsandbytes", "nf4-dq": "bitsandbytes", "fp4": "bitsandbytes", "int8": "bitsandbytes",
    "int8wo": "torchao", "float8wo": "torchao",
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Quantize:
    """Store the frozen base's linear weights quantized (bitsandbytes 4-bit or LLM.int8, torchao weight-only int8 or
    float8, or diffusers' fp8 layerwise casting); train adapters on top with :class:`memkit.LoRA` (QLoRA).

    Saves most of the weights' memory (nf4: 0.5625 bytes per weight instead of 2 in bf16; fp8: 1) for a dequantizing
    cast per layer in every forward and backward (a weight-sized temporary while that layer runs).

    Example:
        >>> memkit.Quantize(method="nf4-dq", compute_dtype=torch.bfloat16).apply(model)
        >>> memkit.Quantize.parse("fp8-storage:e5m2")
    """

    method: Literal["nf4", "nf4-dq", "fp4", "int8", "int8wo", "float8wo", "fp8-storage"] = "nf4"
    """How the weights are stored: one of :data:`METHODS`."""
    compute_dtype: torch.dtype | None = None
    """The dtype the weights are dequantized (cast) to for compute: bitsandbytes' ``bnb_4bit_compute_dtype``,
    layerwise casting's ``compute_dtype``. None: the model's own dtype."""
    fp8: Literal["e4m3", "e5m2"] = "e4m3"
    """For ``fp8-storage``: ``torch.float8_e4m3fn`` (diffusers' example) or ``torch.float8_e5m2``."""
    skip: tuple[str, ...] = ()
    """More module names to keep unquantized, beyond the ones diffusers keeps (bitsandbytes: names or name prefixes,
    its ``llm_int8_skip_modules``; layerwise casting: regular expressions, its ``skip_modules_pattern``)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        if self.compute_dtype is not None and (
            not isinstance(self.compute_dtype, torch.dtype) or self.compute_dtype not in _COMPUTE
        ):
            raise ValueError(
                f"compute_dtype must be None or one of {[str(d) for d in _COMPUTE]}, got {self.compute_dtype!r}"
            )
        if self.fp8 not in _FP8:
            raise ValueError(f"fp8 must be one of {list(_FP8)}, got {self.fp8!r}")
        if isinstance(self.skip, str) or not all(isinstance(s, str) and s for s in self.skip):
            raise ValueError(f"skip must be a tuple of module names, got {self.skip!r}")
        object.__setattr__(self, "skip", tuple(self.skip))

    def apply(self, model: nn.Module) -> Handle:
        """Quantize ``model``'s linear weights in place; the handle owns the quant states' tensors (category
        ``parameter``) and puts the original layers back.

        Example:
            >>> with memkit.Quantize(method="nf4-dq").apply(model) as handle:
            ...     memkit.track(model, owned=handle)                # packed codes + absmax + constants
        """
        _refuse_quantized(model)
        if getattr(model, "peft_config", None):
            raise ValueError(
                "model has peft adapters: apply memkit.Quantize before memkit.LoRA (QLoRA quantizes the base, then "
                "adds the adapters beside the quantized layers)"
            )
        library = _LIBRARY.get(self.method, "diffusers")
        if importlib.util.find_spec(library) is None:
            raise ImportError(f'quantize {self.method} needs {library}: pip install "memkit[finetune]"')
        compute = self.compute_dtype or _model_dtype(model)
        saved = {k: model.__dict__[k] for k in ("is_loaded_in_4bit", "is_loaded_in_8bit") if k in model.__dict__}
        undos = []

        def undo() -> None:
            for u in reversed(undos):
                u()
            for k in ("is_loaded_in_4bit", "is_loaded_in_8bit", "_memkit_compute_dtype", _MARK):
                model.__dict__.pop(k, None)
            model.__dict__.update(saved)

        try:
            if self.method in ("int8wo", "float8wo"):
                undos.append(_torchao(model, self.method, [*self.skip, *_keep(model)]))
                owned = None
            elif self.method == "fp8-storage":
                undos.append(_layerwise(model, _FP8[self.fp8], compute, self.skip))
                model.__dict__["_memkit_compute_dtype"] = compute  # memkit.LoRA makes its adapters in it
                owned = None
            else:
                from . import _bnb

                skip = [*self.skip, *_keep(model)]  # diffusers: llm_int8_skip_modules + _keep_in_fp32_modules
                replaced = _bnb.quantize(model, self.method, compute, skip)
                undos.append(lambda: _bnb.unquantize(replaced))
                if not replaced:
                    raise ValueError(
                        f"{type(model).__name__} has no linear layer to quantize outside skip={list(skip)}"
                    )
                # what peft's LoRA reads to wrap the layers with its own quantized-layer adapters
                model.__dict__["is_loaded_in_8bit" if self.method == "int8" else "is_loaded_in_4bit"] = True
                state = _bnb.state_tensors(model)
                owned = {"parameter": state}
            model.__dict__[_MARK] = str(self)
        except BaseException:
            undo()
            raise
        return Handle(undo, name=str(self), owned=owned)

    @classmethod
    def parse(cls, value: str) -> Quantize:
        """The config a command-line or widget value names: ``"METHOD[:compute=DTYPE][:e5m2][:skip=a,b]"``.

        Example:
            >>> memkit.Quantize.parse("nf4-dq:compute=bfloat16")
            Quantize(method='nf4-dq', compute_dtype=torch.bfloat16, ...)
        """
        head, *opts = value.split(":")
        kwargs: dict = {}
        for opt in opts:
            key, eq, val = opt.partition("=")
            if key in _FP8 and not eq:
                kwargs["fp8"] = key
            elif key == "compute" and eq:
                dtype = getattr(torch, val, None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"quantize compute must be a torch dtype name such as 'bfloat16', got {val!r}")
                kwargs["compute_dtype"] = dtype
            elif key == "skip" and eq:
                kwargs["skip"] = tuple(s.strip() for s in val.split(",") if s.strip())
            else:
                raise ValueError(
                    f"quantize value must be METHOD[:compute=DTYPE][:e5m2][:skip=a,b] with METHOD one of "
                    f"{list(METHODS)}; unknown option {opt!r} in {value!r}"
                )
        return cls(method=head, **kwargs)

    def __str__(self) -> str:
        parts = [self.method]
        if self.compute_dtype is not None:
            parts.append("compute=" + str(self.compute_dtype).replace("torch.", ""))
        if self.fp8 != "e4m3":
            parts.append(self.fp8)
        if self.skip:
            parts.append("skip=" + ",".join(self.skip))
        return "quantize:" + ":".join(parts)


_COMPUTE = (torch.float32, torch.bfloat16, torch.float16)
# A convolution's backward reads the weight tensor it saved, which the layerwise-casting hook has cast back to fp8 by
# then (torch: "expected scalar type Float but found Float8_e4m3fn"); a linear layer saves a transposed view, which
# keeps the compute-dtype copy. Convolutions stay in the model's dtype so that training works (finetrainers' default
# patterns skip the patch embeddings, the convolutions of its transformers, as well).
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _keep(model: nn.Module) -> list[str]:
    return list(getattr(type(model), "_keep_in_fp32_modules", None) or [])


def _refuse_quantized(model: nn.Module) -> None:
    """A ValueError for a model that is quantized already (by memkit or by a library)."""
    if _MARK in model.__dict__:
        raise ValueError(f"model is quantized already ({model.__dict__[_MARK]}): remove that handle first")
    for name, module in model.named_modules():
        kind = type(module).__name__
        hooks = getattr(module, "_diffusers_hook", None)
        if kind in ("Linear4bit", "Linear8bitLt") or (hooks is not None and hooks.get_hook("layerwise_casting")):
            raise ValueError(f"model is quantized already: {name or 'the model'} is a {kind} or casts layerwise")
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and (
            not weight.is_floating_point()
            or weight.element_size() == 1
            or type(weight).__module__.startswith("torchao")
        ):
            raise ValueError(f"model is quantized already: {name}.weight is {weight.dtype}")


def _layerwise(model: nn.Module, storage: torch.dtype, compute: torch.dtype, skip: tuple[str, ...]):
    """diffusers' ``enable_layerwise_casting`` on ``model`` (fake tensors: ``Module.to`` through
    :func:`memkit._torch_compat.fake_module_to_in_place`); returns the undo (hooks off, original weights back)."""
    try:
        from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN, apply_layerwise_casting
    except ImportError:  # layerwise casting came with diffusers 0.33
        import diffusers

        raise ImportError(
            f"quantize fp8-storage needs diffusers >= 0.33 (its layerwise casting); diffusers {diffusers.__version__} "
            'is installed: pip install -U "diffusers>=0.33"'
        ) from None

    from .._torch_compat import fake_module_to_in_place

    modules = list(model.modules())
    before = {id(m): ("_diffusers_hook" in m.__dict__, "forward" in m.__dict__) for m in modules}
    params = [(m, k, p, p.data, p.requires_grad) for m in modules for k, p in m._parameters.items() if p is not None]
    patterns = (*DEFAULT_SKIP_MODULES_PATTERN, *skip)

    def undo() -> None:
        for m in modules:
            had_hook, had_forward = before[id(m)]
            if not had_hook:
                m.__dict__.pop("_diffusers_hook", None)
            if not had_forward:
                m.__dict__.pop("forward", None)
        for m, k, p, data, flag in params:
            m._parameters[k] = p
            if p.data is not data and p.dtype != data.dtype:
                p.data = data
            p.requires_grad_(flag)

    try:
        with fake_module_to_in_place():
            if hasattr(model, "enable_layerwise_casting"):
                # diffusers' models: the method, which adds the class's _keep_in_fp32_modules and
                # _skip_layerwise_casting_patterns
                model.enable_layerwise_casting(
                    storage_dtype=storage,
                    compute_dtype=compute,
                    skip_modules_pattern=patterns,
                    skip_modules_classes=_CONV,
                )
            else:
                apply_layerwise_casting(
                    model, storage, compute, skip_modules_pattern=patterns, skip_modules_classes=_CONV
                )
        for m in modules:  # the cast layers are frozen: their gradients would be in the compute dtype
            if not before[id(m)][0] and "_diffusers_hook" in m.__dict__:
                m.requires_grad_(False)
                m.forward = functools.partial(_fake_to_forward, m.forward)
    except BaseException:
        undo()
        raise
    return undo


def _torchao(model: nn.Module, method: str, skip: list[str]):
    """torchao's ``quantize_`` with ``Int8WeightOnlyConfig`` or ``Float8WeightOnlyConfig`` on ``model``'s linear layers
    but ``skip`` (diffusers' TorchAoHfQuantizer's rule: a name or its prefix); returns the undo. Its tensor subclasses
    run on fake tensors as they are."""
    from .._lazy import quiet_imports

    with quiet_imports():
        import torchao.quantization as ao

    wanted = "Int8WeightOnlyConfig" if method == "int8wo" else "Float8WeightOnlyConfig"
    if not hasattr(ao, wanted):  # the config API came with torchao 0.9 (before: int8_weight_only() functions)
        import torchao

        raise ImportError(
            f"quantize {method} needs torchao >= 0.9 (its {wanted}); torchao {torchao.__version__} is installed: "
            'pip install -U "torchao>=0.9"'
        )
    Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_ = (
        getattr(ao, "Float8WeightOnlyConfig", None), getattr(ao, "Int8WeightOnlyConfig", None), ao.quantize_
    )  # fmt: skip

    config = Int8WeightOnlyConfig() if method == "int8wo" else Float8WeightOnlyConfig()
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = {id(m) for n, m in modules if not any(k + "." in n or k == n for k in skip)}
    if not chosen:
        raise ValueError(f"{type(model).__name__} has no linear layer to quantize outside skip={skip}")
    saved = [(m, dict(m.__dict__), dict(m._parameters)) for _, m in modules if id(m) in chosen]

    def undo() -> None:
        for m, attrs, params in saved:
            for key in set(m.__dict__) - set(attrs):
                del m.__dict__[key]
            m._parameters.update(params)

    try:
        quantize_(model, config, filter_fn=lambda m, name: id(m) in chosen)
        for m, _, _ in saved:  # torchao's weight-only tensors give no weight gradient
            m.requires_grad_(False)
    except BaseException:
        undo()
        raise
    return undo


def _fake_to_forward(forward, *args, **kwargs):
    """A cast layer's forward: its hook's ``Module.to`` on fake weights through ``fake_module_to_in_place`` (torch's
    swap refuses a fake parameter; the parameter objects stay, as on real weights); on real weights torch's own."""
    from .._optimizer_adapters import _fake_mode
    from .._torch_compat import fake_module_to_in_place

    if _fake_mode() is None:
        return forward(*args, **kwargs)
    with fake_module_to_in_place():
        return forward(*args, **kwargs)


def refuse_training_without_adapters(model: nn.Module) -> None:
    """For :meth:`memkit.Step.bind`: a ValueError when an optimizer would train a quantized model that has no
    adapters (full fine-tuning of a quantized base: its quantized weights cannot train).

    Example:
        >>> refuse_training_without_adapters(model)     # after Quantize and LoRA: nothing
    """
    if _MARK in model.__dict__ and not getattr(model, "peft_config", None):
        raise ValueError(
            f"cannot fully fine-tune a quantized base ({model.__dict__[_MARK]}): its quantized weights are frozen "
            "(bitsandbytes, torchao and layerwise casting store them for inference); add memkit.LoRA (--lora) to "
            "train adapters on it (QLoRA), or train without quantization"
        )
