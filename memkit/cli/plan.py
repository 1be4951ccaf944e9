"""``memkit plan``: the fastest configuration that fits a GPU (:func:`memkit.plan`)."""

from __future__ import annotations

import argparse
import json
import sys

from ._common import (
    SIZE_FLAGS,
    CLIError,
    add_optimization_flags,
    check_writable,
    optimization_specs,
    optimizations_from,
    write_figure,
)

SUMMARY = "search the memory-saving settings for the fastest configuration that fits a GPU"


def add_parser(sub: argparse._SubParsersAction, formatter: type) -> None:
    """The ``plan`` subcommand's options."""
    from ..planning import CATALOGUE, DEFAULT_SEARCH, DIMENSIONS

    p = sub.add_parser(
        "plan",
        help=SUMMARY,
        description=SUMMARY + ". Fix what you will not change (model, size, inputs, batch, LoRA, precision, any "
        "optimization given as a flag); memkit searches the optimizer (AdamW, 8-bit AdamW), a quantized base (LoRA "
        "runs), the feed-forward split, checkpointing, a fixed --ema's placement, FSDP over --gpus N and the "
        "allocator's expandable segments (offloading and partial checkpointing when asked), and lists the "
        "configurations that fit, fastest first, each with the `memkit estimate` flags that reproduce it.",
        epilog="examples:\n  memkit plan flux --gpu 4090 --lora 16\n  memkit plan flux --gpu h100 --json\n"
        "  memkit plan wan --gpu 24GiB --lora 32 --frames 33\n"
        "  memkit plan flux --gpu 4090 --lora 16 --plot plan.html\n"
        "  memkit plan flux --gpu h100 --gpus 8 --ema offload\n"
        "  memkit plan flux --gpu 4090 --lora 16 --levels checkpointing=none,every:2,all",
        formatter_class=formatter,
    )
    p.add_argument("preset", metavar="MODEL", help="a preset, its hub id, a folder or a config.json")
    p.add_argument("--gpu", required=True, metavar="NAME", help="the GPU to fit (4090, h100, 24GiB...)")
    p.add_argument("--size", choices=("full", "small", "tiny"), default="full", help="model size")
    p.add_argument("--batch-size", type=int, default=1, metavar="N", help="samples per step (fixed)")
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None, help="fixed, as in memkit estimate")
    p.add_argument(
        "--search",
        default=None,
        metavar="DIM[,DIM...]",
        help=f"the dimensions to search, of {', '.join(DIMENSIONS)} (default: those of {', '.join(DEFAULT_SEARCH)} "
        "that apply: quantize with --lora, ema with a fixed --ema, fsdp with --gpus above 1; offload only when named: "
        "the optimizer step onloads every group, so it cannot beat checkpointing every block)",
    )
    p.add_argument(
        "--levels",
        action="append",
        default=[],
        metavar="DIM=LEVEL[,LEVEL...]",
        help="a dimension's levels instead of its defaults, fastest first, e.g. checkpointing=none,every:2,all "
        "(partial patterns cost a full estimate each); of "
        + "; ".join(f"{d}: {','.join('none' if v is None else str(v) for v in CATALOGUE[d])}" for d in CATALOGUE
                    if d != "fsdp")
        + "; fsdp: none and the divisors of --gpus",
    )  # fmt: skip
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs the run has: above 1, FSDP over each "
                   "divisor of N is searched (rank 0's memory; --gpu is each GPU)")  # fmt: skip
    for key, unit in SIZE_FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=int, metavar="N", default=None, help=f"in {unit}")
    fixed = p.add_argument_group("fixed optimizations (each takes its dimension out of the search)")
    specs = optimization_specs()
    add_optimization_flags(fixed, specs)
    p.add_argument(
        "--no-time",
        dest="time",
        action="store_false",
        help="rank by what the configurations switch on, without step times (each estimate then skips counting its "
        "ops: about a fifth faster). By default each configuration's step time on the GPU is estimated from the "
        "estimate's own ops (memkit.steptime's roofline) and the configurations that fit are ranked by it",
    )
    p.add_argument(
        "--maximize",
        choices=("batch", "resolution", "frames"),
        default=None,
        help="instead of searching the settings: with the fixed ones, the largest batch size, resolution (height, "
        "the width keeping the preset's aspect) or frame count that fits, by a bisection on estimates",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="write the frontier figure (step time against peak reserved memory: each timed configuration, fitting "
        "or not, the frontier, the GPU's usable bytes, the chosen one; memkit.plots.plan_figure) as FILE.html, or "
        "FILE.png (needs kaleido and Chromium)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes, seconds)")
    p.set_defaults(run=run, optimization_specs=specs)


def run(args: argparse.Namespace) -> int:
    """``memkit plan``: the search, printed as a table or JSON; exit 0 when something fits, 1 when nothing does."""
    import memkit

    from ..planning import DIMENSIONS, NothingFits

    try:
        memkit.gpus.find(args.gpu)
    except ValueError as e:
        raise CLIError(str(e)) from None
    search = None if args.search is None else [d.strip() for d in args.search.split(",") if d.strip()]
    bad = [d for d in search or () if d not in DIMENSIONS]
    if bad:
        raise CLIError(f"--search {args.search}: {bad} are not dimensions; they are {', '.join(DIMENSIONS)}")
    levels = {}
    for given in args.levels:
        dim, eq, values = given.partition("=")
        if not eq or dim not in DIMENSIONS or not values:
            raise CLIError(f"--levels {given}: give DIM=LEVEL[,LEVEL...], DIM one of {', '.join(DIMENSIONS)}")
        levels[dim] = [v.strip() for v in values.split(",")]
    if args.gpus < 1:
        raise CLIError(f"--gpus takes an int >= 1 (the GPUs the run has), got {args.gpus}")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size takes an int >= 1, got {args.batch_size}")
    if args.plot is not None:
        if args.maximize is not None:
            raise CLIError("--plot draws the search's configurations; --maximize searches a size, not them")
        if not args.time:
            raise CLIError("--plot draws the configurations' step times: leave out --no-time")
        if not args.plot.lower().endswith((".html", ".png")):
            raise CLIError(f"--plot {args.plot}: the file must end in .html or .png")
        check_writable(args.plot)
    fixed = optimizations_from(args, args.optimization_specs)
    sizes = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k) is not None}
    out = sys.stderr if args.json else sys.stdout
    if args.maximize is not None:
        return _maximize(args, fixed, sizes)
    try:
        result = memkit.plan(
            args.preset, args.gpu, optimizations=fixed, search=search, levels=levels, gpus=args.gpus, size=args.size,
            batch_size=args.batch_size, mixed_precision=args.mixed_precision, step_time=args.time,
            progress=lambda line: print(f"plan: {line}", file=sys.stderr),
            **sizes,
        )  # fmt: skip
    except NothingFits as e:
        if args.json:
            print(json.dumps({"gpu": args.gpu, "configs": [], "error": str(e)}, indent=2))
        print(f"memkit plan: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        _print(args, result, out)
    if args.plot is not None:
        _plot(result, args.plot, out)
    return 0 if result.configs else 1


def _plot(result, path: str, out) -> None:
    """The frontier figure written to ``path`` (.html or .png)."""
    from ..plots import plan_figure

    try:
        fig = plan_figure(result)
    except ValueError as e:  # nothing timed: a GPU without a FLOP/s figure for the step's dtype
        raise CLIError(f"--plot {path}: {e}", code=1) from None
    write_figure(fig, path, png=path.lower().endswith(".png"), what="plan")
    print(f"wrote {path}", file=out)


def _print(args: argparse.Namespace, result, out) -> None:
    """The plan as a table: its GPU, each configuration that fits (fastest first), why there are no step times."""
    from ..units import format_bytes, format_seconds

    gib = 2**30
    print(
        f"memkit plan: {args.preset} ({args.size}) on {result.gpu.name} "
        f"({result.gpu.usable_bytes()[0] / gib:.2f} GiB usable); {result.estimates} estimates in {result.seconds:.0f} s"
        + (" (interrupted: what was found so far)" if result.interrupted else ""),
        file=out,
    )
    for i, c in enumerate(result.configs):
        time_ = f"{format_seconds(c.step_seconds)}/step" if c.step_seconds is not None else "no step time"
        print(f"  {i + 1}. {' '.join(c.flags) or '(nothing switched on)'}", file=out)
        print(f"       {format_bytes(c.peak_reserved_bytes)} reserved, headroom {format_bytes(c.headroom_bytes)}, "
              f"{time_}" + (f"; {c.why}" if c.why else ""), file=out)  # fmt: skip
    if not result.configs:
        print("  nothing fits", file=out)
    if result.untimed and not args.json:
        print(f"  no step times: {result.untimed}", file=out)
    u = result.unconstrained
    if u is not None:
        print(
            f"  nothing switched on: {format_bytes(u.peak_reserved_bytes)} reserved "
            f"({'fits' if u.fits else 'does not fit'}), {format_seconds(u.step_seconds)}/step; step times: steady "
            f"step, {result.gpu.name}'s roofline (memkit.steptime)",
            file=out,
        )


def _maximize(args: argparse.Namespace, fixed: list, sizes: dict) -> int:
    """``memkit plan --maximize WHAT``: the largest batch, resolution or frame count that fits with the fixed flags."""
    from ..planning import maximize

    progress = None if args.json else (lambda line: print(f"plan: {line}", file=sys.stderr))
    kwargs = dict(sizes, batch_size=args.batch_size) if args.maximize != "batch" else dict(sizes)
    try:
        big = maximize(args.preset, args.gpu, args.maximize, optimizations=fixed, size=args.size,
                       mixed_precision=args.mixed_precision, progress=progress, **kwargs)  # fmt: skip
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.json:
        print(json.dumps(big.summary(), indent=2))
    elif big.value is None:
        print(f"memkit plan: even the smallest {args.maximize} does not fit {args.gpu}", file=sys.stderr)
    else:
        shown = ", ".join(f"{k} {v}" for k, v in big.sizes.items())
        print(
            f"memkit plan: the largest {args.maximize} that fits {args.gpu}: {big.value} ({shown}): "
            f"{big.peak_reserved_bytes / 2**30:.2f} GiB reserved, headroom {big.headroom_bytes / 2**30:.2f} GiB "
            f"({len(big.tried)} estimates)"
        )
    return 0 if big.value is not None else 1
