"""memkit.plan: the search finds what brute force over the grid finds, and says what it could not do."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memkit
from memkit import gpus
from memkit.planning import ALLOC_CONFS, DIMENSIONS, NothingFits, _levels_grid, plan

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

PRESET = "flux"
SIZES = dict(size="tiny", height=1024, width=1024)  # tiny Flux, 4,096 image tokens: activations checkpointing cuts
LORA = memkit.LoRA(rank=4, targets=("to_q", "to_k", "to_v", "to_out.0"))  # outside the feed-forward: FFSplit applies


def card(usable: int) -> gpus.GPU:
    """A GPU whose usable bytes are ``usable`` (its total less the CUDA context and cuBLAS's workspace)."""
    probe = gpus.GPU("probe", "probe", (1 << 40, 1 << 40), "a test card", 90)
    low, high = probe.usable_bytes()
    total = (1 << 40) - low + usable
    return gpus.GPU("test", "a test card", (total, total), "a test card", 90)


def brute_force(dims):
    """Every configuration of the grid estimated: (levels, alloc conf, reserved bytes)."""
    from memkit.memory.reserved import replay_reserved

    rows = []
    for levels in _levels_grid(dims):
        opts = []
        if levels.get("quantize"):
            opts.append(memkit.Quantize(method=levels["quantize"]))
        opts.append(LORA)
        if levels.get("ff_split"):
            opts.append(memkit.FFSplit(splits=levels["ff_split"]))
        if levels.get("checkpointing"):
            opts.append(memkit.Checkpointing())
        tl = memkit.estimate(PRESET, optimizations=opts, optimizer=levels["optimizer"], progress=False, **SIZES)
        for conf in ALLOC_CONFS:
            reserved = replay_reserved(tl, baseline_blocks=tl.baseline_blocks, alloc_conf=conf).peak_bytes
            rows.append((levels, conf, reserved))
    return rows


@pytest.mark.slow  # the grid of 12 configurations estimated (~15 s)
def test_the_plan_finds_the_cheapest_fitting_configuration_brute_force_finds():
    dims = ("optimizer", "quantize", "checkpointing")
    rows = brute_force(dims)
    peaks = sorted({r for _, _, r in rows})
    gpu = card((peaks[0] + peaks[-1]) // 2)  # between the least and the most any configuration reserves
    fitting = [(levels, conf) for levels, conf, reserved in rows if gpus.verdict(reserved, gpu).fits]
    assert fitting and len(fitting) < len(rows)  # the budget splits the grid
    result = plan(PRESET, gpu, optimizations=[LORA], search=dims, progress=None, **SIZES)
    weight = {"checkpointing": 4, "quantize": 3, "ff_split": 2, "optimizer": 1}

    def cost(levels):
        return sum(weight[d] * DIMENSIONS[d].index(v) for d, v in levels.items())

    cheapest = min(cost(levels) for levels, _ in fitting)
    assert result.best is not None and cost(result.best.levels) == cheapest
    assert all(c.fits for c in result.configs)
    assert {tuple(c.levels.items()) for c in result.configs} <= {tuple(levels.items()) for levels, _ in fitting}
    assert result.estimates < len(_levels_grid(dims))  # pruned, not the grid


def test_nothing_fits_names_the_smallest_peak_and_what_holds_it():
    pattern = (
        r"no configuration fits a test card \(64\.00 KiB usable\): the smallest peak found is [\d.]+ MiB reserved "
        r"with --optimizer adamw8bit .*\(at its peak: \w+ [\d.]+ \w?i?B"
    )
    with pytest.raises(NothingFits, match=pattern):
        plan(PRESET, card(1 << 16), optimizations=[LORA], **SIZES)


def test_a_dimension_the_fixed_settings_refuse_leaves_the_search_with_the_reason():
    # peft's default Flux targets include the feed-forward layers, which FFSplit refuses to split
    result = plan(PRESET, card(1 << 30), lora=4, search=("optimizer", "ff_split"), **SIZES)
    assert list(result.refused) == ["ff_split"] and "LoRA adapters sit in it" in result.refused["ff_split"]
    assert result.best is not None and "--ff-split" not in result.best.flags


def test_bad_arguments_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"search names \['offload-to-mars'\]; the dimensions are"):
        plan(PRESET, "4090", lora=4, search=("offload-to-mars",), **SIZES)
    with pytest.raises(ValueError, match="plan searches or fixes optimizer itself"):
        plan(PRESET, "4090", lora=4, optimizer="sgd", **SIZES)
    with pytest.raises(ValueError, match="lora must be a positive rank or None"):
        plan(PRESET, "4090", lora=0, **SIZES)
    with pytest.raises(ValueError, match="a quantized base trains only adapters"):
        plan(PRESET, "4090", optimizations=[memkit.Quantize(method="nf4")], **SIZES)


def test_ctrl_c_returns_what_was_found_so_far(monkeypatch):
    real = memkit.estimation.estimate
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(memkit.estimation, "estimate", interrupted)
    result = plan(PRESET, card(1 << 30), optimizations=[LORA], search=("optimizer", "checkpointing"), **SIZES)
    assert result.interrupted and result.estimates == 2 and result.configs  # the first two fit a 1 GiB card
    assert result.summary()["interrupted"] is True


def test_the_command_line_flags_reproduce_each_configuration(capsys):
    from memkit.cli import main

    code = main(["plan", PRESET, "--size", "tiny", "--gpu", "2GiB", "--lora", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["configs"] and all(c["fits"] for c in out["configs"])
    first = out["configs"][0]
    code = main(["estimate", PRESET, "--size", "tiny", "--gpu", "2GiB", "--lora", "4", *first["flags"], "--json"])
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again["peak_reserved_bytes"] == first["peak_reserved_bytes"] and again["fits"]


def test_timed_configurations_are_ranked_by_their_step_time_on_the_gpu():
    pytest.importorskip("memkit.steptime")
    gpu = card(1 << 30)
    gpu = gpus.GPU("test", "a test card", gpu.total_bytes, "a test card", 90, flops={"bf16": 1e12, "fp32": 1e11},
                   memory_bandwidth=1e11, host_link=1e10)  # fmt: skip
    result = plan(PRESET, gpu, optimizations=[LORA], search=("optimizer", "checkpointing"), time_steps=3, **SIZES)
    timed = [c for c in result.configs if c.step_seconds is not None]
    assert len(timed) == 3 and [c.step_seconds for c in timed] == sorted(c.step_seconds for c in timed)
    assert result.configs[:3] == timed  # the timed ones first, fastest first
    fastest = timed[0]
    assert "--checkpointing" not in fastest.flags  # recomputing every block's forward costs time
    assert all(c.why.startswith(f"{c.step_seconds / fastest.step_seconds:.2f}x the fastest") for c in timed[1:])


# CI time: resolution (16 s) in make test-extended; batch and frames (the 4k+1 grid) in CI
@pytest.mark.parametrize("what", ["batch", pytest.param("resolution", marks=pytest.mark.extended), "frames"])
def test_maximize_finds_the_largest_value_that_fits(what):
    from memkit.planning import maximize

    preset = "wan" if what == "frames" else PRESET
    kwargs = dict(size="tiny", optimizations=[memkit.Checkpointing()], height=256, width=256)

    def reserved(v):
        at = {"batch": {"batch_size": v}, "resolution": {"height": v, "width": v}, "frames": {"frames": v}}[what]
        return memkit.estimate(preset, progress=False, **{**kwargs, **at}).peak_reserved_bytes

    step = {"batch": 1, "resolution": 16, "frames": 4}[what]  # Flux: 8x VAE, 2x2 patches; Wan: 4k+1 frames
    scan = {"batch": range(2, 9), "resolution": range(288, 400, 16), "frames": range(33, 50, 4)}[what]
    # a value whose next one on the preset's grid reserves more (reserved grows in 2 MiB segments)
    start = next(v for v in scan if reserved(v) < reserved(v + step))
    gpu = card((reserved(start) + reserved(start + step)) // 2)  # holds `start`, not the next
    big = maximize(preset, gpu, what, **kwargs)
    assert big.value == start and big.peak_reserved_bytes == reserved(start)
    assert big.headroom_bytes >= 0 and big.summary()["estimates"] == len(big.tried) >= 2
    assert (start, reserved(start), True) in big.tried and (start + step, reserved(start + step), False) in big.tried


def test_maximize_refuses_what_a_preset_lacks():
    from memkit.planning import maximize

    with pytest.raises(ValueError, match="flux is an image model: it has no frames to grow"):
        maximize(PRESET, "4090", "frames", size="tiny")
    with pytest.raises(ValueError, match=r"what must be one of \['batch', 'resolution', 'frames'\]"):
        maximize(PRESET, "4090", "steps", size="tiny")


def synthetic_plan(points, usable=100):
    """A Plan over candidates ``(step seconds or None, peak reserved bytes)``, judged against ``usable`` bytes; the
    timed fitting ones ranked by time, as plan() ranks what it times."""
    from memkit.planning import Candidate, Plan

    gpu = card(usable)
    judged = [(t, m, gpus.verdict(m, gpu)) for t, m in points]
    tried = [
        Candidate({"optimizer": "adamw"}, "", (), (f"--config {i}",), m, m, v.fits, v.headroom_bytes, t)
        for i, (t, m, v) in enumerate(judged)
    ]
    fitting = [c for c in tried if c.fits]
    configs = sorted((c for c in fitting if c.step_seconds is not None), key=lambda c: c.step_seconds)
    return Plan(gpu, configs + [c for c in fitting if c.step_seconds is None], tried, len(tried), 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(1, 6)), st.integers(0, 6)), min_size=1, max_size=12))
def test_the_frontier_is_every_timed_configuration_no_other_beats(points):
    # small integer grids: ties in time, in bytes and in both are common
    result = synthetic_plan([(t if t is None else t / 4, m) for t, m in points], usable=3)
    timed = [c for c in result.tried if c.step_seconds is not None]
    if not timed:
        with pytest.raises(ValueError, match=r"time_steps=N \(memkit plan \.\.\. --time N\)"):
            result.frontier()
        return

    def beats(a, b):
        no_worse = a.step_seconds <= b.step_seconds and a.peak_reserved_bytes <= b.peak_reserved_bytes
        return no_worse and (a.step_seconds, a.peak_reserved_bytes) != (b.step_seconds, b.peak_reserved_bytes)

    frontier = result.frontier()
    assert {c.flags for c in frontier} == {c.flags for c in timed if not any(beats(d, c) for d in timed)}
    assert [c.step_seconds for c in frontier] == sorted(c.step_seconds for c in frontier)
    if result.best is not None and result.best.step_seconds is not None:  # the fastest that fits has a frontier twin
        twin = [c for c in frontier if c.step_seconds == result.best.step_seconds]  # as fast, no larger: it fits
        assert twin and all(c.fits for c in twin)


def test_timed_takes_each_configuration_s_step_time_from_the_ranking():
    result = synthetic_plan([(None, 1), (None, 2), (None, 500), (None, 3)])
    assert result.timed == []
    timed = {"--config 1": 0.5, "--config 3": 0.25}  # what plan()'s ranking gives the fitting ones it times
    configs = [dataclasses.replace(c, step_seconds=timed[c.flags[-1]]) for c in result.configs if c.flags[-1] in timed]
    result.configs = sorted(configs, key=lambda c: c.step_seconds) + [result.configs[0]]
    assert [(c.flags[-1], c.step_seconds) for c in result.timed] == [("--config 1", 0.5), ("--config 3", 0.25)]
    assert [c.flags[-1] for c in result.frontier()] == ["--config 3", "--config 1"]  # faster, or smaller


@pytest.mark.slow  # a tiny plan with three step-time counts (~15 s on a loaded machine)
def test_a_timed_plan_s_frontier_figure_and_the_command_line_s_plot(tmp_path, capsys):
    from memkit.cli import main
    from memkit.plots import plan_figure

    result = plan(PRESET, "4090", lora=4, size="tiny", time_steps=2)
    timed = [c for c in result.configs if c.step_seconds is not None]
    assert len(timed) == 2 and result.timed == [c for t in result.tried for c in timed if c.flags == t.flags]
    fig = plan_figure(result)
    points = [(x, y) for tr in fig.data if tr.name in ("fits", "does not fit") for x, y in zip(tr.x, tr.y, strict=True)]
    assert sorted(points) == sorted((c.step_seconds, c.peak_reserved_bytes / 2**30) for c in timed)
    (chosen,) = [tr for tr in fig.data if tr.name.startswith("chosen")]
    assert (chosen.x[0], chosen.y[0]) == (result.best.step_seconds, result.best.peak_reserved_bytes / 2**30)
    out = tmp_path / "plan.html"
    code = main(["plan", PRESET, "--size", "tiny", "--gpu", "4090", "--lora", "4", "--time", "1", "--plot", str(out)])
    assert code == 0 and f"wrote {out}" in capsys.readouterr().out
    assert "NVIDIA GeForce RTX 4090: usable" in out.read_text() and "plotly" in out.read_text()


def test_the_command_line_s_plot_needs_step_times_and_a_known_format(tmp_path, capsys):
    from memkit.cli import main

    base = ["plan", PRESET, "--size", "tiny", "--gpu", "4090", "--lora", "4"]
    assert main([*base, "--plot", str(tmp_path / "p.html")]) == 2
    assert "--plot draws the configurations' step times: give --time N" in capsys.readouterr().err
    assert main([*base, "--time", "1", "--plot", str(tmp_path / "p.svg")]) == 2
    assert "the file must end in .html or .png" in capsys.readouterr().err
    assert main([*base, "--time", "1", "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before the search: nothing written


def test_level_index_counts_each_dimension_s_levels_from_off():
    from memkit.planning import Candidate

    c = Candidate({"optimizer": "adamw8bit", "quantize": "nf4", "ff_split": None}, "", (), (), 0, 0, True, 0)
    # adamw8bit is the optimizer's second level, nf4 the quantized base's third; ff_split off, checkpointing unsearched
    assert c.level_index == {"optimizer": 1, "quantize": 2, "ff_split": 0, "checkpointing": 0}


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="PNG export needs Chromium at /usr/bin/chromium")
@pytest.mark.slow  # kaleido starts Chromium: seconds
def test_the_command_line_s_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    from memkit.cli import main

    monkeypatch.setattr(memkit, "plan", lambda *a, **k: synthetic_plan([(0.5, 2), (0.25, 4), (None, 1)], usable=3))
    out = tmp_path / "plan.png"
    assert main(["plan", PRESET, "--gpu", "4090", "--lora", "4", "--time", "1", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and f"wrote {out}" in capsys.readouterr().out
