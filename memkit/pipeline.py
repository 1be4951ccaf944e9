"""The whole job, not only the step: the pipeline's other parts (text encoders, VAE), where each lives, and the
phases a run goes through (load, precompute, training or denoising, validation, saving).

A training step estimate (:func:`memkit.estimate`) counts the transformer alone, with its inputs as the cached
embeddings and latents of the usual training setup. :func:`estimate_job` adds what else the run keeps on the GPU and
when: each component placed on the GPU (resident), in CPU memory (moved to the GPU when used, then back), or not
loaded (``"precomputed"``: its outputs read from a cache), and the phases outside the step, each a Timeline of its
own. The job's peak is the largest phase's, with the phase named.

How each phase is built (the assumptions are the scripts', and each is named in the docs of :class:`Pipeline`):

- ``load``: the transformer's weights as the step holds them (quantized, with adapters) arrive on the device, then
  the components placed on the GPU. ``quantize_on="gpu"`` loads the transformer in its ``dtype`` first and runs the
  quantization there (the real library's code on fake tensors, tracked): every weight in ``dtype`` is resident
  while the first layers are quantized. Host memory holds the checkpoint being loaded (the transformer's weights
  in ``dtype``) and the components placed on the CPU.
- ``precompute`` (``Pipeline(precompute=True)``): each component marked ``"precomputed"`` moves to the GPU in turn,
  beside the loaded transformer (diffusers' training scripts' order), encodes a batch, and leaves.
- ``training``: the estimate's steps, with the resident components' weights beside them and, at the start of each
  step, each live component encoding the batch (a component on the CPU is moved on for it and off after).
- ``validation`` (``validate=(every, steps)``): after a training step, with its optimizer state (and EMA) still
  resident, one denoising step of the transformer in inference (classifier-free guidance as ``cfg`` says) and the VAE
  decode of its latents (a VAE not loaded for training is loaded for it: moved on and off, as on the CPU).
- ``saving``: the trained weights copied to host memory (``save_pretrained``/``save_lora_weights``); nothing new
  on the device.
- inference jobs: ``load``, ``encode`` (the text encoders as placed), ``denoise`` (one step; ``cfg="batch"``
  doubles the batch, ``"separate"`` runs two passes and keeps the first's prediction) and ``decode``.

The reserved bytes come from one caching-allocator replay through the phases in order, as the process runs them: a
pipeline call's encode, denoise and decode share its cache; training then validation too, but the training scripts'
``free_memory()`` empties it after precomputing and after validation.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import gpus
from ._job import Job, Phase
from ._phases import (
    _VAE_LOWER_BOUND,
    _component_run,
    _Compose,
    _continuous_reserved,
    _denoise,
    _fix_categories,
    _inference_kept,
    _live_at_end,
    _quantize_on_device,
    _renamed,
)
from .memory.events import ALLOC, FREE

__all__ = [
    "PLACEMENTS",
    "CFG",
    "QUANTIZE_ON",
    "Pipeline",
    "Job",
    "Phase",
    "components",
    "estimate_job",
    "parse_validate",
]


def components(preset: str) -> tuple:
    """The text encoders and the VAE of ``preset``'s pipeline, in its order: each a ``Component`` with its released
    config, parameter count and the published figure it was checked against (a ValueError for a preset without a
    catalog names those with one).

    Example:
        >>> [(c.name, c.class_name, c.parameters) for c in memkit.pipeline.components("flux")]
    """
    from ._components import components as catalog

    return catalog(preset)


PLACEMENTS = ("precomputed", "gpu", "cpu")
"""Where a component lives: not loaded (its outputs cached), on the GPU, or in CPU memory (moved on when used)."""

CFG = (None, "batch", "separate")
"""Classifier-free guidance in inference: none (a guidance-distilled model: Flux-dev), the conditional and
unconditional inputs in one doubled batch (diffusers' pipelines), or two passes of the batch."""

QUANTIZE_ON = ("cpu", "gpu")
"""Where a quantized base is quantized while loading: in host memory (then moved), or on the GPU after the
checkpoint in ``dtype`` is loaded there."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What the run keeps beside the transformer, and the phases it goes through (see :mod:`memkit.pipeline`).

    Example:
        >>> job = memkit.estimate_job("flux", memkit.Pipeline(text_encoders="gpu", validate=(100, 28)),
        ...                           optimizations=[memkit.LoRA(rank=16), memkit.Checkpointing()])
        >>> job.peak_phase, job.peak_reserved_bytes / 2**30, job.peak_by_component
    """

    text_encoders: str = "precomputed"
    """Every text encoder's placement: ``"precomputed"`` (default: not loaded; the cached embeddings are the step's
    inputs), ``"gpu"`` or ``"cpu"``."""
    vae: str = "precomputed"
    """The VAE's placement, as ``text_encoders``."""
    cfg: str | None = None
    """Classifier-free guidance of an inference (or validation) denoising step: one of :data:`CFG`."""
    vae_tiling: bool = False
    """Decode (and encode) with the VAE's own ``enable_tiling()``."""
    vae_slicing: bool = False
    """Decode a batch one sample at a time (the VAE's ``enable_slicing()``)."""
    precompute: bool = False
    """Training: the job includes the precompute phase (each ``"precomputed"`` component encoding on the GPU)."""
    validate: tuple[int, int] | None = None
    """Training: ``(every, steps)``: sample every ``every`` training steps with ``steps`` denoising steps (the memory
    is one denoising step's and the decode's; the counts are for the job's time). None: no validation."""
    quantize_on: str = "cpu"
    """Where a :class:`memkit.Quantize` base is quantized while loading: one of :data:`QUANTIZE_ON`."""

    def __post_init__(self) -> None:
        for name in ("text_encoders", "vae"):
            value = getattr(self, name)
            if value not in PLACEMENTS:
                raise ValueError(f"{name} must be one of {list(PLACEMENTS)}, got {value!r}")
        if self.cfg not in CFG:
            raise ValueError(f"cfg must be one of {list(CFG)}, got {self.cfg!r}")
        if self.quantize_on not in QUANTIZE_ON:
            raise ValueError(f"quantize_on must be one of {list(QUANTIZE_ON)}, got {self.quantize_on!r}")
        for name in ("vae_tiling", "vae_slicing", "precompute"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.validate is not None:
            v = self.validate
            if isinstance(v, str):
                object.__setattr__(self, "validate", v := parse_validate(v))
            if (
                not isinstance(v, tuple)
                or len(v) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)
            ):
                raise ValueError(f"validate must be None or (every, steps), two positive ints, got {v!r}")

    @property
    def components_used(self) -> bool:
        """Whether the job needs the preset's component catalog (anything beside the transformer alone)."""
        return (
            self.text_encoders != "precomputed" or self.vae != "precomputed" or self.precompute
            or self.validate is not None
        )  # fmt: skip

    def __str__(self) -> str:
        parts = [f"text encoders {self.text_encoders}", f"VAE {self.vae}"]
        if self.cfg:
            parts.append(f"CFG {self.cfg}")
        if self.vae_tiling:
            parts.append("VAE tiling")
        if self.vae_slicing:
            parts.append("VAE slicing")
        if self.precompute:
            parts.append("precompute")
        if self.validate:
            parts.append(f"validate {self.validate[0]}:{self.validate[1]}")
        if self.quantize_on != "cpu":
            parts.append(f"quantize on {self.quantize_on}")
        return ", ".join(parts)


def parse_validate(text: str) -> tuple[int, int]:
    """``"EVERY:STEPS"`` (the command line's ``--validate``) as ``(every, steps)``.

    Example:
        >>> parse_validate("100:28")
        (100, 28)
    """
    every, sep, steps = str(text).partition(":")
    try:
        value = (int(every), int(steps))
    except ValueError:
        value = None
    if not sep or value is None or min(value) < 1:
        raise ValueError(f"validate must be EVERY:STEPS, two positive integers (e.g. 100:28), got {text!r}")
    return value


def estimate_job(
    model: str,
    pipeline: Pipeline | None = None,
    *,
    size: str = "full",
    mode: str = "training",
    batch_size: int = 1,
    dtype: torch.dtype | None = None,
    device: str = "cuda",
    optimizations: Sequence = (),
    alloc_conf: str = "",
    gpu: str | gpus.GPU | None = None,
    progress: bool | None = None,
    **kwargs: Any,
) -> Job:
    """Estimate a whole run: its phases (load, precompute, training or denoising, validation, saving, decode), each a
    timeline, with the pipeline's components placed as ``pipeline`` says (see :mod:`memkit.pipeline`).

    Args:
        model: a preset name (the components come from the preset's pipeline: :func:`memkit.pipeline.components`;
            at ``size="full"`` their released configs, at another size their tiny ones). A model that is no preset,
            or a preset without a catalog, takes only the default ``Pipeline()`` (the transformer alone).
        pipeline: a :class:`Pipeline`; None is ``Pipeline()``: the transformer alone, its inputs precomputed (the
            phases are then load, training and saving; the training phase is :func:`memkit.estimate`'s).
        size, mode, batch_size, dtype, device, optimizations, alloc_conf, progress, **kwargs: as
            :func:`memkit.estimate` (the training step's settings; ``kwargs`` holds the step's recipe and the input
            sizes, ``height=``, ``frames=``...). The components run in ``dtype`` (bf16 under ``mixed_precision``: the
            scripts cast frozen components to the weight dtype) at the same input sizes.
        gpu: judge the job's peak reserved bytes against this card (``job.meta`` gains ``fits``, ``verdict``...).

    Returns a :class:`Job`: ``job.phases`` (name -> :class:`Phase`, each with its ``timeline``), ``peak_bytes``,
    ``peak_reserved_bytes``, ``peak_phase``, ``peak_by_phase``, ``peak_by_component``, ``host_peak_bytes``,
    ``parameters_by_component``, and ``job.step``: the step's own estimate.

    Example:
        >>> job = memkit.estimate_job("flux", memkit.Pipeline(text_encoders="gpu", vae="gpu"),
        ...                           optimizations=[memkit.LoRA(rank=16)])
        >>> job.peak_phase, job.peak_by_component["text_encoder_2"] / 2**30
    """
    import memkit  # memkit.estimate, looked up when called (a test or a wrapper may stand in for it)

    estimate = memkit.estimate
    t0 = time.perf_counter()
    pipeline = Pipeline() if pipeline is None else pipeline
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a memkit.Pipeline or None, got {type(pipeline).__name__}")
    given_step = kwargs.get("step")  # a memkit.Step says the mode itself
    if given_step is not None:
        mode = given_step.mode
    if mode not in ("training", "inference"):
        raise ValueError(f"mode must be 'training' or 'inference', got {mode!r}")
    training = mode == "training"
    if not training and (pipeline.validate is not None or pipeline.precompute):
        raise ValueError("validate and precompute are phases of a training job; mode='inference' has neither")
    if training and pipeline.cfg is not None and pipeline.validate is None:
        raise ValueError("cfg applies to inference and to validation: give mode='inference' or validate=(every, steps)")
    card = None if gpu is None else gpus.find(gpu)
    if card is not None and device != "cuda":
        raise ValueError(f"gpu={gpu!r} judges a device='cuda' estimate's reserved peak; got device={device!r}")
    comps: tuple = ()
    preset = None
    if pipeline.components_used:
        from .naming import resolve

        ref = resolve(model) if isinstance(model, (str, os.PathLike)) else None
        preset = ref.preset if ref is not None else None
        if preset is None:
            raise ValueError(
                f"the pipeline's components come from a preset's pipeline; {model!r} is no preset (give a preset "
                f"name, or Pipeline() for the transformer alone)"
            )
        from . import _components

        comps = _components.components(preset)
    from .models import PRESETS

    cuda = device == "cuda"
    step_kwargs = dict(
        size=size, batch_size=batch_size, dtype=dtype, device=device, optimizations=list(optimizations),
        alloc_conf=alloc_conf, progress=progress, **kwargs,
    )  # fmt: skip
    denoise_batch = batch_size * (2 if pipeline.cfg == "batch" else 1)
    if training:
        step = estimate(model, **({} if given_step is not None else {"mode": "training"}), **step_kwargs)
    else:
        step = estimate(
            model,
            **({} if given_step is not None else {"mode": "inference"}),
            **{**step_kwargs, "batch_size": denoise_batch},
        )
    step_dtype = getattr(torch, step.meta["dtype"])
    comp_dtype = torch.bfloat16 if step.meta.get("mixed_precision") else step_dtype
    sizes = {}
    if preset is not None:
        given = {k: v for k, v in kwargs.items() if k in ("height", "width", "frames", "text_len")}
        sizes = {**PRESETS[preset].input_sizes[size], **given}
    csize = "full" if size == "full" else "tiny"

    names = ["transformer", *[c.name for c in comps]]
    text = [c for c in comps if c.role == "text_encoder"]
    vae = [c for c in comps if c.role == "vae"]

    def run(c, part, batch):
        return _component_run(
            c, csize, part, batch_size=batch, sizes=sizes, tiling=pipeline.vae_tiling, slicing=pipeline.vae_slicing,
            dtype=comp_dtype, device=device,
        )  # fmt: skip

    def placement(c) -> str:
        return pipeline.text_encoders if c.role == "text_encoder" else pipeline.vae

    def weight_bytes(c) -> int:
        _, w, b = _weights_of(c)
        return sum(n for _, n in w) + sum(n for _, n in b)

    def _weights_of(c):
        part = "encode" if c.role == "text_encoder" else "decode"
        return run(c, part, batch_size)

    on_gpu = [c for c in comps if placement(c) == "gpu"]
    on_cpu = [c for c in comps if placement(c) == "cpu"]
    host_components = sum(weight_bytes(c) for c in on_cpu)
    device_name = step.devices[0] if step.devices else ("cuda" if cuda else "cpu")

    def new() -> _Compose:
        return _Compose(names, device_name, cuda)

    stable: dict[str, tuple[list, list]] = {}

    def blocks_of(c) -> tuple[list, list]:
        """A component's weight and buffer blocks under keys of its own for the whole job (each phase that holds it
        holds the same storages)."""
        if c.name not in stable:
            _, w, b = _weights_of(c)
            stable[c.name] = (_renamed(w), _renamed(b))
        return stable[c.name]

    def add_resident(comp_: _Compose, cs) -> None:
        for c in cs:
            w, b = blocks_of(c)
            comp_.resident(c.name, "parameter", w)
            comp_.resident(c.name, "buffer", b)

    def add_run(comp_: _Compose, c, part, batch, *, moved: bool) -> None:
        tl, _, _ = run(c, part, batch)
        if cuda and c.role == "vae":
            comp_.lower_bound.append(_VAE_LOWER_BOUND)
        blocks = [*blocks_of(c)[0], *blocks_of(c)[1]]
        if moved:
            comp_.move(c.name, blocks, ALLOC)
        comp_.events(tl, c.name)
        if moved:
            comp_.move(c.name, blocks, FREE)

    transformer_blocks = [(k, n) for k, n, _ in (step.baseline_blocks or []) if k not in step.input_keys]
    phases: dict[str, Phase] = {}
    itemsize = torch.empty(0, dtype=step_dtype).element_size()
    checkpoint_bytes = int(step.meta["parameters"]) * itemsize
    quantize = [o for o in optimizations if type(o).__name__ == "Quantize"]

    # load
    c = new()
    note = ""
    if quantize and pipeline.quantize_on == "gpu":
        tl = _quantize_on_device(model, quantize[0], size=size, dtype=step_dtype, device=device,
                                 seed=kwargs.get("seed", 0))  # fmt: skip
        c.move("transformer", [(k, n) for k, n, _ in tl.baseline_blocks], ALLOC)
        c.events(tl, "transformer", keep_keys=True)
        note = f"the checkpoint in {step.meta['dtype']} loaded on the device, then quantized there"
    else:
        c.move("transformer", transformer_blocks, ALLOC)
    for comp_ in on_gpu:
        _, w, b = _weights_of(comp_)
        c.move(comp_.name, [*blocks_of(comp_)[0], *blocks_of(comp_)[1]], ALLOC)
    load_host = checkpoint_bytes + host_components
    if quantize and pipeline.quantize_on == "cpu":  # the quantized copy made beside the checkpoint, then moved
        load_host += sum(n for _, n in transformer_blocks)
    phases["load"] = c.phase(
        "load",
        host_bytes=load_host,
        alloc_conf=alloc_conf,
        note=note or ("quantized in host memory, then moved" if quantize else ""),
    )

    def loaded() -> _Compose:
        c_ = new()
        c_.resident("transformer", "parameter", transformer_blocks)
        add_resident(c_, on_gpu)
        return c_

    step_host = sum(int(v) for v in (step.meta.get("host_bytes") or {}).values())
    if training:
        precomputed = [x for x in comps if placement(x) == "precomputed"]
        if pipeline.precompute and precomputed:
            c = loaded()
            for x in precomputed:
                add_run(c, x, "encode", batch_size, moved=True)
            phases["precompute"] = c.phase("precompute", host_bytes=host_components, alloc_conf=alloc_conf,
                                           note="each precomputed component on the device in turn, beside the "
                                           "loaded transformer")  # fmt: skip
        # training: the step's events, the resident components beside them, each live component encoding the
        # batch at the start of each step
        c = new()
        for k, n, _ in step.baseline_blocks or []:
            c.resident("transformer", "input" if k in step.input_keys else "parameter", [(k, n)])
        _fix_categories(c, step)
        add_resident(c, on_gpu)
        live = [x for x in comps if placement(x) != "precomputed"]
        starts = list(step.meta.get("step_starts") or [0])
        bounds = [*starts[1:], None]
        for s, e in zip(starts, bounds, strict=True):
            for x in live:
                add_run(c, x, "encode", batch_size, moved=placement(x) == "cpu")
            c.events(step, "transformer", keep_keys=True, start=s, stop=e)
        phases["training"] = c.phase("training", host_bytes=step_host + host_components, alloc_conf=alloc_conf)
        end_state = _live_at_end(step)
        if pipeline.validate is not None:
            training_only = ("step", "optimizer", "steps", "grad_accum", "fused_backward", "optimizer_on",
                             "offload_gradients")  # fmt: skip
            val = estimate(model, mode="inference", **{
                **{k: v for k, v in step_kwargs.items() if k not in training_only}, "batch_size": denoise_batch,
                "optimizations": [o for o in optimizations if _inference_kept(o)],
            })  # fmt: skip
            c = new()
            for k, n, cat in end_state:
                c.resident("transformer", cat, [(k, n)])
            add_resident(c, on_gpu)
            for x in text:
                if placement(x) != "precomputed":
                    add_run(c, x, "encode", batch_size, moved=placement(x) == "cpu")
            _denoise(c, val, pipeline)
            for x in vae:
                add_run(c, x, "decode", batch_size, moved=placement(x) != "gpu")
            phases["validation"] = c.phase(
                "validation", host_bytes=step_host + host_components, alloc_conf=alloc_conf,
                note=f"one denoising step (of {pipeline.validate[1]}, every {pipeline.validate[0]} training steps) and "
                "the decode, beside the training state" + (
                    "; the VAE loaded for it" if pipeline.vae == "precomputed" else ""),
            )  # fmt: skip
        c = new()
        for k, n, cat in end_state:
            c.resident("transformer", cat, [(k, n)])
        add_resident(c, on_gpu)
        saved = int(step.meta.get("trainable_bytes") or 0)
        phases["saving"] = c.phase("saving", host_bytes=step_host + host_components + saved, alloc_conf=alloc_conf,
                                   note="the trained weights copied to host memory")  # fmt: skip
    else:
        if any(placement(x) != "precomputed" for x in text):
            c = loaded()
            for x in text:
                if placement(x) != "precomputed":
                    add_run(c, x, "encode", batch_size, moved=placement(x) == "cpu")
            phases["encode"] = c.phase("encode", host_bytes=host_components, alloc_conf=alloc_conf)
        c = new()
        for k, n, _ in step.baseline_blocks or []:
            c.resident("transformer", "input" if k in step.input_keys else "parameter", [(k, n)])
        _fix_categories(c, step)
        add_resident(c, on_gpu)
        _denoise(c, step, pipeline, events_only=True)
        phases["denoise"] = c.phase(
            "denoise",
            host_bytes=step_host + host_components,
            alloc_conf=alloc_conf,
            note={
                None: "",
                "batch": "the batch doubled for classifier-free guidance",
                "separate": "two passes; the first's prediction kept",
            }[pipeline.cfg],
        )
        if any(placement(x) != "precomputed" for x in vae):
            c = loaded()
            for x in vae:
                add_run(c, x, "decode", batch_size, moved=placement(x) == "cpu")
            phases["decode"] = c.phase("decode", host_bytes=host_components, alloc_conf=alloc_conf)

    if cuda:
        empty_after = {"precompute", "validation"} if training else set()
        _continuous_reserved(list(phases.values()), empty_after, alloc_conf)
    counts = {"transformer": int(step.meta["parameters"])}
    for x in comps:
        counts[x.name] = int(
            x.parameters
            if csize == "full"
            else sum(n for _, n in _weights_of(x)[1]) // torch.empty(0, dtype=comp_dtype).element_size()
        )
    job = Job(phases, names, step, pipeline, counts)
    job.meta.update(
        model=model, size=size, mode=mode, device=device, seconds=time.perf_counter() - t0,
        bytes="allocated and reserved" if cuda else "allocated",
        measured=step.meta.get("measured"),
    )  # fmt: skip
    if card is not None:
        verdict = gpus.verdict(job.peak_reserved_bytes, card)
        job.meta.update(gpu=card.key, gpu_name=card.name, usable_bytes=list(card.usable_bytes()), fits=verdict.fits,
                        verdict=verdict.status, headroom_bytes=verdict.headroom_bytes)  # fmt: skip
    return job
