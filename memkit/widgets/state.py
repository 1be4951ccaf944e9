"""The Playground's state as a plain object: the settings a person picks, and the runs they start.

:class:`PlaygroundState` holds the model settings (preset, size, dtype, batch, input sizes, training or
inference, optimizer) and one :class:`OptimizationSettings` per registered optimization. It builds the library's
objects from them (a :class:`memkit.Step`, the optimization configs, :class:`memkit.Variant` s) and runs them:
:meth:`~PlaygroundState.run` compares the baseline with the variants on real tensors (:func:`memkit.compare`),
:meth:`~PlaygroundState.estimate` the same settings at full size on fake tensors (:func:`memkit.estimate`; with the
fsdp panel on, the memory of one GPU of a sharded run, which only an estimate gives: Run refuses it), with the
caching allocator's settings (``alloc_conf``) and judged against a GPU (``gpu``: :mod:`memkit.gpus`).
Whatever goes wrong comes back as a :class:`RunResult` with a message, never as an exception; a stop request
ends a run between two ops and leaves nothing behind. No widgets here: the app and the tests drive the same
object.

Example:
    >>> state = PlaygroundState(preset="dit")
    >>> state.optimizations["checkpointing"].enabled = True
    >>> result = state.run(on_update=lambda tl: print(len(tl)))
    >>> result.status, result.comparison.table()
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ._watch import Stopped, watching
from .fields import OptimizationSettings

__all__ = ["DTYPES", "INPUT_SIZES", "PlaygroundState", "RunResult"]

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a model is built in, by name."""
INPUT_SIZES = ("height", "width", "frames", "text_len")
"""Input sizes a preset may take (each preset takes some of them)."""
VARIANT_MODES = ("together", "each")
_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}  # pass/fail, relative to the baseline's max

Progress = Callable[[float, str], Any]


@dataclass
class RunResult:
    """What a run or an estimate gave: the comparison, or why there is none.

    Example:
        >>> result = state.run()
        >>> result.ok, result.message, result.comparison.table()
    """

    kind: Literal["run", "estimate"]
    """Which button: ``"run"`` (real tensors, the chosen size) or ``"estimate"`` (fake tensors, full size)."""
    status: Literal["ok", "stopped", "error"]
    """``"ok"``; ``"stopped"`` on request; ``"error"`` with the reason in ``message``."""
    message: str = ""
    """What went wrong (or what was stopped), in one or two sentences."""
    comparison: Any = None
    """The :class:`memkit.Comparison` (baseline first) when ``status == "ok"``."""
    warnings: list[str] = field(default_factory=list)
    """Warnings the library gave during the run (each once)."""
    seconds: float = 0.0
    """Wall time of the whole run."""
    updates: int = 0
    """Live timeline updates handed to ``on_update``."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class PlaygroundState:
    """The model settings, the optimizations' settings, and the runs, with no widgets.

    Args mirror the app's controls; every one is a plain attribute to change later. ``registry`` is
    ``memkit.optimizations.REGISTRY`` unless given (tests pass their own).

    Example:
        >>> state = PlaygroundState(preset="flux", mode="training", optimizer="adamw")
        >>> state.optimizations["ema"].enabled = True
        >>> state.estimate().comparison.table(unit="GiB")
    """

    def __init__(
        self,
        *,
        preset: str = "flux",
        size: Literal["tiny", "small", "full"] = "tiny",
        dtype: str = "bfloat16",
        batch_size: int = 1,
        mode: Literal["training", "inference"] = "training",
        optimizer: str | None = "adamw",
        steps: int | None = None,
        grad_accum: int = 1,
        mixed_precision: Literal["bf16", "fp16"] | None = None,
        fused_backward: bool = False,
        optimizer_on: Literal["device", "cpu"] = "device",
        offload_gradients: bool = False,
        repeats: int = 2,
        variants: Literal["together", "each"] = "together",
        seed: int = 0,
        tolerance: float | None = None,
        estimate_size: Literal["tiny", "small", "full"] = "full",
        gpu: str | None = None,
        alloc_conf: str = "",
        text_encoders: str = "precomputed",
        vae: str = "precomputed",
        interval: float = 0.5,
        registry: Mapping[str, Any] | None = None,
    ) -> None:
        if registry is None:
            from ..optimizations import REGISTRY as registry
        self.preset, self.size, self.dtype, self.batch_size = preset, size, dtype, batch_size
        self.mode, self.optimizer, self.steps, self.repeats = mode, optimizer, steps, repeats
        self.grad_accum, self.mixed_precision, self.fused_backward = grad_accum, mixed_precision, fused_backward
        self.optimizer_on, self.offload_gradients = optimizer_on, offload_gradients
        self.variants, self.seed, self.tolerance = variants, seed, tolerance
        self.estimate_size, self.interval = estimate_size, interval
        self.gpu, self.alloc_conf = gpu, alloc_conf
        self.text_encoders, self.vae = text_encoders, vae
        """Estimate only: where the preset pipeline's text encoders and VAE live (:class:`memkit.Pipeline`): the
        variants' timelines are then the job's training (or denoising) phase, the components beside the step."""
        """Estimate only: the card its reserved peak is judged against (None: none), the PYTORCH_CUDA_ALLOC_CONF."""
        self.sizes: dict[str, int | None] = dict.fromkeys(INPUT_SIZES)
        """Input sizes typed by the user; None: the preset's default at the size being built."""
        self.optimizations: dict[str, OptimizationSettings] = {
            name: OptimizationSettings(spec) for name, spec in registry.items()
        }
        self._stop = threading.Event()
        self._busy = threading.Lock()

    # ---- what the settings mean -------------------------------------------------------------------------
    def input_keys(self, size: str | None = None) -> tuple[str, ...]:
        """The input sizes the preset takes (``height``, ``width``, ``frames``, ``text_len``: some of them)."""
        from ..presets import PRESETS

        preset = PRESETS.get(self.preset)
        return tuple(preset.input_sizes[size or self.size]) if preset is not None else ()

    def default_sizes(self, size: str | None = None) -> dict[str, int]:
        """The preset's default input sizes at ``size`` (default: the run's)."""
        from ..presets import PRESETS

        preset = PRESETS.get(self.preset)
        return dict(preset.input_sizes[size or self.size]) if preset is not None else {}

    def input_sizes(self) -> dict[str, int]:
        """The sizes the user set that the preset takes (the others are the preset's defaults)."""
        keys = self.input_keys()
        return {k: int(v) for k, v in self.sizes.items() if v is not None and k in keys}

    def step(self) -> Any:
        """The :class:`memkit.Step` every run uses (the optimizer only in training)."""
        from ..step import Step

        training = self.mode == "training"
        # steps say which training step is measured; an inference pass is always one alike. The recipe options
        # (memkit.Step's grad_accum, mixed_precision, fused_backward, optimizer_on, offload_gradients) are training's,
        # but autocast's forward; the optimizer's place only with an optimizer
        return Step(
            mode=self.mode,
            optimizer=self.optimizer if training else None,
            steps=self.steps if training else None,
            grad_accum=self.grad_accum if training else 1,
            mixed_precision=self.mixed_precision,
            fused_backward=self.fused_backward if training else False,
            optimizer_on=self.optimizer_on if training and self.optimizer is not None else "device",
            offload_gradients=self.offload_gradients if training and self.optimizer is not None else False,
        )

    def configs(self) -> list[Any]:
        """The enabled optimizations' configs, in registry order."""
        return [s.config() for s in self.optimizations.values() if s.enabled]

    def build_variants(self) -> dict[str, Any]:
        """Name -> :class:`memkit.Variant`: all enabled optimizations together, or each on its own."""
        from ..comparison import Variant

        if self.variants not in VARIANT_MODES:
            raise ValueError(f"variants must be one of {list(VARIANT_MODES)}, got {self.variants!r}")
        configs = self.configs()
        if not configs:
            return {}
        if self.variants == "each":
            return {str(c): Variant(optimizations=[c]) for c in configs}
        return {" + ".join(map(str, configs)): Variant(optimizations=configs)}

    def _torch_dtype(self) -> Any:
        import torch

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        return getattr(torch, self.dtype)

    def _check(self) -> None:
        from ..presets import PRESETS, SIZES

        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {list(PRESETS)}, got {self.preset!r}")
        for name, value, allowed in (("size", self.size, SIZES), ("estimate_size", self.estimate_size, SIZES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        for name in ("batch_size", "steps"):
            value = getattr(self, name)
            if name == "steps" and value is None:  # the first and the steady step
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                none = " or None (the first and the steady step)" if name == "steps" else ""
                raise ValueError(f"{name} must be a whole number >= 1{none}, got {value!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 0:
            raise ValueError(f"repeats must be a whole number >= 0, got {self.repeats!r}")
        for k, v in self.sizes.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{k} must be a whole number >= 1 or empty (the preset's default), got {v!r}")

    # ---- running ----------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the running run or estimate to stop at its next op (thread-safe; no-op when idle)."""
        self._stop.set()

    @property
    def running(self) -> bool:
        return self._busy.locked()

    def run(
        self,
        *,
        on_update: Callable[[Any], Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_progress: Progress | None = None,
    ) -> RunResult:
        """Compare the baseline with the configured variant(s) on real tensors at ``size``.

        ``on_update(timeline)`` gets the live :class:`memkit.Timeline` of the tracked step that is running
        (``timeline.meta["label"]`` names the variant) at most every ``interval`` seconds, and once when it
        ends. ``should_stop()`` (or :meth:`request_stop`) ends the run between two ops. ``on_progress(fraction,
        text)`` follows the stages: each variant's build, compared step, timed steps and tracked step.
        """
        return self._go("run", on_update, should_stop, on_progress)

    def estimate(
        self,
        *,
        on_update: Callable[[Any], Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_progress: Progress | None = None,
    ) -> RunResult:
        """The same settings at ``estimate_size`` (the released, full config) on fake tensors: baseline and
        variants side by side (:meth:`memkit.Comparison.from_timelines`, no time or differences), in seconds.
        The callbacks are :meth:`run`'s."""
        return self._go("estimate", on_update, should_stop, on_progress)

    def _go(self, kind, on_update, should_stop, on_progress) -> RunResult:
        if not self._busy.acquire(blocking=False):
            return RunResult(kind, "error", "a run is in progress: wait for it to finish or press Stop")
        t0 = time.perf_counter()
        self._stop.clear()
        result = RunResult(kind, "error")
        live = _Live(on_update, result)
        progress = _Progress(on_progress)

        def stop() -> bool:
            return self._stop.is_set() or (should_stop is not None and bool(should_stop()))

        watch = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    work = self._compare if kind == "run" else self._estimate
                    self._import_model_class()
                    with watching(should_stop=stop, on_update=live, interval=self.interval) as watch:
                        result.comparison = work(progress, stop, live)
                    result.status = "ok"
                    progress(1.0, "done")
                except Stopped:
                    result.status, result.message = "stopped", f"stopped on request after {_secs(t0)}"
                    progress.report(progress.fraction, "stopped")
                except Exception as e:  # every failure is a message in the panel; the kernel lives on
                    result.status, result.message = "error", _message(e, kind)
                    progress.report(progress.fraction, "failed")
            for w in caught:
                text = f"{w.category.__name__}: {w.message}"
                if text not in result.warnings:
                    result.warnings.append(text)
            result.updates = watch.updates if watch is not None else 0
        finally:
            result.seconds = time.perf_counter() - t0
            self._stop.clear()
            self._busy.release()
        return result

    def _import_model_class(self) -> None:
        # diffusers imports a model's module on first use, running a few ops; a stop raised inside that import
        # would leave the module broken for the rest of the session, so it is imported before anything can stop.
        from ..models import diffusers_class
        from ..presets import PRESETS

        if self.preset in PRESETS:
            diffusers_class(PRESETS[self.preset].model_class)

    def _compare(self, progress: _Progress, stop: Callable[[], bool], live: _Live) -> Any:
        from ..comparison import compare
        from ..models import load_model, make_inputs

        self._check()
        if self.size == "full":
            raise ValueError(
                "Run builds real weights: a full-size model needs the real model's memory (Flux: 48 GB in "
                "float32). Pick tiny or small to run, and Estimate for the full size"
            )
        step, variants, dtype, sizes = self.step(), self.build_variants(), self._torch_dtype(), self.input_sizes()
        only = [s for s in self.optimizations.values() if s.enabled and getattr(s.spec, "estimate_only", "")]
        if only:  # fsdp: compare would refuse it too, in its own words
            raise ValueError(
                f"{only[0].name} is estimate-only: {only[0].spec.estimate_only}. Press Estimate for its memory, or "
                f"switch {only[0].name} off to Run"
            )
        names = ["baseline", *variants]
        per_run = self.repeats + 3  # build, compared step, timed steps, tracked step
        progress.total = len(names) * per_run
        preset, size, seed, repeats, batch = self.preset, self.size, self.seed, self.repeats, self.batch_size
        built = []

        def model_fn():
            if stop():
                raise Stopped("stopped on request")
            name = names[min(len(built), len(names) - 1)]
            live.name = name
            progress.stage(f"{name}: building the model")
            model = load_model(preset, size=size, dtype=dtype, seed=seed)
            calls = []

            def count(module, args):
                k = len(calls)
                calls.append(k)
                what = "compared step" if k == 0 else "tracked step" if k > repeats else f"timed step {k}/{repeats}"
                progress.stage(f"{name}: {what}")

            model.register_forward_pre_hook(count)  # the model is thrown away after its variant
            built.append(name)
            return model

        def inputs(model):
            return make_inputs(model, batch_size=batch, seed=seed, **sizes)

        tolerance = self.tolerance or _TOLERANCE[self.dtype]
        return compare(
            model_fn, variants, step=step, inputs=inputs, seed=seed, repeats=repeats, tolerance=tolerance,
            progress=False,
        )  # fmt: skip

    def _estimate(self, progress: _Progress, stop: Callable[[], bool], live: _Live) -> Any:
        from ..comparison import Comparison
        from ..estimation import _cache_key, _lookup, _store, estimate
        from ..gpus import find
        from ..memory._allocator_config import parse_conf
        from ..models import load_model
        from ..parallel import split_parallel
        from .verdict import GPU_KEYS, rejudge

        self._check()
        gpu, conf = self.gpu, self.alloc_conf
        parse_conf(conf)  # a bad option or an unknown card is a message naming it, before any step runs
        if gpu is not None:
            find(gpu)
        step, variants, dtype, sizes = self.step(), self.build_variants(), self._torch_dtype(), self.input_sizes()
        runs = {"baseline": (), **{name: v.optimizations for name, v in variants.items()}}
        progress.total = len(runs) * (step.runs + 1)
        preset, size, seed, batch = self.preset, self.estimate_size, self.seed, self.batch_size
        timelines = {}
        for name, optimizations in runs.items():
            live.name = name

            def model_fn(name=name):
                if stop():
                    raise Stopped("stopped on request")
                progress.stage(f"{name}: building the {size} model (fake tensors)")
                model = load_model(preset, size=size, dtype=dtype, seed=seed)
                model.register_forward_pre_hook(lambda m, a: progress.stage(f"{name}: step"))
                return model

            model_fn.__name__ = preset  # the estimate's meta["model"]
            others, parallel = split_parallel(optimizations)  # fsdp's panel: the per-GPU memory of rank 0
            # the preset's estimate, as memkit.estimate(preset, ...) keeps it: a setting shown before is shown at once
            key = _cache_key(
                model=preset, inputs=None, step=step, optimizations=others, dtype=dtype, size=size,
                batch_size=batch, device="cuda", seed=seed, parallel=parallel, sizes=sizes, memoize=True,
                alloc_conf=conf,
            )  # fmt: skip
            tl = _lookup(key, time.perf_counter())
            if tl is None:
                tl = estimate(
                    model_fn, step=step, optimizations=others, dtype=dtype, batch_size=batch,
                    seed=seed, progress=False, parallel=parallel, alloc_conf=conf, gpu=gpu, **sizes,
                )  # fmt: skip
                tl.meta.update(size=size)
                verdict = {k: tl.meta.pop(k) for k in GPU_KEYS if k in tl.meta}
                _store(key, tl)  # unjudged, as estimate() keeps its own: memkit.estimate(preset) may be asked next
                tl.meta.update(verdict)
            else:
                progress.stage(f"{name}: estimated earlier in this session")
                rejudge([tl], gpu)  # as estimate(gpu=) judges its own cached copies
            if (self.text_encoders, self.vae) != ("precomputed", "precomputed"):
                tl = self._with_components(tl, step, others, parallel, dtype, sizes, conf, gpu)
            tl.meta.update(label=name)
            if tl.meta["cached"]:
                live(tl)  # shown as a run's final state is
            timelines[name] = tl
        comparison = Comparison.from_timelines(timelines, mode=step.mode)
        for name, optimizations in runs.items():
            comparison.results[name].optimizations = list(optimizations)
        return comparison

    def _with_components(self, tl, step, optimizations, parallel, dtype, sizes, conf, gpu):
        """The step's timeline with the pipeline's components placed as the Fine-tuning panel says: the job's
        training (or denoising) phase (:func:`memkit.estimate_job`), its meta the step's and the job's figures."""
        from ..pipeline import Pipeline, estimate_job
        from .verdict import rejudge

        pipeline = Pipeline(text_encoders=self.text_encoders, vae=self.vae)
        job = estimate_job(
            self.preset, pipeline, size=self.estimate_size, step=step, optimizations=optimizations, dtype=dtype,
            batch_size=self.batch_size, seed=self.seed, parallel=parallel, alloc_conf=conf, progress=False, **sizes,
        )  # fmt: skip
        phase = job.phases["training" if step.training else "denoise"].timeline.copy()
        phase.meta = {**tl.meta, **phase.meta, **job.summary(), "pipeline": str(pipeline)}
        rejudge([phase], gpu)
        return phase

    def __repr__(self) -> str:
        on = [s.name for s in self.optimizations.values() if s.enabled]
        return (
            f"PlaygroundState({self.preset} {self.size} {self.dtype}, batch {self.batch_size}, {self.mode}, "
            f"optimizer {self.optimizer}, optimizations on: {on or 'none'})"
        )


class _Live:
    """``on_update`` with the variant's name on the timeline; a failing callback becomes a warning once and is
    not called again (a broken live view must not break the run)."""

    def __init__(self, on_update: Callable[[Any], Any] | None, result: RunResult) -> None:
        self.on_update, self.result, self.name = on_update, result, None

    def __call__(self, timeline: Any) -> None:
        if self.on_update is None:
            return
        if self.name is not None and not timeline.meta.get("label"):
            timeline.meta["label"] = self.name
        try:
            self.on_update(timeline)
        except Exception as e:
            self.on_update = None
            self.result.warnings.append(f"the live view failed and was switched off: {type(e).__name__}: {e}")


class _Progress:
    """Stages done out of ``total``, reported as a fraction in [0, 1] that never goes back."""

    def __init__(self, on_progress: Progress | None) -> None:
        self.on_progress, self.total, self.done, self.fraction = on_progress, 1, 0, 0.0

    def stage(self, text: str) -> None:
        """A stage starts: the ones before it are done."""
        self.report(min(self.done / max(self.total, 1), 0.99), text)
        self.done += 1

    def report(self, fraction: float, text: str) -> None:
        self.fraction = max(self.fraction, fraction)
        if self.on_progress is not None:
            self.on_progress(self.fraction, text)

    def __call__(self, fraction: float, text: str) -> None:
        self.report(fraction, text)


def _secs(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f} s"


def _message(e: BaseException, kind: str) -> str:
    text = f"{type(e).__name__}: {e}"
    oom = isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and any(s in str(e) for s in ("can't allocate memory", "out of memory"))
    )
    if oom:
        advice = "a smaller size, batch or resolution" + (", or Estimate" if kind == "run" else "")
        return f"out of memory: {text}. Try {advice}"
    return text
