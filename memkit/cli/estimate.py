"""``memkit estimate``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import memkit

from .._torch_compat import TorchVersionError
from ..memory.timeline import peak_step
from ..optimizers import MissingLibraryError
from ..parallel import split_parallel
from ..units import UNITS, best_unit, parse_bytes
from ._common import (
    DTYPES,
    SIZE_FLAGS,
    CLIError,
    check_writable,
    fmt_count,
    optimizations_from,
    rows_text,
    write_figure,
)


def _auto_checkpointing(args: argparse.Namespace) -> tuple[int, str] | None:
    """``--checkpointing auto[@PROVIDER] --budget SIZE``: (budget bytes, provider), and the flag taken off args."""
    value = getattr(args, "opt_checkpointing", None)
    is_auto = isinstance(value, str) and value.partition("@")[0] == "auto"
    if not is_auto:
        if args.budget is not None:
            raise CLIError("--budget goes with --checkpointing auto (the budget the pattern is chosen for)")
        return None
    if args.budget is None:
        raise CLIError("--checkpointing auto needs --budget SIZE, e.g. --budget 40GiB")
    try:
        budget = parse_bytes(args.budget)
    except ValueError as e:
        raise CLIError(f"--budget {args.budget}: {e}") from None
    provider = value.partition("@")[2] or "torch"
    if provider not in memkit.optimizations.checkpointing.PROVIDERS:
        raise CLIError(
            f"--checkpointing {value}: provider must be one of {list(memkit.optimizations.checkpointing.PROVIDERS)}"
        )
    args.opt_checkpointing = None
    return budget, provider


def _parallel(args: argparse.Namespace, optimizations: list) -> tuple[list, memkit.FSDP | None]:
    """The optimizations without ``--fsdp``'s FSDP, and that FSDP (None without the flag), with the deprecated
    ``--fsdp-keep-unsharded``, ``--fsdp-param-dtype`` and ``--fsdp-cpu-offload`` folded in (each warns)."""
    optimizations, fsdp = split_parallel(optimizations)
    old = {
        "--fsdp-keep-unsharded": ("keep-unsharded", {"reshard_after_forward": False}),
        "--fsdp-param-dtype": (args.fsdp_param_dtype, {"mixed_precision": DTYPES.get(args.fsdp_param_dtype)}),
        "--fsdp-cpu-offload": ("cpu-offload", {"cpu_offload": True}),
    }
    given = {flag: v for flag, v in old.items() if getattr(args, flag[2:].replace("-", "_"))}
    if given and fsdp is None:
        better = ",".join(value for value, _ in given.values())
        raise CLIError(f"{', '.join(given)} go with --fsdp N (better: --fsdp N,{better})")
    for flag, (value, change) in given.items():
        print(
            f"memkit estimate: warning: {flag} is deprecated and goes in the next release: use --fsdp "
            f"{fsdp.world_size},{value}",
            file=sys.stderr,
        )
        fsdp = dataclasses.replace(fsdp, **change)
    return optimizations, fsdp


def run(args: argparse.Namespace) -> int:
    """``memkit estimate``: a full-size step on fake tensors, printed as a table or JSON."""
    from ..models import config_preset
    from ..naming import resolve

    try:
        ref = resolve(args.preset)
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None
    preset = config_preset(ref)
    if preset.inputs is None:
        raise CLIError(
            f"{args.preset} is a {ref.class_name}, whose inputs memkit cannot build (no preset has this class; "
            "`memkit models` lists the classes it feeds): estimate it from Python with "
            "memkit.estimate(config, inputs=lambda model: {...})"
        )
    if ref.preset is None and args.size != "full":
        raise CLIError(f"--size {args.size} applies to presets; {args.preset} is a config, one size (its own)")
    auto = _auto_checkpointing(args)
    optimizations, parallel = _parallel(args, optimizations_from(args, args.optimization_specs))
    if getattr(args, "dora", False):
        lora = [o for o in optimizations if isinstance(o, memkit.LoRA)]
        if not lora:
            raise CLIError("--dora goes with --lora RANK (DoRA is a kind of LoRA): e.g. --lora 16 --dora")
        optimizations = [dataclasses.replace(o, dora=True) if o is lora[0] else o for o in optimizations]
    training = args.mode == "training"
    optimizer = args.optimizer
    if not training and optimizer not in (None, "none"):
        raise CLIError(f"--optimizer {optimizer} applies to training only; drop it or drop --inference")
    optimizer = (optimizer or "adamw") if training else None
    optimizer = None if optimizer == "none" else optimizer
    sizes = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k) is not None}
    allowed = preset.input_sizes[args.size]
    unknown = [k for k in sizes if k not in allowed]
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        accepted = ", ".join("--" + k.replace("_", "-") for k in allowed)
        raise CLIError(f"{flags} does not apply to {args.preset!r}; it takes {accepted}")
    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps takes an int >= 1 (1: the first step alone), got {args.steps}")
    if args.steps == 1 and not training:
        raise CLIError("--steps 1 asks for the first training step; an inference pass has no first or steady step")
    if args.grad_accum < 1:
        raise CLIError(f"--grad-accum takes an int >= 1 (micro-batches per optimizer step), got {args.grad_accum}")
    if args.grad_accum > 1 and not training:
        raise CLIError(
            "--grad-accum applies to training only (micro-batches of a training step); drop it or --inference"
        )
    if args.optimizer_on != "device" and not (training and optimizer):
        raise CLIError(f"--optimizer-on {args.optimizer_on} needs a training step with an optimizer")
    if args.offload_gradients and args.optimizer_on != "cpu":
        raise CLIError("--offload-gradients goes with --optimizer-on cpu (torchao's CPUOffloadOptimizer option)")
    check_writable(args.html)
    check_writable(args.png)
    settings = dict(
        mode=args.mode,
        dtype=DTYPES[args.dtype] if args.dtype is not None else None,
        size=args.size,
        optimizer=optimizer,
        steps=args.steps,
        batch_size=args.batch_size,
        device=args.device,
        parallel=parallel,
        grad_accum=args.grad_accum,
        mixed_precision=args.mixed_precision,
        fused_backward=args.fused_backward,
        optimizer_on=args.optimizer_on,
        offload_gradients=args.offload_gradients,
        alloc_conf=args.alloc_conf,
        gpu=args.gpu,
        **sizes,
    )
    if args.gpu is not None:
        if args.device != "cuda":
            raise CLIError(f"--gpu judges a --device cuda estimate's reserved peak; got --device {args.device}")
        try:
            memkit.gpus.find(args.gpu)
        except ValueError as e:
            raise CLIError(str(e)) from None
    plan = None
    try:
        if auto is not None:
            budget, provider = auto
            plan = memkit.plan_checkpointing(
                args.preset, budget, provider=provider, optimizations=tuple(optimizations), **settings
            )
            optimizations = [*optimizations, plan.config]
            print(f"checkpointing auto: {plan}", file=sys.stderr if args.json else sys.stdout)
        pipeline = _pipeline(args, training)
        job_settings = {k: v for k, v in settings.items() if k != "gpu"}
        job = memkit.estimate_job(args.preset, pipeline, optimizations=optimizations, gpu=args.gpu, **job_settings)
        timeline = job.step
    except (ValueError, TorchVersionError, MissingLibraryError) as e:
        # sizes the model refuses, a feature this torch lacks (FSDP), an optimizer's library that is not installed
        raise CLIError(str(e)) from None
    meta = timeline.meta
    shape = {**allowed, **sizes}
    result = {
        "preset": ref.preset,
        "model": args.preset,
        "class": ref.class_name,
        "size": args.size,
        "mode": args.mode,
        "dtype": meta["dtype"],
        "optimizer": optimizer,
        "device": args.device,
        "steps": meta["steps"],
        "grad_accum": args.grad_accum,
        "mixed_precision": args.mixed_precision,
        "fused_backward": args.fused_backward,
        "optimizer_on": args.optimizer_on,
        "offload_gradients": args.offload_gradients,
        "measured": meta["measured"],
        "bytes": meta["bytes"],
        "batch_size": args.batch_size,
        "inputs": shape,
        "optimizations": [str(o) for o in optimizations],
        "parallel": str(parallel) if parallel is not None else None,
        "parameters": meta["parameters"],
        "trainable_parameters": meta.get("trainable_parameters"),
        "events": len(timeline),
        "baseline_bytes": timeline.baseline_bytes,
        "peak_bytes": timeline.peak_bytes,
        "first_step_peak_bytes": meta["first_step_peak_bytes"],
        "steady_peak_bytes": meta["steady_peak_bytes"],
        "peak_reserved_bytes": meta.get("peak_reserved_bytes"),
        "first_step_peak_reserved_bytes": meta.get("first_step_peak_reserved_bytes"),
        "steady_peak_reserved_bytes": meta.get("steady_peak_reserved_bytes"),
        "fragmentation_bytes": meta.get("fragmentation_bytes"),
        "alloc_conf": meta.get("alloc_conf"),
        "peak_by_category": timeline.peak_by_category(),
        "host_bytes": dict(meta.get("host_bytes") or {}),
        "seconds": meta["seconds"],
        "memoized": meta.get("memoized"),
        "memo": meta.get("memo"),
        "lower_bound_ops": list(meta.get("lower_bound_ops") or []),
        **job.summary(),
    }
    if plan is not None:
        result["checkpoint_plan"] = {
            "budget_bytes": plan.budget_bytes,
            "blocks": plan.blocks,
            "checkpointed": plan.checkpointed,
            "fits": plan.fits,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "tried": [list(t) for t in plan.tried],
        }
    out = sys.stderr if args.json else sys.stdout
    if args.html or args.png:
        from ..plots import timeline_figure

        title = f"memkit estimate: {args.preset} ({args.size}), {args.mode}, {meta['dtype']}, {args.device}"
        fig = timeline_figure(timeline, title=title, unit=best_unit(timeline.peak_bytes))
        for path, png in ((args.html, False), (args.png, True)):
            if path:
                write_figure(fig, path, png=png)
                print(f"wrote {path}", file=out)
    status = 0
    if args.gpu is not None:  # the exit status is the verdict: a launch script can guard a run with it
        keys = ("gpu", "gpu_name", "usable_bytes", "fits", "verdict", "headroom_bytes")
        result.update({k: job.meta[k] for k in keys})  # the job's peak is the answer (the step's, by default)
        status = 0 if job.meta["fits"] else 1
    if args.json:
        print(json.dumps(result, indent=2))
        return status
    div = UNITS[args.unit]
    num = ",.0f" if args.unit == "B" else ",.3f"
    inputs = [f"{shape['height']}x{shape['width']} px"] if "height" in shape else []
    inputs += [f"{shape['frames']} frames"] if "frames" in shape else []
    inputs += [f"{shape['text_len']} text tokens"] if "text_len" in shape else []
    inputs = ", ".join(inputs)
    where = ""
    if args.optimizer_on == "cpu":
        where = " on the CPU, gradients offloaded" if args.offload_gradients else " on the CPU"
    print(
        f"memkit estimate: {args.preset} ({args.size}), {args.mode}, {meta['dtype']}"
        + (f" (mixed {args.mixed_precision})" if args.mixed_precision else "")
        + ", "
        f"optimizer {optimizer or 'none'}{where}, device {args.device}, batch {args.batch_size}"
        + (f" x {args.grad_accum} micro-batches" if args.grad_accum > 1 else "")
        + f", {inputs}"
    )
    print(f"optimizations: {', '.join(result['optimizations']) or 'none'}")
    if parallel is not None:
        print(f"sharded: {parallel} (FSDP2); the memory of one GPU, rank 0")
    print()
    rows = [
        ("parameters", fmt_count(meta["parameters"])),
        *([("  trainable", fmt_count(meta["trainable_parameters"]))] if meta.get("trainable_parameters") else []),
        (f"baseline ({args.unit})", f"{timeline.baseline_bytes / div:{num}}"),
        (f"peak ({args.unit}, {peak_step(meta)})", f"{timeline.peak_bytes / div:{num}}"),
    ]
    if meta["measured"] == "first and steady":
        rows += [
            (f"  first step ({args.unit})", f"{meta['first_step_peak_bytes'] / div:{num}}"),
            (f"  steady step ({args.unit})", f"{meta['steady_peak_bytes'] / div:{num}}"),
        ]
    if meta.get("peak_reserved_bytes") is not None:
        rows.append(
            (
                f"peak reserved ({args.unit}, {peak_step(meta, reserved=True)})",
                f"{meta['peak_reserved_bytes'] / div:{num}}",
            )
        )
        if meta["measured"] == "first and steady":
            rows += [
                (f"  first step ({args.unit})", f"{meta['first_step_peak_reserved_bytes'] / div:{num}}"),
                (f"  steady step ({args.unit})", f"{meta['steady_peak_reserved_bytes'] / div:{num}}"),
            ]
        rows.append(
            (f"  fragmentation ({args.unit}, at the reserved peak)", f"{meta['fragmentation_bytes'] / div:{num}}")
        )
        rows.append(("  alloc conf", meta["alloc_conf"] or "torch's defaults"))
    if meta["measured"] == "first and steady":
        rows.append((f"by category, at the peak ({args.unit})", ""))
    rows += [(f"  {c}", f"{v / div:{num}}") for c, v in result["peak_by_category"].items() if v]
    if any(result["host_bytes"].values()):  # e.g. an offloaded EMA: in CPU memory, so not in the GPU peak
        rows.append((f"in CPU memory, off the GPU peak ({args.unit})", ""))
        rows += [(f"  {c}", f"{v / div:{num}}") for c, v in result["host_bytes"].items() if v]
    how = (
        ""
        if meta.get("memo") is None
        else "; blocks memoized"
        if meta["memoized"]
        else f"; every block: {meta['memo']}"
    )
    rows += _job_rows(job, args.unit, div, num)
    rows.append(("estimated in", f"{meta['seconds']:.1f} s ({len(timeline):,} events{how})"))
    print(rows_text(rows))
    if result["lower_bound_ops"]:
        print(
            "\nLOWER BOUND: these ops allocate buffers inside their kernels that memkit could neither compute nor "
            "learn here (learning off with MEMKIT_LEARN_WORKSPACE=0, or a call over MEMKIT_LEARN_MAX_BYTES), so the "
            f"true peak may be higher: {', '.join(result['lower_bound_ops'])}"
        )
    if args.device == "cuda":
        print(
            "\nThe peak is allocated bytes: it compares with torch.cuda.max_memory_allocated(); peak reserved adds "
            "what the caching allocator keeps cached (max_memory_reserved(), what a GPU runs out of); add the CUDA "
            "context (~0.3-0.5 GiB) and cuBLAS workspaces for nvidia-smi."
        )
    if args.gpu is not None:
        verdict = memkit.gpus.verdict(job.peak_reserved_bytes, memkit.gpus.find(args.gpu))
        where = peak_step(meta, reserved=True) if job.peak_phase in ("training", "denoise") else job.peak_phase
        print(f"\nGPU: {verdict.describe()} (the job's peak: {where})")
    return status


def _pipeline(args: argparse.Namespace, training: bool) -> memkit.Pipeline:
    """The :class:`memkit.Pipeline` of the job flags (``--text-encoders``, ``--vae``, ``--validate``...)."""
    from ..pipeline import parse_validate

    validate = None
    if args.validate is not None:
        if not training:
            raise CLIError("--validate samples during training; an --inference job has no validation")
        try:
            validate = parse_validate(args.validate)
        except ValueError as e:
            raise CLIError(f"--validate {args.validate}: {e}") from None
    if args.precompute and not training:
        raise CLIError("--precompute is a phase of a training job; an --inference job reads no dataset")
    if args.cfg is not None and training and validate is None:
        raise CLIError("--cfg applies to --inference and to --validate's denoising step")
    if args.quantize_on != "cpu" and not any(
        type(o).__name__ == "Quantize" for o in optimizations_from(args, args.optimization_specs)
    ):
        raise CLIError("--quantize-on goes with --quantize METHOD (where the base is quantized while loading)")
    return memkit.Pipeline(
        text_encoders=args.text_encoders, vae=args.vae, cfg=args.cfg, vae_tiling=args.vae_tiling,
        vae_slicing=args.vae_slicing, precompute=args.precompute, validate=validate, quantize_on=args.quantize_on,
    )  # fmt: skip


def _job_rows(job, unit: str, div: float, num: str) -> list[tuple[str, str]]:
    """The table's rows of the job: each phase's peak (allocated, reserved, host), the component split at the job's
    peak, the host peak. Only the step's row where the job is the transformer's step alone."""
    rows: list[tuple[str, str]] = []
    phases = job.peak_by_phase
    rows.append((f"by phase: allocated / reserved / host ({unit})", ""))
    for name, p in phases.items():
        reserved = "-" if p["reserved"] is None else f"{p['reserved'] / div:{num}}"
        mark = "  <- the job's peak" if name == job.peak_phase else ""
        rows.append((f"  {name}", f"{p['allocated'] / div:{num}} / {reserved} / {p['host'] / div:{num}}{mark}"))
    if len(job.components) > 1:
        rows.append((f"by component, at the job's peak ({unit})", ""))
        rows += [(f"  {c}", f"{v / div:{num}}") for c, v in job.peak_by_component.items()]
    rows.append((f"host memory, the job's most ({unit})", f"{job.host_peak_bytes / div:{num}}"))
    return rows
