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

# `make test-fast` keeps these cases (tests/conftest.py); `make test` and CI run frames
FAST_CASES = {"test_maximize_finds_the_largest_value_that_fits": set()}

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


def timed_card(usable: int) -> gpus.GPU:
    """:func:`card` with the 4090's compute figures: the plan ranks by step time on it."""
    figures = gpus.find("4090")
    return dataclasses.replace(card(usable), flops=figures.flops, memory_bandwidth=figures.memory_bandwidth,
                               host_link=figures.host_link)  # fmt: skip


def brute_force(dims, space=DIMENSIONS, ema=None, sizes=SIZES, times=None):
    """Every configuration of the grid estimated: (levels, alloc conf, reserved bytes); a configuration the library
    refuses (FSDP with a quantized base or group offloading, FFSplit with a quantized base) or fails on (an offloaded
    EMA under FSDP) is not in the list. With ``times`` (a dict), also each configuration's step time on
    :func:`timed_card`'s compute figures, by its levels."""
    from memkit.memory.reserved import replay_reserved
    from memkit.steptime import step_seconds

    rows = []
    for levels in _levels_grid(dims, space):
        opts = []
        if levels.get("quantize"):
            opts.append(memkit.Quantize(method=levels["quantize"]))
        opts.append(LORA)
        if levels.get("checkpointing"):
            opts.append(memkit.Checkpointing(pattern=levels["checkpointing"]))
        if levels.get("ff_split"):
            opts.append(memkit.FFSplit(splits=levels["ff_split"]))
        if levels.get("fsdp"):
            opts.append(memkit.FSDP(world_size=levels["fsdp"]))
        if ema is not None:
            opts.append(memkit.EMA(mode=levels.get("ema", ema.mode), update_every=ema.update_every))
        if levels.get("offload"):
            opts.append(memkit.Offload(to=levels["offload"]))
        try:
            tl = memkit.estimate(PRESET, optimizations=opts, optimizer=levels.get("optimizer", "adamw"),
                                 device="cuda", progress=False, count_ops=times is not None, **sizes)  # fmt: skip
        except ValueError:
            continue
        if times is not None:
            times[tuple(levels.items())] = step_seconds(tl.op_counts, timed_card(1 << 30)).seconds
        for conf in ALLOC_CONFS:
            reserved = replay_reserved(tl, baseline_blocks=tl.baseline_blocks, alloc_conf=conf).peak_bytes
            rows.append((levels, conf, reserved))
    return rows


PRIOR = {"ema": 5, "checkpointing": 4, "quantize": 3, "ff_split": 2, "optimizer": 1, "fsdp": 0.5}
"""The step-time prior memkit.planning documents: a dimension's weight times its level's place (checkpointing: the
share of blocks recomputed); offload outweighs all the others together."""


def prior_cost(levels, space=DIMENSIONS):
    share = {None: 0, "every:4": 0.25, "every:2": 0.5, "all": 1}
    rest = sum(PRIOR[d] * (share[v] if d == "checkpointing" else space[d].index(v))
               for d, v in levels.items() if d != "offload")  # fmt: skip
    return (levels.get("offload") is not None, rest)


def agrees_at_every_budget(rows, dims, space=DIMENSIONS, **kwargs):
    """At a budget of each peak the grid reserves, and one below the least: the plan's first choice costs what the
    brute force's cheapest fitting configuration costs, and where nothing fits the plan says so. Returns the plans."""
    plans = []
    for usable in sorted({r for _, _, r in rows} | {min(r for _, _, r in rows) - 1}):
        gpu = card(usable)
        fitting = [levels for levels, _, reserved in rows if gpus.verdict(reserved, gpu).fits]
        if not fitting:
            with pytest.raises(NothingFits):
                plan(PRESET, gpu, search=dims, **kwargs)
            continue
        result = plan(PRESET, gpu, search=dims, **kwargs)
        cheapest = min(prior_cost(levels, space) for levels in fitting)
        assert result.best is not None and prior_cost(result.best.levels, space) == cheapest, (usable, result.best)
        assert all(c.fits for c in result.configs)
        assert {tuple(c.levels.items()) for c in result.configs} <= {tuple(levels.items()) for levels in fitting}
        plans.append(result)
    return plans


@pytest.mark.slow  # the grid of 18 configurations estimated (~20 s)
def test_the_plan_finds_the_cheapest_fitting_configuration_brute_force_finds():
    dims = ("optimizer", "quantize", "checkpointing")
    rows = brute_force(dims)
    plans = agrees_at_every_budget(rows, dims, optimizations=[LORA], **SIZES)
    assert min(p.estimates for p in plans) < len(_levels_grid(dims))  # pruned, not the grid (before the cache)


@pytest.mark.slow  # the grid of 54 configurations estimated with their ops counted (~40 s)
def test_the_plan_s_first_choice_is_the_fastest_fitting_configuration_of_the_grid():
    """Ranked by step time (a card with compute figures), the plan's first choice is the fastest configuration of the
    whole grid that fits, at a budget of each peak the grid reserves: not only the cheapest by the search's prior.
    8-bit AdamW's update is faster than AdamW's on the roofline and an EMA on the CPU than an offloaded one, so the
    prior's order is not the time's: without the search for the fastest (``memkit._plan_fastest.fastest``) the plan
    stops at the prior's cheapest fitting configuration and this test fails (at 30 MiB: AdamW 8-bit with
    checkpointing, 0.06% slower than the grid's fastest that fits)."""
    ema = memkit.EMA(update_every=2)
    dims = ("optimizer", "quantize", "checkpointing", "ema")
    times = {}
    rows = brute_force(dims, ema=ema, times=times)
    faster_8bit = [k for k, t in times.items() if dict(k)["optimizer"] == "adamw"
                   and times.get(tuple({**dict(k), "optimizer": "adamw8bit"}.items()), t) < t]  # fmt: skip
    assert faster_8bit  # the prior's order and the time's differ somewhere in this grid
    for usable in sorted({r for _, _, r in rows}):
        gpu = timed_card(usable)
        fastest = min(times[tuple(levels.items())] for levels, _, r in rows if gpus.verdict(r, gpu).fits)
        result = plan(PRESET, gpu, search=dims, optimizations=[LORA, ema], **SIZES)
        assert result.best.step_seconds == fastest, (usable, result.best.levels, result.best.step_seconds, fastest)
        assert [c.step_seconds for c in result.configs] == sorted(c.step_seconds for c in result.configs)


SMALL = dict(size="small", height=256, width=256)  # weights outweigh activations: offloading and sharding show


@pytest.mark.extended  # CI time: 6 configurations of small Flux, none memoized (~20-60 s)
def test_offloading_is_searched_one_configuration_at_a_time_where_nothing_else_fits():
    # under offloading checkpointing every 2nd block can reserve less than every block: no pruning there
    dims, space = ("checkpointing", "offload"), {**DIMENSIONS, "checkpointing": (None, "every:2", "all")}
    rows = brute_force(dims, space, sizes=SMALL)
    least = min(r for levels, _, r in rows if levels["offload"] is None)
    assert any(r < least for levels, _, r in rows if levels["offload"])  # some budgets only offloading meets
    levels = {"checkpointing": space["checkpointing"]}
    plans = agrees_at_every_budget(rows, dims, space, optimizations=[LORA], levels=levels, **SMALL)
    assert any(p.best.levels["offload"] == "cpu" for p in plans)


@pytest.mark.extended  # 72 configurations of small Flux, 18 of them sharded (~7 min)
def test_the_plan_agrees_with_brute_force_over_ema_placement_and_fsdp():
    ema = memkit.EMA(update_every=2)
    dims = ("optimizer", "quantize", "checkpointing", "ema", "fsdp")
    space = {**DIMENSIONS, "fsdp": (None, 2)}
    rows = brute_force(dims, space, ema=ema, sizes=SMALL)
    assert not any(levels["fsdp"] and levels["quantize"] for levels, _, _ in rows)  # FSDP refuses a quantized base
    plans = agrees_at_every_budget(rows, dims, space, optimizations=[LORA, ema], gpus=2, **SMALL)
    assert {p.best.levels["fsdp"] for p in plans} == {None, 2} and len({p.best.levels["ema"] for p in plans}) > 1


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
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
    with pytest.raises(ValueError, match=r"gpus must be an int >= 1 \(the GPUs the run has\), got 0"):
        plan(PRESET, "4090", lora=4, gpus=0, **SIZES)
    with pytest.raises(ValueError, match=r"levels\['checkpointing'\] must name one or more of none, every:4, every:2, "
                       r"all, each once, in that order \(fastest first\); got \['all', None\]"):  # fmt: skip
        plan(PRESET, "4090", lora=4, levels={"checkpointing": ["all", None]}, **SIZES)
    with pytest.raises(ValueError, match=r"levels\['checkpointing'\] names 'every:3'; checkpointing's levels are"):
        plan(PRESET, "4090", lora=4, levels={"checkpointing": ["every:3"]}, **SIZES)
    with pytest.raises(ValueError, match=r"levels\['fsdp'\] names 3; fsdp's levels are none, 2, 4 \(the divisors of "
                       r"gpus=4\)"):  # fmt: skip
        plan(PRESET, "4090", lora=4, gpus=4, levels={"fsdp": [None, 3]}, **SIZES)
    with pytest.raises(ValueError, match=r"levels names 'warp'; the dimensions are"):
        plan(PRESET, "4090", lora=4, levels={"warp": [1]}, **SIZES)
    with pytest.raises(ValueError, match=r"search names 'ema', which needs an EMA among optimizations"):
        plan(PRESET, "4090", lora=4, search=("ema",), **SIZES)
    with pytest.raises(ValueError, match=r"search names 'fsdp', which needs gpus=N above 1"):
        plan(PRESET, "4090", lora=4, search=("fsdp",), **SIZES)
    with pytest.raises(ValueError, match=r"the fixed fsdp:3 shards over 3 GPUs, which does not divide gpus=4"):
        plan(PRESET, "4090", lora=4, gpus=4, optimizations=[memkit.FSDP(world_size=3)], **SIZES)
    with pytest.raises(ValueError, match="plan searches or fixes optimizer itself"):
        plan(PRESET, "4090", lora=4, optimizer="sgd", **SIZES)
    with pytest.raises(ValueError, match="lora must be a positive rank or None"):
        plan(PRESET, "4090", lora=0, **SIZES)
    with pytest.raises(ValueError, match="a quantized base trains only adapters"):
        plan(PRESET, "4090", optimizations=[memkit.Quantize(method="nf4")], **SIZES)


@pytest.mark.slow  # two estimates of tiny Flux, one with an EMA (~10 s on a loaded machine)
def test_a_dimension_that_conflicts_with_a_fixed_setting_leaves_the_search_named():
    fixed = memkit.Offload(to="cpu")
    result = plan(PRESET, card(1 << 30), optimizations=[LORA, fixed], gpus=2, search=("fsdp",), **SIZES)
    assert list(result.refused) == ["fsdp"] and result.estimates == 1  # the fixed settings alone
    assert "memkit.Offload moves whole blocks" in result.refused["fsdp"]
    assert result.refused["fsdp"].endswith(f"it conflicts with the fixed {fixed}")
    assert "--fsdp" not in result.best.flags
    ema = memkit.EMA(mode="offload")  # not searched: its placement is fixed; FSDP composes with it (its shards staged)
    result = plan(PRESET, card(1 << 30), optimizations=[LORA, ema], gpus=2, search=("fsdp",), **SIZES)
    assert result.refused == {} and "fsdp" in result.best.levels  # searched (the run fits unsharded here)


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
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


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_the_command_line_flags_reproduce_each_configuration(capsys):
    from memkit.cli import main

    code = main(["plan", PRESET, "--size", "tiny", "--gpu", "2GiB", "--lora", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["configs"] and all(c["fits"] for c in out["configs"])
    first = out["configs"][0]
    code = main(["estimate", PRESET, "--size", "tiny", "--gpu", "2GiB", "--lora", "4", *first["flags"], "--json"])
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again["peak_reserved_bytes"] == first["peak_reserved_bytes"] and again["fits"]


def test_the_command_line_refuses_bad_levels_and_gpus_naming_them(capsys):
    from memkit.cli import main

    cases = [
        (["--levels", "checkpointing"], "--levels checkpointing: give DIM=LEVEL[,LEVEL...], DIM one of optimizer"),
        (["--levels", "checkpointing=all,none"], "levels['checkpointing'] must name one or more of none, every:4"),
        (["--gpus", "0"], "--gpus takes an int >= 1 (the GPUs the run has), got 0"),
        (["--search", "fsdp"], "search names 'fsdp', which needs gpus=N above 1"),
    ]
    for flags, message in cases:
        assert main(["plan", PRESET, "--size", "tiny", "--gpu", "4090", *flags]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.extended  # CI time: sharded and offloaded estimates of tiny Flux (~15-25 s); plain flags in CI
def test_the_flags_of_offloading_fsdp_and_a_searched_ema_reproduce_each_configuration(capsys):
    from memkit.cli import main

    fixed = ["--size", "tiny", "--gpu", "2GiB", "--lora", "4", "--ema", "cpu_only:every=2"]
    runs = [["--gpus", "2", "--search", "fsdp,checkpointing,ema", "--levels", "fsdp=2", "--levels",
             "checkpointing=every:2"], ["--search", "offload,ema", "--levels", "offload=cpu"]]  # fmt: skip
    shown = set()
    for run in runs:
        assert main(["plan", PRESET, *fixed, *run, "--json"]) == 0
        for c in json.loads(capsys.readouterr().out)["tried"]:
            assert main(["estimate", PRESET, *fixed, *c["flags"], "--json"]) == 0  # the searched --ema comes last
            again = json.loads(capsys.readouterr().out)
            assert again["peak_reserved_bytes"] == c["peak_reserved_bytes"], c["flags"]
            shown |= {f for f in c["flags"] if f.startswith("--")} | {" ".join(c["flags"][-2:])}
    assert {"--fsdp", "--offload", "--checkpointing", "--ema"} <= shown
    assert "--ema device:every=2" in shown  # the fixed EMA's placement searched, its other settings kept


def test_configurations_are_ranked_by_the_step_time_of_their_own_ops_on_the_gpu():
    pytest.importorskip("memkit.steptime")
    from memkit.steptime import step_seconds

    gpu = card(1 << 30)
    gpu = gpus.GPU("test", "a test card", gpu.total_bytes, "a test card", 90, flops={"bf16": 1e12, "fp32": 1e11},
                   memory_bandwidth=1e11, host_link=1e10)  # fmt: skip
    result = plan(PRESET, gpu, optimizations=[LORA], search=("optimizer", "checkpointing"), **SIZES)
    assert result.configs and all(c.step_seconds is not None for c in result.tried)
    assert [c.step_seconds for c in result.configs] == sorted(c.step_seconds for c in result.configs)
    for c in result.configs:  # each one's time is the roofline of the ops its own estimate counted
        tl = memkit.estimate(PRESET, optimizations=list(c.optimizations), optimizer=c.levels["optimizer"],
                             count_ops=True, progress=False, **SIZES)  # fmt: skip
        assert c.step_seconds == step_seconds(tl.op_counts, gpu).seconds
    base = result.unconstrained  # nothing switched on: estimated for the comparison, fitting or not
    assert base is not None and base.levels == {"optimizer": "adamw", "checkpointing": None}
    for c in result.configs:
        if c.levels["checkpointing"]:  # recomputing every block's forward costs time, and the plan says how much
            assert c.step_seconds > base.step_seconds
            assert c.why.startswith(f"{c.step_seconds / base.step_seconds:.2f}x the step with nothing switched on")
            assert "recomputing checkpointed forwards" in c.why


def test_without_step_times_the_configurations_are_ranked_by_what_they_switch_on():
    gpu = gpus.GPU("test", "a test card", card(1 << 30).total_bytes, "a test card", 90, flops={"bf16": 1e12},
                   memory_bandwidth=1e11, host_link=1e10)  # fmt: skip
    result = plan(PRESET, gpu, optimizations=[LORA], search=("optimizer", "checkpointing"), step_time=False, **SIZES)
    assert result.unconstrained is None and all(c.step_seconds is None and not c.why for c in result.tried)


# CI time: resolution (16 s) and batch (15 s) in make test-extended; frames (the 4k+1 grid) in CI
@pytest.mark.parametrize(
    "what",
    [pytest.param(w, marks=pytest.mark.extended) for w in ("batch", "resolution")] + ["frames"],
)
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


def test_a_gpu_without_the_steps_dtype_figure_gets_no_step_time_and_says_why():
    # a T4 (Turing) has no bf16 tensor cores: its catalog entry holds fp16 and fp32 FLOP/s only
    result = plan(PRESET, "t4", optimizations=[LORA], search=("optimizer",), **SIZES)
    assert result.configs and all(c.step_seconds is None for c in result.tried) and result.unconstrained is None
    assert result.untimed.startswith("Tesla T4 has no bf16 FLOP/s figure (fp16, fp32 only)")


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
        with pytest.raises(ValueError, match=r"step_time=True \(the default; memkit plan without --no-time\)"):
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


@pytest.mark.slow  # a tiny plan, twice (~8 s on a loaded machine)
def test_a_timed_plan_s_frontier_figure_and_the_command_line_s_plot(tmp_path, capsys):
    from memkit.cli import main
    from memkit.plots import plan_figure

    result = plan(PRESET, "4090", lora=4, size="tiny")  # step times from each estimate's own ops
    timed = [c for c in result.tried if c.step_seconds is not None]
    assert timed and timed == result.tried  # every one estimated, fitting or not
    assert [(c.flags, c.step_seconds) for c in result.timed] == [(c.flags, c.step_seconds) for c in timed]
    fig = plan_figure(result)
    points = [(x, y) for tr in fig.data if tr.name in ("fits", "does not fit") for x, y in zip(tr.x, tr.y, strict=True)]
    assert sorted(points) == sorted((c.step_seconds, c.peak_reserved_bytes / 2**30) for c in timed)
    (chosen,) = [tr for tr in fig.data if tr.name.startswith("chosen")]
    assert (chosen.x[0], chosen.y[0]) == (result.best.step_seconds, result.best.peak_reserved_bytes / 2**30)
    out = tmp_path / "plan.html"
    code = main(["plan", PRESET, "--size", "tiny", "--gpu", "4090", "--lora", "4", "--plot", str(out)])
    assert code == 0 and f"wrote {out}" in capsys.readouterr().out
    assert "NVIDIA GeForce RTX 4090: usable" in out.read_text() and "plotly" in out.read_text()


def test_the_command_line_s_plot_needs_step_times_and_a_known_format(tmp_path, capsys):
    from memkit.cli import main

    base = ["plan", PRESET, "--size", "tiny", "--gpu", "4090", "--lora", "4"]
    assert main([*base, "--no-time", "--plot", str(tmp_path / "p.html")]) == 2
    assert "--plot draws the configurations' step times: leave out --no-time" in capsys.readouterr().err
    assert main([*base, "--plot", str(tmp_path / "p.svg")]) == 2
    assert "the file must end in .html or .png" in capsys.readouterr().err
    assert main([*base, "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before the search: nothing written


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="PNG export needs Chromium at /usr/bin/chromium")
@pytest.mark.slow  # kaleido starts Chromium: seconds
def test_the_command_line_s_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    from memkit.cli import main

    monkeypatch.setattr(memkit, "plan", lambda *a, **k: synthetic_plan([(0.5, 2), (0.25, 4), (None, 1)], usable=3))
    out = tmp_path / "plan.png"
    assert main(["plan", PRESET, "--gpu", "4090", "--lora", "4", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and f"wrote {out}" in capsys.readouterr().out


def test_a_step_time_bound_counts_configurations_estimated_before_a_dimension_left_the_search():
    """The bound on a configuration's step time (memkit._plan_fastest) is the slowest estimated configuration that
    switches on no more of quantization, the split and checkpointing, and the same of the rest. One estimated while
    a dimension was still searched (the split, before LoRA in the feed-forward refused it) counts where it had that
    dimension off, not where it had it on: with LoRA on full Flux this pruned 8-bit AdamW + fp8 storage + every
    block checkpointed from a 4090's plan (8 estimates instead of 9)."""
    from types import SimpleNamespace

    from memkit._plan_fastest import _time_bound

    def seen(*cands):
        return {i: [SimpleNamespace(levels=levels, step_seconds=t)] for i, (levels, t) in enumerate(cands)}

    later = {"optimizer": "adamw8bit", "quantize": "fp8-storage", "checkpointing": "all"}
    off = {"optimizer": "adamw8bit", "quantize": None, "ff_split": None, "checkpointing": "all"}
    on = {**off, "ff_split": 4}
    assert _time_bound(later, seen((off, 3.0)), DIMENSIONS) == 3.0
    assert _time_bound(later, seen((on, 3.5)), DIMENSIONS) == 0.0  # switched on there: no bound
    assert _time_bound(later, seen((off, 3.0), ({**off, "checkpointing": "every:2"}, 2.5)), DIMENSIONS) == 3.0
    assert _time_bound(later, seen(({**off, "optimizer": "adamw"}, 9.0)), DIMENSIONS) == 0.0  # another optimizer
    assert _time_bound(later, seen(({**off, "quantize": "nf4"}, 9.0)), DIMENSIONS) == 0.0  # switches on more
