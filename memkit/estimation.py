"""Estimate a step's memory without allocating it: the same tracker, run on fake tensors.

Under ``FakeTensorMode`` every op computes only shapes, dtypes and strides, so a 12B-parameter model's
training step runs in seconds and a few hundred MiB of RAM while the tracker adds up the storages it would
have allocated. Fake CPU tensors are used (not the meta device: meta picks the math attention path and
overestimates; not fake "cuda": that crashes on a CPU build).

What an estimate for ``device="cuda"`` models: the caching allocator's rounding (every block a multiple of
512 bytes), so the peak compares with ``torch.cuda.max_memory_allocated``. What it does not model: the
CUDA context (~300–500 MiB per process, outside the allocator), cuBLAS/cuDNN workspaces, and kernel choices
that differ between CPU and CUDA (attention backends). Reserved bytes (allocated plus what the caching allocator
keeps cached) come from replaying the events through a model of that allocator (``timeline.reserved_bytes``).

State an optimization keeps in host memory while the parameters are on the accelerator (an EMA with
``mode="offload"`` or ``"cpu_only"``) is not in the device timeline: the optimization reads
:func:`planned_device` to know its fake CPU parameters stand for ``"cuda"`` ones and marks that state with
:func:`note_host_memory`; tensors made during the step that leave the device (checkpoint inputs offloaded by
``Checkpointing(provider="offload")``) are made under :func:`memkit.memory.off_device`.
``timeline.meta["host_bytes"]`` reports both by category. FSDP's CPU offload (``memkit.FSDP(cpu_offload=True)``)
notes its parameter shards the same way; the tracker then keeps their gradients and the optimizer's state and
step (which runs on the host) off the device too (:func:`memkit.memory.host_state`). Weights an
``Offload(to="disk")`` keeps on disk are noted with :func:`note_disk_memory` and reported in
``timeline.meta["disk_bytes"]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten
from tqdm.auto import tqdm

from . import _memo, _memo_period, _memo_tagger, _splice, _steady, gpus
from ._results import _cache_key, _lookup, _store, clear_cache
from ._step_peaks import _NO_RESERVED, _reserved, _step_of, _step_peaks
from ._torch_compat import known_values, sized_by_values
from .handle import Optimization, apply_all
from .memory._allocator_config import parse_conf
from .memory._fake_dispatch import FakeDispatchCache
from .memory.events import CUDA_BLOCK
from .memory.placement import note_disk_memory, note_host_memory, noted_in_host, planned_device, planning
from .memory.recording import _owned_of, track
from .memory.timeline import Timeline
from .models import _build, _default_dtype, config_preset, load_model, make_inputs
from .naming import resolve, unestimable
from .parallel import FSDP, on_local_shards, refuse_group_offload, sharded_order, split_parallel
from .step import Step

__all__ = ["clear_cache", "estimate", "noted_in_host", "note_disk_memory", "note_host_memory", "planned_device"]


def _storage_keys(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def estimate(
    model: str | Callable[[], torch.nn.Module],
    inputs: Callable[[torch.nn.Module], Mapping[str, Any]] | None = None,
    *,
    mode: str = "training",
    step: Step | None = None,
    optimizations: Sequence[Optimization] = (),
    dtype: torch.dtype | None = None,
    size: str = "full",
    optimizer: str | None = "auto",
    steps: int | None = None,
    batch_size: int = 1,
    device: str = "cuda",
    seed: int = 0,
    progress: bool | None = None,
    parallel: FSDP | None = None,
    memoize: bool = True,
    grad_accum: int = 1,
    mixed_precision: str | None = None,
    fused_backward: bool = False,
    optimizer_on: str = "device",
    offload_gradients: bool = False,
    alloc_conf: str = "",
    gpu: str | gpus.GPU | None = None,
    count_ops: bool = False,
    **sizes: int,
) -> Timeline:
    """Estimate the memory of a training (or inference) step without allocating real memory (fake tensors).

    By default it answers the question users bring, with the command line's defaults: a bf16 AdamW training
    step on a GPU (``device="cuda"``), measured on both steps that matter. The first step creates the
    optimizer state in its update; every later step carries that state (and an EMA, accumulated gradients,
    offloaded copies, FSDP shards) through its forward and backward. The timeline covers the first step and
    the steady step (step 2, which every later step repeats); ``timeline.meta["first_step_peak_bytes"]`` and
    ``["steady_peak_bytes"]`` hold each one's peak, and ``timeline.peak_bytes`` is the larger. An estimate
    with the same arguments again in the same process returns a copy of the first one's timeline at once.

    Args:
        model: a preset name (built at ``size``, default the released ``"full"`` config) or a callable
            returning a model; it is called inside fake mode, so it must build on CPU and set its dtype by
            construction (``torch.set_default_dtype`` is set to ``dtype`` around the call), never ``.to()``.
        inputs: a callable ``inputs(model)`` returning the forward kwargs, or None for
            ``memkit.make_inputs(model, batch_size, **sizes)``.
        mode: ``"training"`` (forward, loss, backward, optimizer step if any) or ``"inference"``.
        step: the :class:`memkit.Step` to run, instead of ``mode``, ``optimizer``, ``steps`` and ``grad_accum``
            (give one or the others). Its ``foreach`` defaults to what torch uses on ``device``.
        optimizations: optimization objects, applied with ``.apply(model)`` as in a real run; the memory
            their handles own is counted in its category. A :class:`memkit.FSDP` among them is ``parallel``.
        dtype: parameter and input dtype: None (default) is bf16, or fp32 under ``mixed_precision`` (its master
            weights are fp32). A lower dtype with ``mixed_precision`` is a frozen base whose trained parameters are
            fp32 (the LoRA scripts: ``dtype=torch.bfloat16``, ``LoRA(dtype=torch.float32)``); a trained parameter
            in another dtype is a ValueError naming ``mixed_precision``.
        optimizer: ``"auto"`` (AdamW in training, none in inference), a name in
            :data:`memkit.optimizers.OPTIMIZERS` (``"adamw"``, ``"adamw8bit"``, ``"prodigy"``...) or None (training
            only). With None, gradients accumulate across steps as in a loop of ``loss.backward()``.
        steps: None (default): in training the first and the steady step, both measured (see above); in
            inference one pass. An int N: run N steps and measure only the last (``steps=1``: the first step).
        grad_accum: micro-batches per step (:attr:`memkit.Step.grad_accum`): the gradients of the first live
            through the forward and backward of every later one.
        mixed_precision: ``"bf16"`` or ``"fp16"`` (:attr:`memkit.Step.mixed_precision`): fp32 weights, gradients
            and optimizer state, the forward under CPU autocast (the estimate's tensors are fake CPU ones; where
            CUDA's op list differs, ``memkit._precision`` says), fp16 with a gradient scaler. None: pure ``dtype``.
        fused_backward: update each parameter and free its gradient in the backward
            (:attr:`memkit.Step.fused_backward`).
        optimizer_on: ``"device"`` (default) or ``"cpu"``: torchao's ``CPUOffloadOptimizer``
            (:attr:`memkit.Step.optimizer_on`); in an estimate for ``"cuda"`` its host copies of the parameters and
            gradients, the optimizers' state and their step's temporaries are in ``meta["host_bytes"]``
            (``"parameter"``, ``"gradient"``, ``"optimizer_state"``, ``"temporary"``), off the device timeline.
        offload_gradients: with ``optimizer_on="cpu"``, each device gradient freed once copied to the host
            (:attr:`memkit.Step.offload_gradients`).
        device: the device being estimated: ``"cuda"`` (default: adds the CUDA allocator's 512-byte rounding,
            drops CPU-only kernel buffers, and uses foreach optimizers as torch does on CUDA, except for an
            optimizer FSDP's CPU offload runs on the CPU) or ``"cpu"`` (CPU kernels' own buffers, learned once
            per signature and kept in the user's cache folder).
        progress: show a progress bar (build, then each step); None shows it for full-size presets.
        parallel: a :class:`memkit.FSDP`: the timeline of rank 0 of a fully sharded run over its world size
            (torch's FSDP2 on a fake process group, started for the estimate and ended after it unless one is
            running). The optimizations are applied before the sharding, an EMA after it (on the shards). The
            same FSDP among ``optimizations`` gives the same estimate; two FSDPs are a ValueError.
            ``memkit.Offload`` is refused with it: FSDP's own ``FSDP(cpu_offload=True)`` is the offload that
            composes with sharding.
        memoize: run the model with each list of identical blocks cut to four (the first three and the last) and
            splice the full timeline from theirs (:mod:`memkit._memo`): byte-equal to running every block, ~5-10x
            faster at full size (full Flux: ~2-3 s instead of ~20 s; with an EMA ~2 s instead of ~13 s). An EMA is
            memoized in every mode (its one buffer of shadows grown by the blocks the probe leaves out), FSDP too.
            Checkpointing every N-th block (``"every:N"``, ``"skip-every:N"``) is memoized too, the probe keeping
            a period of N blocks where it kept one (full Flux with ``"every:2"``: ~3x faster). Settings whose
            memory is not a sum over identical blocks (offload, FSDP's CPU offload, mixed precision, a host optimizer,
            checkpointing some blocks in no period: a tuple of blocks, ``"first:K"``, ``"last:K"``), a staged or host
            EMA (``mode="offload"``, ``"cpu_only"`` or a ``dtype``) in an estimate that counts its ops (``count_ops``)
            and models without such a list run every block; ``meta["memoized"]`` says which happened and
            ``meta["memo"]`` why. The probe's
            steady step runs only its update: its forward and backward are the first step's on other storages
            (:mod:`memkit._steady`; ``meta["steady_derived"]``), where nothing but the optimizer's state differs
            between the two steps. False runs every block and both steps whole (the reference the memoized
            timeline is tested against).
        alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` string (``"expandable_segments:True"``, ``"max_split_size_mb:512"``)
            for the caching allocator the ``"cuda"`` events are replayed through (a bad option is a ValueError
            naming it); ``""`` is torch's defaults. Unused for another device.
        gpu: a GPU to judge the reserved peak against (``"4090"``, ``"h100"``, ``"24GiB"``, or a `memkit.gpus.GPU`
            such as ``memkit.gpus.local()``; only with ``device="cuda"``):
            ``meta`` gains ``fits``, ``verdict`` (fits / within the spread / does not fit),
            ``headroom_bytes``, ``usable_bytes`` and the card's names (see :func:`memkit.gpus.judge`).
        count_ops: also count the steady step's ops as it runs (``timeline.op_counts``, a
            :class:`memkit.steptime.OpCounts`; :func:`memkit.steptime.step_seconds` makes a step time of them): the
            ops :func:`memkit.steptime.count_ops` counts, at a fraction of its cost (no runs of its own; a memoized
            estimate's probe blocks weighted by the blocks each stands for, :mod:`memkit._counted`).

    Returns the :class:`Timeline` of the measured steps; ``timeline.meta`` holds the settings, the parameter count
    (``parameters``; ``trainable_parameters``: those the step trains, e.g. only the adapters under
    :class:`memkit.LoRA`, 0 in inference; ``trainable_bytes``: their bytes), ``measured`` (``"first and steady"``,
    ``"first"``, ``"steady"`` or ``"inference"``), ``step_starts`` (the index of each measured step's first event),
    ``first_step_peak_bytes`` and ``steady_peak_bytes`` (None where that step was not measured; in inference both
    are the one pass's peak: no state lives across passes),
    ``host_bytes`` (category -> bytes the optimizations keep in host memory, off a ``"cuda"`` peak: an
    offloaded EMA's shadows, the most offloaded checkpoint inputs alive at once as ``"activation"``, offloaded
    weights as ``"parameter"``; under ``FSDP(cpu_offload=True)`` rank 0's parameter shards as ``"parameter"``,
    the most gradient shards, optimizer state and host-side optimizer temporaries alive at once as
    ``"gradient"``, ``"optimizer_state"``, ``"temporary"``), ``disk_bytes`` (weights ``Offload(to="disk")``
    keeps on disk), ``memoized`` and ``memo`` (see ``memoize``) and the seconds the estimate took.

    Reserved bytes (``device="cuda"``; None for another device): every device allocation and free of the window, in
    order and rounded as the allocator sees them, after the baseline's storages, is replayed through
    :class:`memkit.memory.caching_allocator.CachingAllocator` (:mod:`memkit.memory.reserved`);
    ``timeline.reserved_bytes`` is the series beside ``live_bytes``, ``timeline.peak_reserved_bytes`` its peak
    (``max_memory_reserved``: what a GPU runs out of). In ``meta``: ``peak_reserved_bytes`` (over the window),
    ``first_step_peak_reserved_bytes`` and ``steady_peak_reserved_bytes`` (each step's reserved peak; the steady
    step starts with the segments the first left cached, as on a GPU, so it is never below the first's),
    ``fragmentation_bytes`` (reserved minus allocated bytes at the reserved peak, at its fullest moment: reserved
    never falls in the replay, so its peak lasts, and this is its least slack: cached free blocks and segment
    tails), ``alloc_conf`` and ``unmatched_frees`` (frees the replay could not pair: 0 unless something is wrong).
    Not modelled: the CUDA context and cuBLAS/cuDNN workspaces (outside the allocator). With ``steps=N`` (N > 1) the
    window's baseline (the earlier steps' optimizer state, gradients) is allocated fresh in the replay, not laid out
    as those steps left it.

    A model whose forward sizes a tensor by the values of another (a mixture of experts routing tokens: HiDream-I1)
    is a NotImplementedError that says so: fake tensors hold no values, and the real memory follows them
    (:func:`memkit.compare` measures a real step).

    Example:
        >>> tl = memkit.estimate("flux", optimizations=[memkit.Checkpointing()])   # bf16 AdamW on a GPU
        >>> tl.peak_bytes / 2**30, tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"]
    """
    step = _step_of(
        step,
        mode,
        optimizer,
        steps,
        grad_accum=grad_accum,
        mixed_precision=mixed_precision,
        fused_backward=fused_backward,
        optimizer_on=optimizer_on,
        offload_gradients=offload_gradients,
    )
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dtype is None:  # mixed precision keeps fp32 master weights; a pure-dtype step is bf16 by default
        dtype = torch.float32 if step.mixed_precision is not None else torch.bfloat16
    # under mixed precision a lower dtype is the frozen base of the LoRA scripts (adapters in fp32: LoRA(dtype=
    # torch.float32)); Step.bind refuses it where a trained parameter is not fp32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    preset = None  # the Preset an estimate by name builds (a config that is no preset gets one of its own)
    key_model = model
    if isinstance(model, (str, os.PathLike)):
        ref = resolve(model)  # a preset, its hub id, a folder, a config.json, a hub id: ValueError otherwise
        why = unestimable(ref.class_name)
        if why is not None:
            raise NotImplementedError(
                f"{os.fspath(model)} is a {ref.class_name}, which memkit cannot estimate: {why}; measure a real step "
                "with memkit.compare"
            )
        if ref.preset is None and size != "full":
            raise ValueError(
                f"size={size!r} applies to presets; {os.fspath(model)} is a config, one size (its own): leave "
                "size='full'"
            )
        preset = config_preset(ref)
        if preset.inputs is None and inputs is None:
            raise ValueError(
                f"{os.fspath(model)} is a {ref.class_name}, whose inputs memkit cannot build (no preset has this "
                "class): pass inputs=lambda model: {...}, the keyword arguments of its forward"
            )
        model = ref.preset or os.fspath(model)
        # a config's key is its content (the file may change between two estimates), a preset's its name
        key_model = model if ref.preset else f"{ref.class_name}:{json.dumps(dict(ref.config), sort_keys=True)}"

        def model_fn():
            if ref.preset is not None:
                return load_model(ref.preset, size=size, dtype=dtype, seed=seed)
            return _build(preset, size, dtype, seed, torch.device("cpu"))
    elif callable(model):
        model_fn = model
    else:
        raise TypeError(f"model must be a preset name or a callable returning a model, got {type(model).__name__}")
    if inputs is not None and not callable(inputs):
        raise TypeError("inputs must be a callable inputs(model) -> forward kwargs, or None")
    if parallel is not None and not isinstance(parallel, FSDP):
        raise TypeError(f"parallel must be a memkit.FSDP or None, got {type(parallel).__name__}")
    optimizations, parallel = split_parallel(optimizations, parallel)
    if parallel is not None:
        refuse_group_offload(optimizations)
        if step.optimizer_on == "cpu":
            raise ValueError(
                "optimizer_on='cpu' (torchao's CPUOffloadOptimizer) is single-GPU: it refuses FSDP; FSDP's own "
                "memkit.FSDP(cpu_offload=True) keeps the shards and the optimizer in CPU memory"
            )

    if not isinstance(alloc_conf, str):
        raise TypeError(f"alloc_conf must be a PYTORCH_CUDA_ALLOC_CONF string, got {type(alloc_conf).__name__}")
    parse_conf(alloc_conf)  # a bad option is a ValueError naming it, before the step runs
    card = None if gpu is None else gpus.find(gpu)  # an unknown name lists the known ones, before the step runs
    if card is not None and device != "cuda":
        raise ValueError(f"gpu={gpu!r} judges a device='cuda' estimate's reserved peak; got device={device!r}")
    t0 = time.perf_counter()
    key = _cache_key(
        model=key_model, inputs=inputs, step=step, optimizations=optimizations, dtype=dtype, size=size,
        batch_size=batch_size, device=device, seed=seed, parallel=parallel, sizes=sizes, memoize=memoize,
        alloc_conf=alloc_conf,
    )  # fmt: skip
    cached = _lookup(key, t0)
    if cached is not None and count_ops and cached.op_counts is None:
        cached = None  # made without counting: run again, counting (and keep that one)
    if cached is not None:
        return cached if card is None else _judged(cached, card)
    plans = []
    if any(getattr(o, "budget_bytes", None) is not None for o in optimizations):
        from .planning import _plan_budgets

        optimizations, plans = _plan_budgets(
            model_fn, inputs, optimizations, step=step, dtype=dtype, device=device, batch_size=batch_size,
            seed=seed, parallel=parallel, **sizes,
        )  # fmt: skip
    cuda = device == "cuda"
    # torch's default on CUDA; with FSDP's CPU offload the optimizer steps on CPU tensors, where its default is the
    # per-parameter loop (what estimating on CPU tensors gives by itself)
    # (torchao's CPUOffloadOptimizer: CPU defaults on the host, its own choices on the device, in _optimizer_adapters)
    host_optimizer = (parallel is not None and parallel.cpu_offload) or step.optimizer_on == "cpu"
    if step.foreach is None and cuda and step.optimizer is not None and not host_optimizer:
        step = dataclasses.replace(step, foreach=True)
    if progress is None:
        progress = isinstance(model, str) and size == "full"
    label = model if isinstance(model, str) else "model"
    n = step.runs
    why_not = "memoize=False" if not memoize else _memo.unsupported(optimizations, parallel, step, count_ops)
    run = dict(
        model_fn=model_fn, inputs=inputs, step=step, optimizations=optimizations, dtype=dtype,
        batch_size=batch_size, device=device, seed=seed, parallel=parallel, progress=progress, label=label,
        sizes=sizes, count_ops=count_ops,
    )  # fmt: skip
    measured = None
    probe = None
    period = _memo_period.period(optimizations)  # of a checkpointing pattern: the probe's middle repeats it
    no_list = _memo_period.no_list(period)
    if why_not is None and preset is not None:
        why_not = _memo.refused(preset.model_class)
    if why_not is None and preset is not None and not _memo.cut_whole(preset.model_class):
        probe = _memo.probe_builder(preset, size, dtype, seed, period)
        if probe is None:  # a preset without lists of identical blocks (UNet): not built twice to find out
            why_not = no_list
    if why_not is None:
        try:
            if probe is not None:  # the preset built with the probe's blocks per list: no full model to cut
                measured = _measure(**{**run, "model_fn": probe[0]}, memoize=True, lengths=probe[1], period=period)
            else:
                measured = _measure(**run, memoize=True, period=period)
        except _memo.Unsupported as e:
            why_not = f"the probe's events do not split into blocks: {e}"
        else:
            if measured is None:
                why_not = no_list
    if measured is None:
        measured = _measure(**run, memoize=False)
    timeline, starts, (params, trainable, trained_bytes), host_bytes, disk, base_blocks, input_keys, ops = measured
    timeline.baseline_blocks, timeline.input_keys, timeline.op_counts = list(base_blocks), input_keys, ops
    first, steady = _step_peaks(timeline, step, starts)
    reserved = _reserved(timeline, step, starts, base_blocks, alloc_conf) if cuda else _NO_RESERVED
    timeline.meta.update(
        estimate=True,
        model=model if isinstance(model, str) else getattr(model, "__name__", "model"),
        size=size if isinstance(model, str) else None,
        mode=step.mode,
        dtype=str(dtype).replace("torch.", ""),
        optimizer=step.optimizer,
        steps=n,
        grad_accum=step.grad_accum,
        mixed_precision=step.mixed_precision,
        fused_backward=step.fused_backward,
        optimizer_on=step.optimizer_on,
        offload_gradients=step.offload_gradients,
        measured=step.measured,
        step_starts=starts,
        first_step_peak_bytes=first,
        steady_peak_bytes=steady,
        **reserved,
        bytes="allocated",
        device=device,
        optimizations=[str(o) for o in optimizations],
        parallel=str(parallel) if parallel is not None else None,
        parameters=params,
        trainable_parameters=trainable if step.training else 0,
        trainable_bytes=trained_bytes if step.training else 0,
        host_bytes=host_bytes,
        disk_bytes=disk,
        memoized=why_not is None,
        memo=why_not or _memo_period.spliced(period) + _DERIVED[timeline.meta["steady_derived"]],
        checkpoint_plans=[str(p) for p in plans],
        cached=False,
        seconds=time.perf_counter() - t0,
    )
    _store(key, timeline)
    return timeline if card is None else _judged(timeline, card)


_DERIVED = {True: "; its steady forward and backward are its first step's (memkit._steady)", False: ""}


def _judged(timeline: Timeline, card: gpus.GPU) -> Timeline:
    gpus.judge(timeline, card)
    return timeline


@sized_by_values
def _measure(
    *, model_fn, inputs, step, optimizations, dtype, batch_size, device, seed, parallel, progress, label, sizes,
    memoize, count_ops=False, lengths=None, period=1,
):  # fmt: skip
    """The tracked steps of one estimate: (timeline, step starts, parameters, host bytes, disk bytes). With
    ``memoize``, the model's block lists are cut to a probe and the timeline spliced from it (None when the model
    has no block list to cut; :class:`memkit._memo.Unsupported` when its events do not split into blocks)."""
    cuda = device == "cuda"
    n = step.runs
    tracked = 2 if step.first_and_steady else 1  # the last steps of the n run
    bar = tqdm(total=n + 1, desc=f"estimate {label}", unit="stage", disable=not progress, leave=False)
    # the mesh must exist before fake mode (built inside, it fails); the process group ends with the estimate
    group = parallel.process_group() if parallel is not None else contextlib.nullcontext()
    quiet = warnings.catch_warnings()
    with bar, group as mesh, quiet, FakeTensorMode(), _default_dtype(dtype), planning(device) as plan:
        # FSDP2 warns that diffusers' output is a view an in-place op would detach from its hooks: the step's loss
        # is out of place
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        host = plan.host
        bar.set_postfix_str("building the model")
        net = model_fn()
        if not isinstance(net, torch.nn.Module):
            raise TypeError(f"model() must return a torch.nn.Module, got {type(net).__name__}")
        lists = _memo.cut(net, lengths, period) if memoize else []
        if memoize and not lists:
            return None
        if lists and period > 1:  # each probe block checkpointed as the full block it is
            optimizations = _memo_period.probe_optimizations(net, lists, optimizations, period)
        applied = sharded_order(optimizations, parallel, mesh) if parallel is not None else optimizations
        with apply_all(net, applied) as handle, contextlib.ExitStack() as stack:
            kwargs = inputs(net) if inputs is not None else make_inputs(net, batch_size=batch_size, seed=seed, **sizes)
            # inputs that keep their values (attention masks): Mochi finds its valid tokens by nonzero of its mask,
            # HunyuanVideo 1.5 indexes tokens by masks, Lumina2 sums its mask into caption lengths (.tolist())
            stack.enter_context(known_values(kwargs))
            input_keys = frozenset(t.untyped_storage()._cdata for t in tree_flatten(kwargs)[0] if torch.is_tensor(t))
            runner = step.bind(net, handle)
            if parallel is not None:  # the DTensor optimizer's very ops, minus DTensor's O(N²) dispatch of foreach
                runner.optimizer = on_local_shards(runner.optimizer)
            # counted while the optimizations are applied (LoRA's adapters exist, the base is frozen)
            params = sum(_memo.weights(p) for p in net.parameters())  # a 4-bit one: the weights it stands for
            trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
            trained_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
            if lists:
                params = _memo.parameters(lists, params)
                trainable = _memo.parameters(lists, trainable, trainable=True)
                trained_bytes = _memo.parameters(lists, trained_bytes, trainable=True, nbytes=True)
            bar.update()
            for i in range(n - tracked):
                bar.set_postfix_str(f"step {i + 1}/{n}")
                runner.run(kwargs)
                bar.update()
            granularity = CUDA_BLOCK if cuda else None
            objects = runner.tracked_objects()
            host_keys = _storage_keys(t for ts in host.values() for t in ts)
            objects["owned"] = {  # what lives in host memory is not on the planned device
                c: [t for t in ts if t.untyped_storage()._cdata not in host_keys]
                for c, ts in _owned_of(objects["owned"]).items()
            }
            starts = []
            with track(
                inputs=kwargs,
                alloc_granularity=granularity,
                device=device if cuda else None,
                host=host,  # before the model: FSDP's offloaded shards are its parameters
                **objects,
            ) as timeline:
                tracker = _active_tracker()
                tracker.fake = FakeDispatchCache()  # the same outputs as fake dispatch, ~2x faster
                tagger = _memo_tagger.Tagger(lists, period) if lists else None
                if tagger is not None:
                    tagger.install(tracker, runner.optimizer, net, handle)
                # a probe's steady forward and backward: the first step's, on other storages (memkit._steady)
                derived = _steady.Derived(tracker, tagger, runner, parallel=parallel)
                try:
                    counted = derived.run_steps(kwargs, n, tracked, starts, bar, host, label, count_ops)
                finally:
                    if tagger is not None:
                        tagger.remove()
        base_blocks = list(tracker.baseline_blocks)
        if tagger is not None:
            derived.rewrite()
            timeline, starts = _splice.spliced_timeline(tagger, tracker, timeline, starts)
            base_blocks = _splice.spliced_baseline(tagger, base_blocks)
        # noted state (the most alive at once: gradients and optimizer state of a host optimizer come and go)
        host_bytes = dict(timeline.meta.get("host_state_bytes") or {})
        if timeline.meta.get("host_peak_bytes"):  # made in the step under off_device(): offloaded checkpoints
            host_bytes["activation"] = timeline.meta["host_peak_bytes"]
    timeline.meta["steady_derived"] = derived.derived
    ops = counted[0] if counted else None
    counts = (params, trainable, trained_bytes)
    return timeline, starts, counts, host_bytes, sum(plan.disk), base_blocks, input_keys, ops


def _active_tracker():
    from .memory.tracker import _active

    return _active[-1]
