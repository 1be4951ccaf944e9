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
    rows_text,
    write_figure,
)

SUMMARY = "search the memory-saving settings for the fastest configuration that fits a GPU"


def add_parser(sub: argparse._SubParsersAction, formatter: type) -> None:
    """The ``plan`` subcommand's options."""
    from ..planning import DIMENSIONS

    p = sub.add_parser(
        "plan",
        help=SUMMARY,
        description=SUMMARY + ". Fix what you will not change (model, size, inputs, batch, LoRA, precision, any "
        "optimization given as a flag); memkit searches the optimizer (AdamW, 8-bit AdamW), a quantized base (LoRA "
        "runs), the feed-forward split, checkpointing and the allocator's expandable segments, and lists the "
        "configurations that fit, fastest first, each with the `memkit estimate` flags that reproduce it.",
        epilog="examples:\n  memkit plan flux --gpu 4090 --lora 16\n  memkit plan flux --gpu h100 --json\n"
        "  memkit plan wan --gpu 24GiB --lora 32 --frames 33\n"
        "  memkit plan flux --gpu 4090 --lora 16 --time 6 --plot plan.html",
        formatter_class=formatter,
    )
    p.add_argument("preset", metavar="MODEL", help="a preset, its hub id, a folder or a config.json")
    p.add_argument("--gpu", required=True, metavar="NAME", help="the GPU to fit (4090, h100, 24GiB...)")
    p.add_argument("--size", choices=("full", "small", "tiny"), default="full", help="model size")
    p.add_argument("--batch-size", type=int, default=1, metavar="N", help="samples per step (fixed)")
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None, help="fixed, as in memkit estimate")
    p.add_argument(
        "--search",
        default=",".join(DIMENSIONS),
        metavar="DIM[,DIM...]",
        help=f"the dimensions to search, of {', '.join(DIMENSIONS)}",
    )
    for key, unit in SIZE_FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=int, metavar="N", default=None, help=f"in {unit}")
    fixed = p.add_argument_group("fixed optimizations (each takes its dimension out of the search)")
    specs = optimization_specs()
    add_optimization_flags(fixed, specs)
    p.add_argument(
        "--time",
        type=int,
        default=0,
        metavar="N",
        help="estimate the step time of the first N configurations that fit on the GPU (memkit.steptime: a count of "
        "the step's ops: 29 s for full Flux in a fresh process here) and rank them by it; 0: by what they switch on",
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
        help="with --time N: write the frontier figure (step time against peak reserved memory, each timed "
        "configuration, the GPU's usable bytes, the chosen one; memkit.plots.plan_figure) as FILE.html, or FILE.png "
        "(needs kaleido and Chromium)",
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
    search = [d.strip() for d in args.search.split(",") if d.strip()]
    bad = [d for d in search if d not in DIMENSIONS]
    if bad:
        raise CLIError(f"--search {args.search}: {bad} are not dimensions; they are {', '.join(DIMENSIONS)}")
    if args.time < 0:
        raise CLIError(f"--time takes an int >= 0 (configurations to time), got {args.time}")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size takes an int >= 1, got {args.batch_size}")
    if args.plot is not None:
        if args.maximize is not None:
            raise CLIError("--plot draws the search's configurations; --maximize searches a size, not them")
        if args.time < 1:
            raise CLIError("--plot draws the configurations' step times: give --time N (N >= 1) to time the first N")
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
            args.preset, args.gpu, optimizations=fixed, search=search, size=args.size, batch_size=args.batch_size,
            mixed_precision=args.mixed_precision, time_steps=args.time,
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
    except ValueError as e:  # nothing timed: a GPU without compute figures, a mixed-precision run
        raise CLIError(f"--plot {path}: {e}", code=1) from None
    write_figure(fig, path, png=path.lower().endswith(".png"), what="plan")
    print(f"wrote {path}", file=out)


def _print(args: argparse.Namespace, result, out) -> None:
    """The plan as a table: its GPU, then each configuration that fits, fastest first."""
    gib = 2**30
    print(
        f"memkit plan: {args.preset} ({args.size}) on {result.gpu.name} "
        f"({result.gpu.usable_bytes()[0] / gib:.2f} GiB usable); {result.estimates} estimates in {result.seconds:.0f} s"
        + (" (interrupted: what was found so far)" if result.interrupted else ""),
        file=out,
    )
    rows = []
    for i, c in enumerate(result.configs):
        time_ = f"{c.step_seconds:.2f} s/step" if c.step_seconds is not None else "step time not estimated (--time N)"
        rows.append(
            (f"{i + 1}. {' '.join(c.flags) or '(nothing switched on)'}",
             f"{c.peak_reserved_bytes / gib:.2f} GiB reserved, headroom {c.headroom_bytes / gib:.2f} GiB, {time_}")
        )  # fmt: skip
    print(rows_text(rows) if rows else "  nothing fits", file=out)


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
