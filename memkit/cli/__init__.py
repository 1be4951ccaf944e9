"""The ``memkit`` command line: estimate a full-size step, inspect a CUDA memory snapshot, write an HTML report.

Every subcommand calls the library (``memkit.estimate``, ``memory.snapshot.read_snapshot``, ``memkit.compare``)
and only formats what comes back. Bad input (an unknown preset, a pattern an optimization refuses, a corrupted
snapshot) ends with one ``memkit COMMAND: error: ...`` line and exit status 2, never a traceback.

Example:
    $ memkit estimate flux --checkpointing all
    $ memkit inspect snapshot.pickle --top 5
    $ memkit report pixart --out report.html
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Collection, Sequence

import memkit

from ..optimizers import OPTIMIZER_ON, OPTIMIZERS
from ..units import UNITS
from ._common import DTYPE_NAMES, SIZE_FLAGS, CLIError, machine_info

COMMANDS = ("estimate", "plan", "inspect", "report", "models")
_SUMMARY = {
    "estimate": "estimate the peak memory of one step on fake tensors (no memory, no GPU needed)",
    "plan": "search the memory-saving settings for the fastest configuration that fits a GPU",
    "inspect": "summarize a CUDA memory snapshot (.pickle) and its largest allocations at the peak",
    "report": "compare the optimizations on a real small model and write one self-contained HTML report",
    "models": "list the presets (hub ids, parameters) and which diffusers transformer/UNet classes memkit supports",
}

__all__ = [
    "CLIError",
    "build_parser",
    "machine_info",
    "main",
]


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples as written and shows a default only where it says something."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and action.const is None and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _wrap(text: str) -> str:
    width = min(100, shutil.get_terminal_size().columns - 2)
    return textwrap.fill(text, width)


def _presets_epilog() -> str:
    return "presets:\n" + "\n".join(f"  {k:<12} {p.description}" for k, p in memkit.PRESETS.items())


def _runner(command: str) -> Callable[[argparse.Namespace], int]:
    """The subcommand's ``run``, imported when it runs: ``estimate`` and ``report`` need torch, ``inspect`` not."""

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(f"{__name__}.{command}").run(args)

    return run


def build_parser(commands: Collection[str] = COMMANDS) -> argparse.ArgumentParser:
    """The ``memkit`` argument parser (subcommands ``estimate``, ``inspect``, ``report``).

    Only the ``commands`` given get their options (``estimate`` and ``report`` list presets and optimizations,
    which imports torch); the others are listed with their one-line help, so ``memkit --help`` and
    ``memkit inspect`` start without torch.
    """
    parser = argparse.ArgumentParser(
        prog="memkit",
        description="Measure and cut the memory of diffusion transformers.",
        epilog="examples:\n  memkit estimate flux --checkpointing all\n  memkit inspect snapshot.pickle\n"
        "  memkit report pixart --out report.html\n\nRun 'memkit COMMAND --help' for each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"memkit {memkit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        if command in commands:
            _ADD[command](sub)
        else:
            sub.add_parser(command, help=_SUMMARY[command])
    return parser


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    from ._common import add_optimization_flags, optimization_specs

    p = sub.add_parser(
        "estimate",
        help=_SUMMARY["estimate"],
        description=_wrap(
            "Estimate the memory of one training or inference step of a preset, at full size by default, without "
            "allocating it: the model runs on fake tensors while memkit's tracker adds up every storage. Full Flux "
            "(11.9B parameters) takes tens of seconds and a few hundred MiB of RAM, on any machine. With --device "
            "cuda (the default) sizes are rounded like the CUDA caching allocator, so the peak compares with "
            "torch.cuda.max_memory_allocated(). Prints GiB (--unit) and seconds; --json prints bytes."
        ),
        epilog="examples:\n"
        "  memkit estimate flux                          # full Flux, bf16 AdamW training step, GiB\n"
        "  memkit estimate flux --checkpointing all      # the same with gradient checkpointing\n"
        "  memkit estimate ltx-video --checkpointing auto --budget 20GiB   # the fewest blocks that fit\n"
        "  memkit estimate flux --lora 16                # LoRA rank 16 (peft) on the script's default layers\n"
        "  memkit estimate flux --fsdp 8                 # per GPU, sharded over 8 GPUs with FSDP2\n"
        "  memkit estimate flux --fsdp 8,cpu-offload     # the same, shards and optimizer in CPU memory\n"
        "  memkit estimate wan --inference --frames 81 --height 720 --width 1280\n"
        "  memkit estimate flux --grad-accum 4           # 4 micro-batches per optimizer step\n"
        "  memkit estimate flux --quantize nf4 --lora 16 --text-encoders gpu --validate 100:28   # the whole job\n"
        "  memkit estimate flux --mixed-precision bf16   # fp32 weights and AdamW, bf16 autocast\n"
        "  memkit estimate flux --optimizer-on cpu       # AdamW's state and step in CPU memory (torchao)\n"
        "  memkit estimate sd3 --batch-size 4 --json     # machine-readable, bytes\n"
        "  memkit estimate flux --alloc-conf expandable_segments:True   # reserved with expandable segments\n"
        "  memkit estimate pixart --gpu 4090 && accelerate launch train.py   # exit status 0 where it fits\n"
        "  memkit estimate Wan-AI/Wan2.1-T2V-14B-Diffusers   # a preset by its hub id, offline\n"
        "  memkit estimate path/to/transformer/config.json   # any config of a class memkit feeds\n\n"
        + _presets_epilog(),
        formatter_class=_Formatter,
    )
    p.add_argument(
        "preset",
        metavar="MODEL",
        help="a preset (see the list below), its hub id (offline), a save_pretrained folder, a config.json, or a "
        "diffusers hub id (only its config.json is downloaded)",
    )
    p.add_argument(
        "--size", choices=("full", "small", "tiny"), default="full", help="model size (presets; a config is 'full')"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--training",
        dest="mode",
        action="store_const",
        const="training",
        help="forward, backward, optimizer step (the default)",
    )
    mode.add_argument(
        "--inference", dest="mode", action="store_const", const="inference", help="forward only, under no_grad"
    )
    p.set_defaults(mode="training")
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="parameter and input dtype, pure: every op in it (default: bf16; fp32 with --mixed-precision)",
    )
    p.add_argument(
        "--optimizer",
        choices=(*OPTIMIZERS, "none"),
        default=None,
        help="optimizer of the training step (default: adamw in training; none: gradients only). adamw8bit, "
        "paged-adamw8bit, lion, prodigy and came need the finetune extra: pip install 'memkit[finetune]'",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="run N steps and measure only the last (1: the first step alone). Default: in training both the first "
        "step and the steady step that every later step repeats (the optimizer state exists), the larger peak "
        "being the answer",
    )
    p.add_argument("--batch-size", type=int, default=1, metavar="N", help="samples per step")
    recipe = p.add_argument_group("training recipe")
    recipe.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="gradient accumulation over N micro-batches (of --batch-size each) per optimizer step: the gradients "
        "of the first live through every later micro-batch's forward and backward",
    )
    recipe.add_argument(
        "--mixed-precision",
        choices=("bf16", "fp16"),
        default=None,
        help="fp32 master weights, gradients and optimizer state, the forward under autocast to this dtype (as "
        "accelerate's --mixed_precision); fp16 adds a gradient scaler. --dtype stays the pure-dtype switch",
    )
    recipe.add_argument(
        "--fused-backward",
        action="store_true",
        help="update each parameter and free its gradient in the backward (a fused back pass): no full set of "
        "gradients ever lives; refuses --grad-accum N > 1",
    )
    recipe.add_argument(
        "--optimizer-on",
        choices=OPTIMIZER_ON,
        default="device",
        help="where the optimizer keeps its state and steps: cpu is torchao's CPUOffloadOptimizer (pinned host "
        "copies of the parameters and gradients, the state and the update in CPU memory; parameters under 4,096 "
        "elements stay on the device), its bytes reported apart as in CPU memory; refuses --fused-backward and "
        "--fsdp; needs the finetune extra",
    )
    recipe.add_argument(
        "--offload-gradients",
        action="store_true",
        help="with --optimizer-on cpu: free each device gradient once it is copied to the host (torchao's "
        "offload_gradients); refuses --grad-accum N > 1",
    )
    p.add_argument(
        "--alloc-conf",
        default="",
        metavar="CONF",
        help="a PYTORCH_CUDA_ALLOC_CONF string (e.g. expandable_segments:True) for the caching allocator the "
        "estimate's events are replayed through to give reserved bytes (device cuda); default: torch's defaults",
    )
    p.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help="judge the peak reserved bytes against a GPU (t4, l4, a10g, 3090, 4090, 5090, l40s, a100-40gb, "
        "a100-80gb, h100, h200, b200, mi300x, or a size such as 24GiB): fits / within the spread / does not fit; the "
        "exit status is the verdict (0 fits, 1 does not or may not, 2 the estimate could not run)",
    )
    for key, unit in SIZE_FLAGS.items():
        p.add_argument(
            "--" + key.replace("_", "-"),
            dest=key,
            type=int,
            metavar="N",
            default=None,
            help=f"input size in {unit} (default: the preset's, see memkit.PRESETS)",
        )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device to plan for")
    job = p.add_argument_group(
        "the whole job (memkit.Pipeline): the pipeline's components beside the transformer, and the phases outside "
        "the step"
    )
    where = "precomputed (default: not loaded, the cached outputs are the inputs), gpu (resident) or cpu (moved on "
    job.add_argument(
        "--text-encoders",
        choices=("precomputed", "gpu", "cpu"),
        default="precomputed",
        help=f"where the preset pipeline's text encoders live: {where}to encode each batch, then off)",
    )
    job.add_argument(
        "--vae",
        choices=("precomputed", "gpu", "cpu"),
        default="precomputed",
        help=f"where the VAE lives: {where}to encode or decode, then off)",
    )
    job.add_argument(
        "--cfg",
        choices=("batch", "separate"),
        default=None,
        help="classifier-free guidance of an inference or validation denoising step: batch (conditional and "
        "unconditional in one doubled batch, as diffusers' pipelines) or separate (two passes); default none (a "
        "guidance-distilled model such as Flux-dev)",
    )
    job.add_argument("--vae-tiling", action="store_true", help="the VAE decodes (and encodes) in tiles")
    job.add_argument("--vae-slicing", action="store_true", help="the VAE decodes a batch one sample at a time")
    job.add_argument(
        "--precompute",
        action="store_true",
        help="training: the job includes encoding the dataset with each precomputed component on the GPU, in turn, "
        "beside the loaded transformer (diffusers' training scripts' order)",
    )
    job.add_argument(
        "--validate",
        metavar="EVERY:STEPS",
        default=None,
        help="training: sample every EVERY steps with STEPS denoising steps (one denoising step and the VAE decode "
        "beside the training state; off by default)",
    )
    job.add_argument(
        "--quantize-on",
        choices=("cpu", "gpu"),
        default="cpu",
        help="with --quantize: quantize in host memory, then move (default), or load the checkpoint onto the GPU and "
        "quantize there (its whole bf16 weights resident first)",
    )
    group = p.add_argument_group("optimizations (several compose, applied in this order)")
    specs = optimization_specs()
    add_optimization_flags(group, specs)
    group.add_argument(
        "--dora",
        action="store_true",
        help="with --lora: weight-decomposed LoRA (peft's use_dora), which materialises each adapted layer's "
        "weight in the forward (the same as --lora RANK:dora)",
    )
    group.add_argument(
        "--budget",
        metavar="SIZE",
        default=None,
        help="with --checkpointing auto[@PROVIDER]: the peak to fit (e.g. 40GiB); memkit checkpoints the fewest "
        "blocks whose estimated peak fits (~2 + log2(blocks) estimates)",
    )
    old = p.add_argument_group("deprecated (go in the next release): the options of --fsdp N[,OPTION...]")
    old.add_argument("--fsdp-keep-unsharded", action="store_true", help="use --fsdp N,keep-unsharded")
    old.add_argument("--fsdp-param-dtype", choices=DTYPE_NAMES, default=None, help="use --fsdp N,DTYPE (e.g. bf16)")
    old.add_argument("--fsdp-cpu-offload", action="store_true", help="use --fsdp N,cpu-offload")
    p.add_argument("--unit", choices=tuple(UNITS), default="GiB", help="unit of the printed table")
    p.add_argument("--html", metavar="FILE", help="write the memory timeline as an interactive HTML figure")
    p.add_argument("--png", metavar="FILE", help="write the memory timeline as a PNG (needs kaleido and Chromium)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (bytes, seconds) instead")
    p.set_defaults(run=_runner("estimate"), optimization_specs=specs)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help=_SUMMARY["inspect"],
        description=_wrap(
            "Read a CUDA allocator snapshot (torch.cuda.memory._dump_snapshot(), or one written by "
            "memkit.memory.write_snapshot) safely, without running any code it may contain, and print its "
            "events, devices, baseline (what was live before the trace began), peak (bytes) and when it happened "
            "(seconds, or the event index when the trace has no times), each GPU's own peak (a total over several "
            "GPUs says so), out-of-memory errors, the allocator's segments by block state, and the N largest "
            "allocations live at each peak. A snapshot records no categories: its bytes are 'unknown'. --replay "
            "instead replays the trace through memkit's caching-allocator model and checks that it makes the segments "
            "the GPU's allocator made."
        ),
        epilog="examples:\n  memkit inspect snapshot.pickle\n  memkit inspect snapshot.pickle --top 20 --html t.html\n"
        "  memkit inspect snapshot.pickle --replay   # exit status 0 when the model made every segment alike",
        formatter_class=_Formatter,
    )
    p.add_argument("snapshot", metavar="SNAPSHOT.pickle", help="snapshot file")
    p.add_argument("--top", type=int, default=10, metavar="N", help="how many allocations at each peak to list")
    p.add_argument(
        "--html",
        metavar="FILE",
        help="write the memory timeline as an interactive HTML figure (a panel per GPU; the segments if no trace)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the summary as JSON instead (bytes; seconds, or events: time_unit)"
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="replay the trace through memkit's caching-allocator model and list, per GPU, each segment the real "
        "allocator made (segment_alloc, segment_map) beside the model's; exit status 1 when any differs",
    )
    p.add_argument(
        "--alloc-conf",
        metavar="CONF",
        help="PYTORCH_CUDA_ALLOC_CONF for --replay (default: the one the snapshot recorded, else torch's defaults)",
    )
    p.set_defaults(run=_runner("inspect"))


def _add_report(sub: argparse._SubParsersAction) -> None:
    from ._common import report_variants

    p = sub.add_parser(
        "report",
        help=_SUMMARY["report"],
        description=_wrap(
            "Build a preset at a tiny or small size with random weights, run the baseline and each optimization "
            f"({', '.join(report_variants())}) on the same weights and inputs, tracked exactly, and write one HTML "
            "file "
            "(plotly.js inlined, works offline): the comparison table (peak by category in MiB or GiB, step "
            "seconds, output and gradient differences, pass/fail), the comparison figure and the baseline's "
            "memory timeline. tiny takes seconds; small takes minutes on a laptop CPU."
        ),
        epilog="examples:\n  memkit report pixart\n  memkit report flux --size small --out flux.html\n\n"
        + _presets_epilog(),
        formatter_class=_Formatter,
    )
    p.add_argument("preset", metavar="PRESET", help="model preset (see the list below)")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny", help="model size (real memory is used)")
    p.add_argument("--out", default="report.html", metavar="FILE", help="HTML file to write")
    p.add_argument("--mode", choices=("training", "inference"), default="training", help="step to measure")
    p.add_argument("--repeats", type=int, default=3, metavar="N", help="timed steps per variant (0: skip timing)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_runner("report"))


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help=_SUMMARY["models"],
        description=_wrap(
            "List the presets, grouped by image and video, with the hub id each answers to offline and its parameter "
            "count at full size; then every transformer and UNet class of the installed diffusers, supported (memkit "
            "builds its inputs: any config.json of it is estimated) or refused with the reason."
        ),
        epilog="examples:\n  memkit models\n  memkit models --json",
        formatter_class=_Formatter,
    )
    p.add_argument("--json", action="store_true", help="print the presets and classes as JSON")
    p.set_defaults(run=_runner("models"))


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from .plan import add_parser

    add_parser(sub, _Formatter)


_ADD = {
    "estimate": _add_estimate, "plan": _add_plan, "inspect": _add_inspect, "report": _add_report,
    "models": _add_models,
}  # fmt: skip


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named on the line: the first word that is not an option (``memkit`` itself takes none
    with a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> from memkit.cli import main
        >>> main(["estimate", "flux", "--size", "tiny", "--json"])
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser({_command_of(argv)} & set(COMMANDS))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage error (already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe (``| head``) raises here, not at exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
    except CLIError as e:
        print(f"memkit {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """After the reader of our output went away: send what Python still flushes at exit to /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output)
        pass
