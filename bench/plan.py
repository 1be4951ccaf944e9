"""The plan against brute force over its grid, and what counting the ops inside the estimate costs.

Part 1: full FLUX.1-dev LoRA r16 (bf16, 1024x1024, batch 1, steady and first step, reserved bytes, device cuda) on
three cards of :mod:`memkit.gpus` (T4 16 GB, RTX 4090 24 GB, H100 SXM 80 GB). ``memkit.plan`` runs in a process whose
estimate cache is empty (each card's plan after the first reuses estimates the earlier ones made, as in a notebook
asking for the three); then the brute force estimates every configuration of the same grid (optimizer x quantize x
checkpointing; FFSplit is refused with LoRA in the feed-forward, as the plan says), each with its ops counted and its
step time on the card's roofline, from an empty cache. ``estimates`` is how many the plan ran against the grid's;
``first = fastest`` says whether the plan's first choice is the fastest configuration of the grid that fits.

Part 2: one full-size estimate (Flux LoRA r16 + 8-bit AdamW + checkpointing), from an empty cache each time, without
and with ``count_ops=True``, and :func:`memkit.steptime.count_ops` (the probe's three runs of its own) for the same
step: the in-estimate count's extra seconds against the separate count's.
"""

from __future__ import annotations

import time

import memkit

from . import Section, Table, log

TITLE = "plan: the search against brute force over its grid, and the cost of counting ops inside the estimate"

GPUS = ("t4", "4090", "h100")
DIMS = ("optimizer", "quantize", "checkpointing")


def _grid(size: str, rank: int) -> list[tuple[dict, int, float]]:
    """Every configuration of DIMS: (levels, peak reserved bytes, step time per GPU)."""
    from memkit._plan_search import _step_time
    from memkit.planning import _levels_grid

    rows = []
    for levels in _levels_grid(DIMS):
        opts = [memkit.Quantize(method=levels["quantize"])] if levels["quantize"] else []
        opts.append(memkit.LoRA(rank=rank))
        if levels["checkpointing"]:
            opts.append(memkit.Checkpointing(pattern=levels["checkpointing"]))
        tl = memkit.estimate("flux", size=size, optimizations=opts, optimizer=levels["optimizer"], count_ops=True,
                             progress=False)  # fmt: skip
        cards = {g: memkit.gpus.find(g) for g in GPUS}
        times = {g: _step_time(tl, c, {}).seconds for g, c in cards.items() if "bf16" in c.flops}  # no bf16: T4
        rows.append((levels, tl.peak_reserved_bytes, times))
    return rows


def run(quick: bool) -> Section:
    size, rank = ("tiny", 4) if quick else ("full", 16)
    memkit.estimate("flux", size="tiny", progress=False)  # imports out of the timing
    memkit.estimation.clear_cache()
    plans, rows = {}, []
    for g in GPUS:
        log(f"plan flux ({size}) LoRA r{rank} on {g}")
        t0 = time.perf_counter()
        plans[g] = memkit.plan("flux", g, lora=rank, size=size, search=DIMS), time.perf_counter() - t0
    memkit.estimation.clear_cache()
    log(f"brute force: the grid of {len(DIMS)} dimensions")
    t0 = time.perf_counter()
    grid = _grid(size, rank)
    brute = time.perf_counter() - t0
    for g in GPUS:
        p, seconds = plans[g]
        card = memkit.gpus.find(g)
        fitting = [(lv, r, t.get(g)) for lv, r, t in grid if memkit.gpus.verdict(r, card).fits]
        fastest = min(fitting, key=lambda row: row[2]) if fitting and g in grid[0][2] else None
        best = p.best
        rows.append({
            "GPU": card.name,
            "plan's first": (" ".join(best.flags) or "(nothing switched on)") if best else "nothing fits",
            "peak reserved (GiB)": best.peak_reserved_bytes / 2**30 if best else float("nan"),
            "step (s)": best.step_seconds if best and best.step_seconds is not None else float("nan"),
            "estimates": p.estimates,
            "grid": len(grid),
            "plan (s)": seconds,
            "grid's fastest that fits": " ".join(f"{k}={v}" for k, v in fastest[0].items() if v) if fastest else "-",
            "its step (s)": fastest[2] if fastest else float("nan"),
            "first = fastest": bool(best and fastest and best.step_seconds == fastest[2]) if fastest else p.untimed,
        })  # fmt: skip
    lora = memkit.LoRA(rank=rank)
    opts = [lora, memkit.Checkpointing()]
    cost = {}
    for label, kwargs in (("estimate", {}), ("estimate, count_ops=True", {"count_ops": True})):
        memkit.estimation.clear_cache()
        t0 = time.perf_counter()
        memkit.estimate("flux", size=size, optimizations=opts, optimizer="adamw8bit", progress=False, **kwargs)
        cost[label] = time.perf_counter() - t0
    t0 = time.perf_counter()
    memkit.steptime.count_ops("flux", size=size, optimizations=opts, optimizer="adamw8bit")
    cost["steptime.count_ops (its own runs)"] = time.perf_counter() - t0
    extra = cost["estimate, count_ops=True"] - cost["estimate"]
    counting = [
        {"what": k, "seconds": v, "vs the estimate": v / cost["estimate"]} for k, v in cost.items()
    ]  # fmt: skip
    total = sum(s for _, s in plans.values())
    return Section(
        name="plan",
        title=TITLE,
        text=__doc__,
        tables=[
            Table(
                f"Flux {size} LoRA r{rank}: plan vs brute force (reserved bytes, steady or first step, cuda; "
                "step times on each card's roofline)",
                rows,
            ),  # fmt: skip
            Table(f"Counting the ops of one Flux {size} estimate (LoRA r{rank}, 8-bit AdamW, checkpointing)", counting),
        ],
        notes=[
            f"The three plans took {total:.0f} s together against {brute:.0f} s for the brute force of the grid "
            f"({brute / total:.1f}x).",
            f"Counting inside the estimate added {extra:.1f} s ({extra / cost['estimate']:.0%}); the separate count "
            f"took {cost['steptime.count_ops (its own runs)']:.1f} s.",
            "Seconds vary up to ~1.8x between runs on this 2-core VM; the ratios are within one run.",
        ],
    )
