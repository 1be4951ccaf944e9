"""memkit's benchmarks: speed and memory of memkit itself, as ratios against a baseline measured in the same run.

Each benchmark is one module with ``TITLE`` and ``run(quick: bool) -> Section``. ``python -m bench`` runs them
all (``python -m bench NAME ...`` a subset) and writes ``bench/RESULTS.md``: the machine, then one section per
benchmark. A partial run replaces only its own sections, so every section says when it ran. A benchmark that
fails is reported as failed with its error and the others still run. Nothing here asserts a timing.

Example:
    $ python -m bench                     # everything, several minutes
    $ python -m bench snapshot_load       # one benchmark
    $ python -m bench --quick             # smaller cases, to check that the benchmarks run
"""

from __future__ import annotations

import datetime
import importlib
import os
import re
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCHMARKS: tuple[str, ...] = (
    "tracking_overhead",
    "learned_workspace",
    "estimate_full",
    "estimate_speed",
    "snapshot_load",
    "caching_allocator",
    "reserved",
    "ema",
    "feedforward",
    "checkpointing",
    "offload",
    "fsdp",
    "optimizers",
    "recipes",
    "pipeline",
    "steptime",
    "plan",
)
"""Benchmark module names, in run order."""

RESULTS = Path(__file__).with_name("RESULTS.md")


@dataclass
class Table:
    """One markdown table: a caption and rows of column -> value (str, int or float)."""

    caption: str
    rows: list[dict[str, Any]]


@dataclass
class Section:
    """What one benchmark reports."""

    name: str
    title: str
    text: str = ""
    """Markdown: what is measured and how."""
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Targets met or missed, caveats: one bullet each."""
    seconds: float = 0.0
    failed: str | None = None
    """The error, if the benchmark failed."""
    date: str = ""


def log(message: str) -> None:
    """Progress line, flushed at once (benchmarks run for minutes)."""
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch thread (timings on a shared machine), then restore the count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of column -> value as a GitHub markdown table (columns in first-seen order)."""
    if not rows:
        return "_(no rows)_"
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, str]:
    """The machine, the software versions, the date, and how busy the machine was."""
    from memkit.cli import machine_info

    info = machine_info()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    info["load average (1, 5, 15 min)"] = ", ".join(f"{x:.2f}" for x in load)
    return info


def _render(section: Section) -> str:
    parts = [f"<!-- bench:{section.name} -->", f"## {section.title}", ""]
    status = f"FAILED after {section.seconds:.0f} s" if section.failed else f"took {section.seconds:.0f} s"
    parts += [f"_`python -m bench {section.name}`, run {section.date}, {status}._", ""]
    if section.text:
        parts += [section.text.strip(), ""]
    if section.failed:
        parts += ["```", section.failed.strip(), "```", ""]
    for table in section.tables:
        if table.caption:
            parts += [f"**{table.caption}**", ""]
        parts += [markdown_table(table.rows), ""]
    parts += [f"- {note}" for note in section.notes]
    if section.notes:
        parts.append("")
    parts.append(f"<!-- /bench:{section.name} -->")
    return "\n".join(parts)


def _old_sections(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    found = re.finditer(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", text, flags=re.S)
    return {m[1]: m[0] for m in found}


def write_results(sections: Sequence[Section], info: dict[str, str], path: Path = RESULTS) -> None:
    """Write ``path``: this run's machine and sections, keeping other benchmarks' sections from before."""
    blocks = _old_sections(path)
    for section in sections:
        blocks[section.name] = _render(section)
    order = [n for n in BENCHMARKS if n in blocks] + [n for n in blocks if n not in BENCHMARKS]
    head = [
        "# memkit benchmarks",
        "",
        "Written by `python -m bench` (see `bench/__init__.py`). Ratios compare runs made in the same process "
        "on the same machine, interleaved where they are timings; absolute times depend on the machine and on "
        "what else ran on it (see the load average).",
        "",
        f"Last run: {', '.join(s.name for s in sections)}.",
        "",
        markdown_table([{"": k, "value": v} for k, v in info.items()]),
        "",
    ]
    path.write_text("\n".join(head) + "\n" + "\n\n".join(blocks[n] for n in order) + "\n", encoding="utf-8")


def run(names: Sequence[str] = BENCHMARKS, *, quick: bool = False, path: Path = RESULTS) -> list[Section]:
    """Run the benchmarks ``names`` one after another and write ``path``; returns their sections."""
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    info = machine()
    log(f"machine: {info['cpu']}, {info['cores']}, {info['ram']}, load {info['load average (1, 5, 15 min)']}")
    sections = []
    for i, name in enumerate(names, 1):
        log(f"[{i}/{len(names)}] {name}")
        t0 = time.perf_counter()
        date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        try:
            module = importlib.import_module(f"bench.{name}")
            section = module.run(quick=quick)
        except Exception:
            error = traceback.format_exc(limit=-6)
            log(f"{name} FAILED:\n{error}")
            section = Section(name=name, title=name, failed=error)
        section.seconds, section.date = time.perf_counter() - t0, date
        log(f"[{i}/{len(names)}] {name}: {'failed' if section.failed else 'done'} in {section.seconds:.0f} s")
        sections.append(section)
        write_results(sections, info, path)  # after each one, so a crash later keeps what finished
    log(f"wrote {path}")
    return sections
