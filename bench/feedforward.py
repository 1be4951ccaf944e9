"""FFSplit: diffusers PR #10623's benchmark reproduced with ``memkit.estimate``, and peak/time against splits on CPU.

Part 1 (fake tensors, ``device="cuda"``): the PR's stack of 5 ``FeedForward`` layers (dim 4096, mult 4, batch
2, sequence 8192, fp32, ``no_grad``), estimated unsplit and with ``FFSplit(splits=4)`` and ``splits=16``,
against the peaks the PR measured on a GPU. Part 2 (real tensors, CPU, one thread): a scaled-down stack
(2 layers, dim 512, mult 4, batch 2, sequence 1024 or 256 in quick mode), tracked peak above the weights and
inputs (``memkit.track``) and the fastest of several rounds per configuration (configurations one after
another, not interleaved), for hidden and sequence modes, in inference and in training (recompute on); time as
a ratio to the unsplit layer in the same run. On a loaded shared machine the ``splits=1`` rows (the unsplit
work through the split code path) already range 0.66-1.85x, so the time ratios are dominated by noise.
"""

from __future__ import annotations

import time

import torch
from diffusers.models.attention import FeedForward

import memkit

from . import Section, Table, log

TITLE = "feedforward: FFSplit peak and time against splits (PR #10623 reproduced)"
GIB = 2**30
PR = {  # diffusers PR #10623, peak allocated GiB on a GPU: normal, split
    "gelu": (5.01, 4.26),
    "geglu": (8.26, 6.01),
    "swiglu": (8.26, 6.01),
    "geglu-approximate": (6.01, 4.51),
}


def _stack(act: str, dim: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[FeedForward(dim, mult=4, activation_fn=act) for _ in range(layers)])


def _pr_rows() -> list[dict]:
    rows = []
    for act, (pr_normal, pr_split) in PR.items():
        peaks = {}
        for splits in (1, 4, 16):
            opts = [] if splits == 1 else [memkit.FFSplit(splits=splits)]
            tl = memkit.estimate(
                lambda act=act: _stack(act, 4096, 5),
                lambda model: {"input": torch.randn(2, 8192, 4096)},
                mode="inference",
                device="cuda",
                optimizations=opts,
                progress=False,
            )
            peaks[splits] = tl.peak_bytes / GIB
        rows.append(
            {
                "activation": act,
                "PR normal GiB": pr_normal,
                "memkit normal GiB": peaks[1],
                "Δ vs PR": f"{peaks[1] / pr_normal - 1:+.1%}",
                "PR split GiB": pr_split,
                "memkit splits=4 GiB": peaks[4],
                "memkit splits=16 GiB": peaks[16],
                "below PR split": peaks[4] < pr_split,
            }
        )
        log(f"PR {act}: {peaks}")
    return rows


def _measure(model, x, training: bool, opts, rounds: int) -> tuple[int, float]:
    def once():
        with _applied(model, opts):
            if training:
                model(x).sum().backward()
                model.zero_grad(set_to_none=True)
                x.grad = None
            else:
                with torch.no_grad():
                    model(x)

    once()  # warm up
    with memkit.track(model, inputs=x) as tl:
        once()
    model.zero_grad(set_to_none=True)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t)
    return tl.peak_bytes - tl.baseline_bytes, best


def _applied(model, opts):
    from memkit.handle import apply_all

    return apply_all(model, opts)


def _cpu_rows(quick: bool) -> list[dict]:
    seq = 256 if quick else 1024
    rounds = 2 if quick else 5
    rows = []
    for act in ("gelu", "geglu"):
        torch.manual_seed(0)
        model = _stack(act, 512, 2)
        for training in (False, True):
            x = torch.randn(2, seq, 512, requires_grad=training)
            base_peak, base_time = _measure(model, x, training, [], rounds)
            for mode in ("hidden", "sequence"):
                for splits in (1, 2, 4, 8):
                    peak, t = _measure(model, x, training, [memkit.FFSplit(splits=splits, mode=mode)], rounds)
                    rows.append(
                        {
                            "activation": act,
                            "step": "training" if training else "inference",
                            "mode": mode,
                            "splits": splits,
                            "peak MiB": peak / 2**20,
                            "peak / unsplit": peak / base_peak,
                            "time ms": t * 1e3,
                            "time / unsplit": t / base_time,
                        }
                    )
            log(f"cpu {act} training={training} done")
    return rows


def run(quick: bool) -> Section:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pr = _pr_rows()
        cpu = _cpu_rows(quick)
    finally:
        torch.set_num_threads(threads)
    notes = []
    worst = max(abs(r["memkit normal GiB"] / r["PR normal GiB"] - 1) for r in pr)
    notes.append(f"unsplit peak vs the PR's: worst |Δ| {worst:.1%} (target 3%): {'met' if worst <= 0.03 else 'MISSED'}")
    below = all(r["below PR split"] for r in pr)
    notes.append(f"splits=4 below the PR's split peak for every activation: {'met' if below else 'MISSED'}")
    ratios = [
        r["time / unsplit"] for r in cpu if r["splits"] == 4 and r["step"] == "inference" and r["mode"] == "hidden"
    ]
    notes.append(
        f"inference time at splits=4 (hidden), ratio to unsplit: {', '.join(f'{v:.2f}' for v in ratios)} "
        "(target <= 1.10; CPU, one thread, shared machine)"
    )
    return Section(
        name="feedforward",
        title=TITLE,
        text=__doc__.split("\n\n", 1)[1],
        tables=[
            Table("PR #10623's benchmark, memkit.estimate (fake tensors, device='cuda')", pr),
            Table("Scaled-down stack on CPU (real tensors, tracked peak above weights and inputs)", cpu),
        ],
        notes=notes,
    )
