"""How fast a full-size estimate is: block memoization and the fake-dispatch cache against the un-memoized step.

Three ways of making the same estimate (``memkit.estimate(preset)``'s default: bf16 AdamW on ``"cuda"``, first and
steady step), each in a fresh Python process with torch, diffusers, the preset's diffusers model class and
``memkit.estimation`` imported before the clock starts (the imports, ~3-5 s, are reported apart):

- **baseline**: every block run, every op through ``FakeTensorMode`` (the estimate as it was before both changes:
  ``memoize=False``, ``FakeDispatchCache`` off);
- **no memo**: every block run, ops through the fake-dispatch cache (``memoize=False``: the path settings that
  are not memoized take);
- **memo, steady run**: the probe of four blocks per list, its events spliced (`memkit/_memo.py`,
  `memkit/_splice.py`), both of its steps run whole (``memkit._steady.ENABLED = False``);
- **memoized**: the default: the same probe, its steady step's forward and backward taken from its first step's
  and only its update run (`memkit/_steady.py`).

Full Flux's two memoized paths run three times each, alternated, and their figures are the medians; the other
presets run once. For the memoized paths, "first" is the first estimate of the process, "new setting" a second
estimate with another setting (``Checkpointing()``) in the same warm process, "same again" the first setting asked
again (answered from the process's cache). Every path must give the same peak to the byte: the table says whether
it did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from . import Section, Table, log
from .estimate_full import _peak_rss_kib

TITLE = "estimate_speed: full-size estimates, memoized vs every block run"
TARGET_FIRST, TARGET_WARM = 3.0, 1.0  # seconds, full Flux
_TIMEOUT = 1800
# the seven presets this bench has timed since the issue was opened (every preset's estimate is timed, memoized
# or not, in bench/estimate_full.py)
PRESETS = ("flux", "sd3", "ltx-video", "wan", "unet", "pixart", "dit")
REPEATS = 3  # fresh processes per memoized path for full Flux, whose figures the targets judge


def _worker(preset: str, how: str) -> None:
    t0 = time.perf_counter()
    import diffusers
    import torch  # noqa: F401

    import memkit
    import memkit._steady
    import memkit.estimation as estimation

    getattr(diffusers, memkit.PRESETS[preset].model_class)  # diffusers imports each model's module on first use
    imports = time.perf_counter() - t0
    if how == "baseline":
        estimation.FakeDispatchCache = lambda: None
    if how == "memo, steady run":
        memkit._steady.ENABLED = False
    memoize = how.startswith("memo")
    t1 = time.perf_counter()
    first = memkit.estimate(preset, progress=False, memoize=memoize)
    t2 = time.perf_counter()
    result = {
        "imports": imports,
        "first": t2 - t1,
        "peak_bytes": first.peak_bytes,
        "events": len(first),
        "memoized": first.meta["memoized"],
        "rss_peak_kib": _peak_rss_kib(),
    }
    if memoize:
        t3 = time.perf_counter()
        memkit.estimate(preset, progress=False, optimizations=[memkit.Checkpointing()])
        t4 = time.perf_counter()
        again = memkit.estimate(preset, progress=False)
        t5 = time.perf_counter()
        result.update(new_setting=t4 - t3, same_again=t5 - t4, same_peak=again.peak_bytes == first.peak_bytes)
    print(json.dumps(result), flush=True)


def _median(results: list[dict]) -> dict:
    """Each number the median of ``results``' (the first result's other values)."""
    out = dict(results[0])
    for key, value in out.items():
        if isinstance(value, float):
            out[key] = sorted(r[key] for r in results)[len(results) // 2]
    return out


def _run(preset: str, how: str) -> dict:
    cmd = [sys.executable, "-m", "bench.estimate_speed", preset, how]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"{preset} {how} exited {done.returncode}: {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> Section:
    presets = ("dit", "pixart") if quick else PRESETS
    rows, notes, flux = [], [], None
    for preset in presets:
        log(f"  {preset}: baseline, no memo, memo with the steady step run, memoized (fresh processes)")
        try:
            base, plain = (_run(preset, how) for how in ("baseline", "no memo"))
            # the target's preset: both memoized paths alternated REPEATS times, each figure their median
            repeats = REPEATS if preset == "flux" else 1
            runs = [_run(preset, how) for _ in range(repeats) for how in ("memo, steady run", "memoized")]
            ran, memo = _median(runs[0::2]), _median(runs[1::2])
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"  {preset} FAILED: {e}")
            rows.append({"preset": preset, "error": str(e).splitlines()[-1][:200]})
            continue
        same = (
            base["peak_bytes"] == plain["peak_bytes"] == ran["peak_bytes"] == memo["peak_bytes"]
            and base["events"] == ran["events"] == memo["events"]
        )
        rows.append(
            {
                "preset": preset,
                "memoized": "yes" if memo["memoized"] else "no (runs every block)",
                "baseline (s)": base["first"],
                "no memo (s)": plain["first"],
                "memo, steady run: first (s)": ran["first"],
                "memo, steady run: new setting (s)": ran["new_setting"],
                "memoized first (s)": memo["first"],
                "memoized new setting (s)": memo["new_setting"],
                "same again (s)": memo["same_again"],
                "baseline / memoized": base["first"] / memo["first"],
                "baseline / no memo": base["first"] / plain["first"],
                "steady run / derived (new setting)": ran["new_setting"] / memo["new_setting"],
                "peak RSS baseline (MiB)": base["rss_peak_kib"] / 2**10,
                "peak RSS memoized (MiB)": memo["rss_peak_kib"] / 2**10,
                "imports (s)": memo["imports"],
                "same peak and events": "yes" if same and memo["same_peak"] else "NO",
            }
        )
        if preset == "flux":
            flux = memo, base
    if flux is not None:
        memo, base = flux
        rss_ok = "met" if memo["rss_peak_kib"] <= base["rss_peak_kib"] else "MISSED"
        notes.append(
            f"Targets, full Flux: first estimate in a fresh process ≤ {TARGET_FIRST:.0f} s (imports excluded), a "
            f"new setting in a warm process ≤ {TARGET_WARM:.0f} s, peak RSS no higher than the baseline's. "
            f"Measured {memo['first']:.2f} s ({'met' if memo['first'] <= TARGET_FIRST else 'MISSED'}), "
            f"{memo['new_setting']:.2f} s ({'met' if memo['new_setting'] <= TARGET_WARM else 'MISSED'}; the same "
            f"setting again: {memo['same_again']:.3f} s), {memo['rss_peak_kib'] / 2**10:.0f} MiB vs "
            f"{base['rss_peak_kib'] / 2**10:.0f} MiB ({rss_ok})."
        )
    notes += [
        "Imports (torch, diffusers and its model class, memkit.estimation; most of it torch._dynamo, which diffusers "
        "imports) are paid once per process and excluded from every figure but 'imports'. `import memkit` itself "
        "imports neither torch nor diffusers, so the first `memkit.estimate` of a process pays them (~2-3 s more).",
        "UNet has no list of identical blocks (its blocks differ in width): it runs every block, with the fake-"
        "dispatch cache only.",
        "The runs go one after another on the machine described above; its other load slows them.",
    ]
    return Section(
        name="estimate_speed",
        title=TITLE,
        text=__doc__.split("\n", 1)[1],
        tables=[Table("full-size presets, bf16 AdamW on 'cuda', first and steady step, seconds of estimate()", rows)],
        notes=notes,
    )


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
