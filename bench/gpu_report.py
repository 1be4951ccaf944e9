"""``python -m bench.gpu_report [FILE ...]``: the GPU suite's figures (``tests/gpu``, ``make test-gpu``) as the results
section of ``bench/GPU.md``.

Reads the newest ``bench/gpu_results/*.jsonl`` (or the JSON-lines files named), one line per pair of figures a test
recorded (memkit's, the GPU's), and rewrites ``GPU.md`` below its marker line: the machines and versions, then one
row per pair with the difference in bytes and percent and the test's outcome. Prints what it wrote. Without results
it says so and changes nothing (exit status 0: a CPU machine's ``make test-gpu`` skips, it does not fail).

Example:
    $ python -m bench.gpu_report                                  # the newest run
    $ python -m bench.gpu_report bench/gpu_results/20261126T1000Z.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("gpu_results")
GPU_MD = Path(__file__).with_name("GPU.md")
MARKER = "<!-- results: everything below is written by `python -m bench.gpu_report` -->"
MACHINE = ("gpu", "capability", "torch", "cuda", "diffusers")


def newest(folder: Path | None = None) -> list[Path]:
    """The newest results file in ``folder`` (default :data:`RESULTS`; names are UTC times), as a list; empty when
    there is none."""
    files = sorted((folder or RESULTS).glob("*.jsonl"))
    return files[-1:]


def load(paths: Iterable[Path]) -> list[dict]:
    """Every record of ``paths``, in order (blank lines skipped)."""
    return [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]


def _pair(pair: Sequence[int] | None) -> tuple[str, str]:
    if pair is None:
        return "", ""
    ours, real = (int(x) for x in pair)
    diff = ours - real
    percent = f" ({diff / real:+.2%})" if real else ""
    return f"{ours:,} / {real:,}", f"{diff:+,}{percent}"


def table(records: Sequence[dict]) -> str:
    """The markdown table of ``records``: one row per pair of figures, bytes as memkit's / the GPU's."""
    lines = [
        "| test | preset | memkit's figure | allocated: memkit / GPU (B) | Δ | reserved: memkit / GPU (B) | Δ "
        "| outcome |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        allocated, allocated_diff = _pair(r.get("allocated"))
        reserved, reserved_diff = _pair(r.get("reserved"))
        cells = (r["test"], r["preset"], r["what"], allocated, allocated_diff, reserved, reserved_diff, r["outcome"])
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def render(records: Sequence[dict]) -> str:
    """The results section: when and where the figures were measured, then :func:`table`."""
    machines = sorted({tuple(str(r.get(k)) for k in MACHINE) for r in records})
    times = sorted(r["time"] for r in records)
    where = "; ".join(", ".join(f"{k} {v}" for k, v in zip(MACHINE, m, strict=True)) for m in machines)
    return (
        f"Run {times[0]} to {times[-1]} on {where}.\n\n"
        "Bytes are memkit's figure / the GPU's counter (`max_memory_allocated`, `max_memory_reserved`, or what the "
        "test's row names); Δ is memkit's minus the GPU's.\n\n" + table(records) + "\n"
    )


def write(section: str, path: Path = GPU_MD) -> None:
    """Replace everything below ``path``'s marker line with ``section``."""
    text = path.read_text()
    head, found, _ = text.partition(MARKER)
    if not found:
        raise ValueError(f"{path} has no marker line {MARKER!r}")
    path.write_text(f"{head}{MARKER}\n\n{section}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="JSON-lines results (default: the newest in gpu_results)")
    parser.add_argument("--out", type=Path, default=GPU_MD, help=f"markdown file to rewrite (default: {GPU_MD})")
    args = parser.parse_args(argv)
    records = load(args.files or newest())
    if not records:
        print(f"no GPU results in {RESULTS} (make test-gpu writes them on a machine with CUDA): {args.out} unchanged")
        return 0
    section = render(records)
    write(section, args.out)
    print(section, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
