"""What the subcommands share: errors, optimization flags (from the library's registry), formatting, figure output.

Nothing here imports torch at import time (``memkit inspect`` and ``memkit --help`` need none): the registry and
the dtypes are resolved when ``estimate`` or ``report`` use them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import memkit

if TYPE_CHECKING:
    from ..handle import Optimization
    from ..optimizations import Spec

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # --dtype choices; DTYPES maps them to torch dtypes
SIZE_FLAGS = {"height": "pixels", "width": "pixels", "frames": "video frames", "text_len": "text tokens"}
CHROMIUM = "/usr/bin/chromium"


class CLIError(Exception):
    """A problem with the user's input or environment: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ---- optimizations ------------------------------------------------------------------------------------------
# The flags and the report's variants are built from the library's one registry (memkit.optimizations): a new
# optimization registered there gets its ``--<name> VALUE`` flag and its report variants with no change here.


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # torch is imported only by the commands that use it
        import torch

        return dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32), strict=True))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def optimization_specs() -> tuple[Spec, ...]:
    """The registered optimizations, in the order they compose."""
    from ..optimizations import REGISTRY

    return tuple(REGISTRY.values())


def flag_of(spec: Spec) -> str:
    """The command-line flag of an optimization: ``--<name>``."""
    return "--" + spec.name


def dest_of(spec: Spec) -> str:
    return "opt_" + spec.name.replace("-", "_")


def add_optimization_flags(group: argparse._ArgumentGroup, specs: Sequence[Spec]) -> None:
    """One ``--<name> [VALUE]`` flag per optimization; the flag alone means its default value."""
    for spec in specs:
        group.add_argument(
            flag_of(spec),
            dest=dest_of(spec),
            metavar=spec.metavar,
            nargs="?",
            const=spec.choices[0],
            default=None,
            help=f"{spec.summary.replace('%', '%%')}. {spec.metavar}: {', '.join(spec.choices)} "
            f"(alone: {spec.choices[0]})",
        )


def optimizations_from(args: Any, specs: Sequence[Spec]) -> list[Optimization]:
    """The optimization objects the parsed flags ask for, in registry order; a refused value is a CLIError."""
    built = []
    for spec in specs:
        value = getattr(args, dest_of(spec), None)
        if value is None:
            continue
        try:
            built.append(spec.parse(value))
        except (ValueError, TypeError) as e:
            raise CLIError(f"{flag_of(spec)} {value}: {e}") from None
    return built


def report_variants(specs: Sequence[Spec] | None = None) -> dict[str, list[Optimization]]:
    """The variants ``memkit report`` compares against the baseline: ``"name:value"`` -> fresh optimizations."""
    specs = optimization_specs() if specs is None else specs
    return {f"{spec.name}:{value}": [spec.parse(value)] for spec in specs for value in spec.report}


# ---- formatting ---------------------------------------------------------------------------------------------
def fmt_count(n: int) -> str:
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix} ({n:,})"
    return f"{n:,}"


def rows_text(rows: Sequence[tuple[str, str]], indent: str = "  ") -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{indent}{k:<{width}}  {v}" for k, v in rows)


def machine_info() -> dict[str, str]:
    """The machine and software a measurement ran on: CPU model, cores, RAM, versions, date."""
    import diffusers
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu,
        "cores": f"{psutil.cpu_count(logical=False) or '?'} physical, {psutil.cpu_count()} logical",
        "ram": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "gpu": cuda,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "memkit": memkit.__version__,
    }


def check_writable(path: str | None) -> None:
    """Fail before the long work, not after it, when an output file cannot be written."""
    if path is None:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise CLIError(f"cannot write {path}: no folder {folder}")
    if Path(path).is_dir():
        raise CLIError(f"cannot write {path}: it is a folder")


def write_figure(fig, path: str, *, png: bool = False, what: str = "timeline") -> None:
    """Write a plotly figure as self-contained HTML, or as PNG (kaleido + Chromium)."""
    target = Path(path)
    if png:
        if "BROWSER_PATH" not in os.environ and os.path.exists(CHROMIUM):
            os.environ["BROWSER_PATH"] = CHROMIUM
        try:
            import kaleido  # noqa: F401
        except ImportError:
            raise CLIError("PNG export needs kaleido: pip install kaleido (or use --html)", code=1) from None
        try:
            fig.write_image(target, width=1200, height=600)
        except Exception as e:  # kaleido raises its own types when it finds or starts no browser
            raise CLIError(
                f"could not write {what} PNG {path}: {type(e).__name__}: {e}. PNG export needs Chromium "
                "(apt-get install chromium, or set BROWSER_PATH to a Chrome/Chromium binary); --html needs nothing",
                code=1,
            ) from None
    else:
        try:
            fig.write_html(target, include_plotlyjs=True, full_html=True)
        except OSError as e:
            raise CLIError(f"could not write {what} {path}: {e}", code=1) from None


def check_preset(name: str) -> None:
    if name not in memkit.PRESETS:
        listing = "\n".join(f"  {k:<12} {p.description}" for k, p in memkit.PRESETS.items())
        raise CLIError(f"unknown preset {name!r}; choose one of:\n{listing}")
