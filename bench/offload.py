"""Group offloading to disk on CPU: forward time, peak RSS and bytes read, memkit against diffusers and accelerate.

The ``small`` PixArt-Sigma preset (8 transformer blocks, float32, 256x256 px), inference forwards (``no_grad``),
one torch thread. Variants: the model in RAM; ``memkit.Offload(to="disk")`` at block level (one block a group)
with prefetch 1 (the default), 0 and 2, and at leaf level; diffusers' ``apply_group_offloading(
offload_type="block_level", num_blocks_per_group=1, offload_to_disk_path=...)`` (onload device CPU; its prefetch
needs CUDA streams); accelerate's ``disk_offload`` (per-module hooks reading numpy memmaps).

Time: every variant's model built once in this process, then one forward each per round, in an order rotated
each round, after a warm-up round; the median of the rounds, as a ratio to the model in RAM and to diffusers
from the same rounds. The files sit in the page cache after the first read (nothing here drops caches, which
would need root and slow the machine for everyone), so reads are memory copies out of the kernel's cache, not
device reads: the cost measured is memkit's own (allocation, copy, hooks), the floor a fast NVMe approaches.

Peak RSS: each variant in a fresh process (``python -m bench.offload --child NAME``): imports and a tiny model
first, ``malloc_trim``, the process's RSS as the base; then the model built, offloaded, one warm-up forward and
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
VARIANTS = (
    "ram",
    "memkit block prefetch=1",
    "memkit block prefetch=0",
    "memkit block prefetch=2",
    "memkit leaf prefetch=1",
    "diffusers block",
    "accelerate disk_offload",
)


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


def child(name: str) -> dict:
    """One variant's peak RSS over a forward, in this (fresh) process."""
    from memkit.memory import rss_bytes, sample_rss

    torch.set_num_threads(1)
    memkit.load_model(PRESET)  # imports diffusers' modules: not the model's memory
    _trim()
    base = rss_bytes()
    model = memkit.load_model(PRESET, size=SIZE)
    inputs = memkit.make_inputs(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as folder:
        keep = _apply(name, model, folder)
        _trim()
        with torch.no_grad():
            model(**inputs)
        read0 = _rchar()
        with torch.no_grad(), sample_rss() as rss:
            model(**inputs)
        read = _rchar() - read0
        del keep
    return {"weights": weights, "peak_over_base": rss.peak_bytes - base, "read": read}


def _rss_rows(names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        done = subprocess.run(
            [sys.executable, "-m", "bench.offload", "--child", name],
            capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"child {name!r} failed:\n{done.stderr[-3000:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        log(f"  RSS {name}: {out[name]['peak_over_base'] / MiB:.0f} MiB over the base")
    return out


def _times(names: list[str], rounds: int) -> dict[str, float]:
    base = memkit.load_model(PRESET, size=SIZE)
    inputs = memkit.make_inputs(base)
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as folder:
        models, keep = {}, []
        for name in names:
            m = memkit.load_model(PRESET, size=SIZE)
            m.load_state_dict(base.state_dict())
            keep.append(_apply(name, m, folder))
            models[name] = m
        del base
        _trim()
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds + 1):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    models[name](**inputs)
                    dt = time.perf_counter() - t0
                if r:
                    times[name].append(dt)
        for h in keep:
            if h is not None:
                h.remove()
    return {n: statistics.median(ts) for n, ts in times.items()}


def run(quick: bool = False) -> Section:
    names = [n for n in VARIANTS if _available(n)]
    skipped = [n for n in VARIANTS if n not in names]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log(f"  timing {len(names)} variants")
        times = _times(names, rounds=2 if quick else 7)
    finally:
        torch.set_num_threads(threads)
    rss = _rss_rows(names)
    ram, diff = times["ram"], times.get("diffusers block")
    activations = rss["ram"]["peak_over_base"] - rss["ram"]["weights"]  # what the forward adds over the weights
    rows = []
    for name in names:
        r = rss[name]
        mmap = name.startswith(("diffusers", "accelerate"))  # they page files in through mmap: rchar misses it
        rows.append(
            {
                "variant": name,
                "forward s": times[name],
                "time / RAM": times[name] / ram,
                "time / diffusers": times[name] / diff if diff else float("nan"),
                "peak RSS over base MiB": r["peak_over_base"] / MiB,
                "peak RSS / weights": r["peak_over_base"] / r["weights"],
                "weights resident / weights": (r["peak_over_base"] - activations) / r["weights"],
                "read per forward MiB": float("nan") if mmap else r["read"] / MiB,
            }
        )
    weights = rss["ram"]["weights"]
    model = memkit.load_model(PRESET, size=SIZE)
    groups = memkit.Offload(to="disk")._groups(model)
    share = sum(g.nbytes for g in groups) / weights
    by = {r["variant"]: r for r in rows}
    m1 = by["memkit block prefetch=1"]
    notes = [
        f"Model: {PRESET} {SIZE}, {weights / MiB:.0f} MiB of float32 weights, {len(groups)} blocks ({share:.0%} of "
        "the weights; the rest, embedders and the final layer, stays in RAM).",
        f"Target time <= 1.25x the model in RAM at block level with prefetch: {m1['time / RAM']:.2f}x "
        f"({'met' if m1['time / RAM'] <= 1.25 else 'NOT met'}).",
        f"Target peak RSS <= 0.4x the weights (blocks_per_group=1): memkit prefetch=1 "
        f"{m1['peak RSS / weights']:.2f}x, prefetch=0 {by['memkit block prefetch=0']['peak RSS / weights']:.2f}x "
        f"({'met' if m1['peak RSS / weights'] <= 0.4 else 'NOT met'} with prefetch 1, counting the whole peak: "
        f"it includes the forward's activations, {activations / MiB:.0f} MiB (the RAM model's peak over its "
        f"weights), and the {(1 - share) * weights / MiB:.0f} MiB outside the blocks that stay in RAM). Weights "
        f"alone (peak minus those activations): prefetch=1 {m1['weights resident / weights']:.2f}x, prefetch=0 "
        f"{by['memkit block prefetch=0']['weights resident / weights']:.2f}x; with 8 blocks one block is 11% "
        "of the weights, so two resident blocks plus what stays is about 0.33x: more blocks lower it.",
    ]
    if diff:
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
        tables=[Table(f"{PRESET} {SIZE}: inference forward, float32, one thread", rows)],
        notes=notes,
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        sys.exit("usage: python -m bench.offload --child VARIANT (or python -m bench offload)")
