"""Group offloading to disk on CPU: forward time, peak RSS and bytes read, memkit against diffusers and accelerate.

The ``small`` PixArt-Sigma preset (8 transformer blocks, float32, 256x256 px), inference forwards (``no_grad``),
one torch thread. Variants: the model in RAM; ``memkit.Offload(to="disk")`` at block level (one block a group)
with prefetch 1 (the default), 0 and 2, and at leaf level; diffusers' ``apply_group_offloading(
offload_type="block_level", num_blocks_per_group=1, offload_to_disk_path=...)`` (onload device CPU; its prefetch
needs CUDA streams); accelerate's ``disk_offload`` (per-module hooks reading numpy memmaps).
Then the same model with 28 blocks (the depth of the released PixArt-Sigma, at the small width: the preset's
small config with ``num_layers=28``), the model in RAM against memkit at block level only.

Time: every variant's model built once in this process, then one forward each per round, in an order rotated
each round, after two warm-up rounds (the first learns the order of the groups, the second reads ahead); the
median of the rounds, as a ratio to the model in RAM and to diffusers from the same rounds. The files sit in the
page cache after the first read (nothing here drops caches, which would need root and slow the machine for
everyone), so reads are memory copies out of the kernel's cache, not device reads: the cost measured is memkit's
own (copy, hooks), the floor a fast NVMe approaches.

Peak RSS: each variant in a fresh process (``python -m bench.offload --child NAME LAYERS``): imports and a tiny model
first, ``malloc_trim``, the process's RSS as the base; then the model built, offloaded, two warm-up forwards and
one sampled forward (RSS every 1 ms, ``memkit.memory.sample_rss``). Reported: the peak over the base, against
the model's weight bytes. Bytes read per forward: ``rchar`` of ``/proc/self/io`` around the sampled forward.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import memkit

from . import Section, Table, log

TITLE = "offload: disk offloading on CPU, forward time, peak RSS and bytes read against diffusers and accelerate"
MiB = 2**20
PRESET, SIZE = "pixart", "small"
DEEP = 28  # blocks of the second model: the released PixArt-Sigma's depth
VARIANTS = (
    "ram",
    "memkit block prefetch=1",
    "memkit block prefetch=0",
    "memkit block prefetch=2",
    "memkit leaf prefetch=1",
    "diffusers block",
    "accelerate disk_offload",
)


DEEP_VARIANTS = ("ram", "memkit block prefetch=1", "memkit block prefetch=0", "memkit block prefetch=2")


def _model(layers: int = 0) -> torch.nn.Module:
    """The preset at SIZE, or (``layers``) its config with that many transformer blocks, built the same way."""
    if not layers:
        return memkit.load_model(PRESET, size=SIZE)
    from dataclasses import replace

    from memkit.models import _build
    from memkit.presets import PRESETS

    preset = PRESETS[PRESET]
    configs = {**preset.configs, SIZE: {**preset.configs[SIZE], "num_layers": layers}}
    return _build(replace(preset, configs=configs), SIZE, torch.float32, 0, torch.device("cpu"))


def _available(name: str) -> bool:
    if name.startswith("accelerate") or name.startswith("diffusers"):
        return importlib.util.find_spec("accelerate") is not None  # diffusers' group offloading needs it too
    return True


def _apply(name: str, model: torch.nn.Module, folder: str):
    """Offload ``model`` as variant ``name``; returns something to keep alive (a handle) or None."""
    if name == "ram":
        return None
    if name.startswith("memkit"):
        _, group, prefetch = name.split()
        return memkit.Offload(to="disk", group=group, prefetch=int(prefetch.split("=")[1]), path=folder).apply(model)
    if name == "diffusers block":
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(
            model, onload_device="cpu", offload_type="block_level", num_blocks_per_group=1,
            offload_to_disk_path=os.path.join(folder, "diffusers"),
        )  # fmt: skip
        return None
    if name == "accelerate disk_offload":
        from accelerate import disk_offload

        disk_offload(model, os.path.join(folder, "accelerate"), execution_device=torch.device("cpu"))
        return None
    raise ValueError(f"unknown variant {name!r}")


def _cpu() -> str:
    """lscpu's model name and the vector flags that pick kernels, and torch's CPU capability."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx", "amx", "fma"))]
    model = fields.get("Model name", "?").strip()
    return f"{model}, flags {' '.join(flags) or '?'}, torch capability {torch.backends.cpu.get_cpu_capability()}"


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])
    except (OSError, StopIteration):
        return 0


def child(name: str, layers: int = 0) -> dict:
    """One variant's peak RSS over a forward, in this (fresh) process."""
    from memkit.memory import rss_bytes, sample_rss

    torch.set_num_threads(1)
    memkit.load_model(PRESET)  # imports diffusers' modules: not the model's memory
    _trim()
    base = rss_bytes()
    model = _model(layers)
    inputs = memkit.make_inputs(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as folder:
        keep = _apply(name, model, folder)
        _trim()
        with torch.no_grad():  # the first forward learns the order of the groups, the second reads ahead
            model(**inputs)
            model(**inputs)
        read0 = _rchar()
        with torch.no_grad(), sample_rss() as rss:
            model(**inputs)
        read = _rchar() - read0
        del keep
    return {"weights": weights, "peak_over_base": rss.peak_bytes - base, "read": read}


def _rss_rows(names: list[str], layers: int = 0) -> dict[str, dict]:
    out = {}
    for name in names:
        done = subprocess.run(
            [sys.executable, "-m", "bench.offload", "--child", name, str(layers)],
            capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"child {name!r} failed:\n{done.stderr[-3000:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        log(f"  RSS {name}: {out[name]['peak_over_base'] / MiB:.0f} MiB over the base")
    return out


def _times(names: list[str], rounds: int, layers: int = 0) -> dict[str, float]:
    base = _model(layers)
    inputs = memkit.make_inputs(base)
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as folder:
        models, keep = {}, []
        for name in names:
            m = _model(layers)
            m.load_state_dict(base.state_dict())
            keep.append(_apply(name, m, folder))
            models[name] = m
        del base
        _trim()
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds + 2):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    models[name](**inputs)
                    dt = time.perf_counter() - t0
                if r > 1:
                    times[name].append(dt)
        for h in keep:
            if h is not None:
                h.remove()
    return {n: statistics.median(ts) for n, ts in times.items()}


def _measure(names: list[str], rounds: int, layers: int = 0) -> tuple[list[dict], dict]:
    """Each variant's time (this process) and peak RSS (a fresh process each): table rows, and facts for notes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log(f"  timing {len(names)} variants{f' at {layers} blocks' if layers else ''}")
        times = _times(names, rounds, layers)
    finally:
        torch.set_num_threads(threads)
    rss = _rss_rows(names, layers)
    ram, diff = times["ram"], times.get("diffusers block")
    activations = rss["ram"]["peak_over_base"] - rss["ram"]["weights"]  # what the forward adds over the weights
    rows = []
    for name in names:
        r = rss[name]
        mmap = name.startswith(("diffusers", "accelerate"))  # they page files in through mmap: rchar misses it
        row = {"variant": name, "forward s": times[name], "time / RAM": times[name] / ram}
        if diff:
            row["time / diffusers"] = times[name] / diff
        row |= {
            "peak RSS over base MiB": r["peak_over_base"] / MiB,
            "peak RSS / weights": r["peak_over_base"] / r["weights"],
            "weights resident / weights": (r["peak_over_base"] - activations) / r["weights"],
            "read per forward MiB": float("nan") if mmap else r["read"] / MiB,
        }
        rows.append(row)
    weights = rss["ram"]["weights"]
    groups = [g for g in memkit.Offload(to="disk")._groups(_model(layers)) if g.block]
    facts = {
        "weights": weights,
        "blocks": len(groups),
        "share": sum(g.nbytes for g in groups) / weights,
        "block": max(g.nbytes for g in groups),
        "activations": activations,
    }
    return rows, facts


def _rss_note(label: str, by: dict[str, dict], facts: dict) -> str:
    m1, m0 = by["memkit block prefetch=1"], by["memkit block prefetch=0"]
    w = facts["weights"]
    return (
        f"{label}: memkit prefetch=1 {m1['peak RSS / weights']:.2f}x, prefetch=0 {m0['peak RSS / weights']:.2f}x "
        f"({'met' if m1['peak RSS / weights'] <= 0.4 else 'NOT met'} with prefetch 1, the default), counting the "
        f"whole peak: the forward's activations, {facts['activations'] / MiB:.0f} MiB (the RAM model's peak over "
        f"its weights), the layer outside the blocks in use (of {(1 - facts['share']) * w / MiB:.0f} MiB, "
        f"offloaded one layer a group), and the blocks resident ({facts['block'] / MiB:.0f} MiB each, "
        f"{facts['block'] / w:.1%} of the weights). Weights alone (peak minus those activations): "
        f"prefetch=1 {m1['weights resident / weights']:.2f}x, prefetch=0 "
        f"{m0['weights resident / weights']:.2f}x."
    )


def run(quick: bool = False) -> Section:
    names = [n for n in VARIANTS if _available(n)]
    skipped = [n for n in VARIANTS if n not in names]
    rows, facts = _measure(names, rounds=2 if quick else 7)
    deep_rows, deep = _measure(list(DEEP_VARIANTS), rounds=1 if quick else 4, layers=DEEP)
    weights, share = facts["weights"], facts["share"]
    by = {r["variant"]: r for r in rows}
    deep_by = {r["variant"]: r for r in deep_rows}
    m1, d1 = by["memkit block prefetch=1"], deep_by["memkit block prefetch=1"]
    met = {k: v["memkit block prefetch=1"]["peak RSS / weights"] <= 0.4 for k, v in (("8", by), ("deep", deep_by))}
    notes = [
        f"Model: {PRESET} {SIZE}, {weights / MiB:.0f} MiB of float32 weights, {facts['blocks']} blocks ({share:.0%} "
        "of the weights; the rest, embedders and the final layer, offloaded too, one layer a group). The deeper one: "
        f"{deep['weights'] / MiB:.0f} MiB, {deep['blocks']} blocks ({deep['share']:.0%}).",
        f"Target time <= 1.25x the model in RAM at block level with prefetch: {m1['time / RAM']:.2f}x "
        f"({'met' if m1['time / RAM'] <= 1.25 else 'NOT met'}); {d1['time / RAM']:.2f}x at {DEEP} blocks.",
        "Target peak RSS <= 0.4x the weights for a model of 8+ blocks at blocks_per_group=1. "
        + _rss_note(f"{facts['blocks']} blocks", by, facts)
        + " "
        + _rss_note(f"{DEEP} blocks", deep_by, deep)
        + (
            f" So the target is met at {DEEP} blocks but not at 8: at 8 blocks the activations alone are "
            f"{facts['activations'] / weights:.2f}x of the weights, the two resident "
            f"blocks {2 * facts['block'] / weights:.2f}x more; at {DEEP} blocks the same activations and the "
            "blocks are a smaller share of more weights."
            if met["deep"] and not met["8"]
            else ""
        ),
        "Reads go into reused buffers: prefetch + 1 flat buffers of the largest group's bytes, each group's "
        "tensors carved out of one (reused only when nothing else holds it), blocks and the layers outside them "
        "alike: a steady-state forward allocates no weight memory. Measured 2026-11-23 (8 blocks, prefetch 1): "
        "reading the layers outside the blocks into fresh memory instead made the forward wait 15 ms for them "
        "(page faults: 5.6 ms for the 8 MiB caption projection), against 6 ms from the pool.",
    ]
    if "diffusers block" in by:
        notes.append(
            f"Against diffusers' disk offload: memkit prefetch=1 takes {m1['time / diffusers']:.2f}x its time "
            f"({'faster' if m1['time / diffusers'] < 1 else 'NOT faster'}"
            + ("; within the ±10% noise of this machine" if abs(m1["time / diffusers"] - 1) < 0.1 else "")
            + f"), at {m1['peak RSS over base MiB'] / by['diffusers block']['peak RSS over base MiB']:.2f}x its "
            "peak RSS."
        )
    notes.append(
        "Read per forward: rchar of /proc/self/io (read() calls, page cache hits included): memkit reads every "
        "block once per forward. diffusers (safetensors' mmap) and accelerate (numpy memmaps) page their files "
        "in through mmap, which rchar does not count ('-')."
    )
    notes.append(f"CPU: {_cpu()}.")
    if skipped:
        notes.append(f"Not run (accelerate is not installed): {', '.join(skipped)}.")
    notes.append(
        "A shared 2-core machine (see the load average): time ratios within about ±10% are noise. The prefetch "
        "thread reads while the one torch thread computes; with both cores busy with other work the overlap shrinks."
    )
    return Section(
        name="offload",
        title=TITLE,
        text=__doc__.split("\n", 1)[1],
        tables=[
            Table(f"{PRESET} {SIZE}: inference forward, float32, one thread", rows),
            Table(f"{PRESET} {SIZE} config with {DEEP} blocks: inference forward, float32, one thread", deep_rows),
        ],
        notes=notes,
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
    else:
        sys.exit("usage: python -m bench.offload --child VARIANT LAYERS (or python -m bench offload)")
