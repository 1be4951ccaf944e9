"""Reserved bytes of a CUDA estimate: its events replayed through the caching-allocator model."""

import json

import numpy as np
import pytest
import torch

import memkit
from memkit._results import _cache_key
from memkit.cli import main
from memkit.memory.events import ALLOC, COLUMNS, FREE
from memkit.memory.reserved import replay_reserved
from memkit.memory.timeline import Timeline

MiB = 1 << 20
PRESET = "pixart"  # the cheapest tiny preset to estimate


def _stream(events: list[tuple[int, int, int]], devices=("cuda",), device_of=None) -> Timeline:
    """A timeline of (action, bytes, storage key) events on ``devices[0]`` (or ``device_of[i]``)."""
    n = len(events)
    cols = {name: np.zeros(n, dtype=dt) for name, dt in COLUMNS}
    cols["time"] = np.arange(n, dtype=np.float64)
    cols["action"] = np.array([e[0] for e in events], dtype=np.int8)
    cols["bytes"] = np.array([e[1] for e in events], dtype=np.int64)
    cols["storage"] = np.array([e[2] for e in events], dtype=np.int64)
    cols["category"] = np.full(n, 8, dtype=np.int8)  # temporary
    if device_of is not None:
        cols["device"] = np.array(device_of, dtype=np.int16)
    return Timeline(cols, devices=list(devices))


@pytest.fixture(scope="module")
def tiny_cuda():
    return memkit.estimate(PRESET, size="tiny", device="cuda", progress=False)


def test_reserved_never_below_allocated(tiny_cuda):
    tl = tiny_cuda
    assert tl.reserved_bytes is not None and len(tl.reserved_bytes) == len(tl)
    assert (tl.reserved_bytes >= tl.live_bytes).all()
    assert tl.baseline_reserved_bytes >= tl.baseline_bytes
    assert tl.peak_reserved_bytes >= tl.peak_bytes
    meta = tl.meta
    assert meta["unmatched_frees"] == 0
    # reserved is cumulative: the steady step starts with what the first left cached
    assert meta["steady_peak_reserved_bytes"] >= meta["first_step_peak_reserved_bytes"]
    assert meta["peak_reserved_bytes"] == tl.peak_reserved_bytes
    assert 0 <= meta["fragmentation_bytes"] <= tl.peak_reserved_bytes - tl.baseline_bytes
    assert meta["alloc_conf"] == ""
    assert "reserved_bytes" in tl.to_pandas()
    assert tl.copy().peak_reserved_bytes == tl.peak_reserved_bytes  # the process cache hands out copies


def test_hand_built_stream_gives_the_allocator_rules():
    # By the rules of CUDACachingAllocator.cpp (torch's defaults):
    #  A 3 MiB: a large request under 10 MiB gets a 20 MiB segment                      reserved 20
    #  B 3 MiB: split from that segment's free 17 MiB                                   20
    #  free A: cached, reserved stays                                                   20
    #  C 30 MiB: no cached block fits (3 and 14 MiB); >= 10 MiB: a segment of 30 MiB   50
    #  D 100 KiB: the small pool: a 2 MiB segment                                       52
    #  free C; E 20 MiB: C's cached 30 MiB block, split (remainder > 1 MiB)             52
    #  F 11 MiB: best fit is the 14 MiB tail of the first segment                       52
    #  G 12 MiB: the 10 MiB left of C and the 3 MiB of A do not fit: a new 12 MiB one   64
    events = [
        (ALLOC, 3 * MiB, 1),
        (ALLOC, 3 * MiB, 2),
        (FREE, 3 * MiB, 1),
        (ALLOC, 30 * MiB, 3),
        (ALLOC, 100 * 1024, 4),
        (FREE, 30 * MiB, 3),
        (ALLOC, 20 * MiB, 5),
        (ALLOC, 11 * MiB, 6),
        (ALLOC, 12 * MiB, 7),
    ]
    replay = replay_reserved(_stream(events))
    assert (replay.series // MiB).tolist() == [20, 20, 20, 50, 52, 52, 52, 52, 64]
    assert replay.baseline_bytes == 0 and replay.unmatched_frees == 0
    # with expandable segments every large request maps 20 MiB pages of one segment at its lowest free address:
    # A, B: 20; C at 6..36 MiB: pages to 40; D: the small pool's 2 MiB page: 42; E in C's place (6..26); F at
    # 26..37 in mapped pages (A's 3 MiB hole is too small); G at 37..49: pages to 60 MiB: 62
    expandable = replay_reserved(_stream(events), alloc_conf="expandable_segments:True")
    assert (expandable.series // MiB).tolist() == [20, 20, 20, 40, 42, 42, 42, 42, 62]


def test_baseline_blocks_and_other_devices():
    # a 3 MiB baseline block takes a 20 MiB segment; its free pairs by size when its key is unknown (a spliced
    # block's); the host's event is not fed to the allocator
    tl = _stream([(ALLOC, 64 * MiB, 9), (FREE, 3 * MiB, 77)], devices=("cuda", "cpu"), device_of=[1, 0])
    replay = replay_reserved(tl, baseline_blocks=[(5, 3 * MiB, 0)])
    assert replay.baseline_bytes == 20 * MiB
    assert (replay.series // MiB).tolist() == [20, 20]
    assert replay.unmatched_frees == 0


@pytest.mark.slow  # full Flux twice (memoized: ~5 s each)
def test_expandable_segments_reserve_less_on_full_flux_lora():
    # full Flux, LoRA (rank 16), bf16 AdamW, steady step (measured 2026-11-26): allocated 50,382,353,408 B;
    # reserved 51,120,177,152 B with torch's defaults, 50,570,723,328 B with expandable segments
    plain = memkit.estimate("flux", optimizations=[memkit.LoRA()], progress=False)
    expandable = memkit.estimate(
        "flux", optimizations=[memkit.LoRA()], progress=False, alloc_conf="expandable_segments:True"
    )
    assert plain.meta["steady_peak_bytes"] == expandable.meta["steady_peak_bytes"]
    assert expandable.meta["steady_peak_reserved_bytes"] <= plain.meta["steady_peak_reserved_bytes"]
    assert expandable.peak_reserved_bytes >= expandable.peak_bytes
    assert plain.meta["unmatched_frees"] == expandable.meta["unmatched_frees"] == 0


def test_alloc_conf_is_in_the_cache_key(tiny_cuda):
    common = dict(
        model=PRESET, inputs=None, step=None, optimizations=(), dtype=None, size="tiny", batch_size=1,
        device="cuda", seed=0, parallel=None, sizes={}, memoize=True,
    )  # fmt: skip
    assert _cache_key(**common, alloc_conf="") != _cache_key(**common, alloc_conf="expandable_segments:True")
    other = memkit.estimate(PRESET, size="tiny", device="cuda", progress=False, alloc_conf="max_split_size_mb:64")
    assert not other.meta["cached"] and other.meta["alloc_conf"] == "max_split_size_mb:64"


def test_bad_alloc_conf_names_the_option():
    with pytest.raises(ValueError, match="expandable_segment'"):
        memkit.estimate(PRESET, size="tiny", progress=False, alloc_conf="expandable_segment:True")


def test_cpu_estimate_and_tracked_run_have_no_reserved():
    tl = memkit.estimate(PRESET, size="tiny", device="cpu", progress=False)
    assert tl.peak_reserved_bytes is None and tl.reserved_bytes is None
    assert tl.meta["peak_reserved_bytes"] is None and tl.meta["fragmentation_bytes"] is None
    with memkit.track() as tracked:
        torch.randn(1024) * 2
    assert tracked.peak_reserved_bytes is None


def test_cli_alloc_conf_and_json(capsys, tiny_cuda):
    argv = ["estimate", PRESET, "--size", "tiny", "--alloc-conf", "expandable_segments:True"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["alloc_conf"] == "expandable_segments:True"
    assert out["peak_reserved_bytes"] >= out["peak_bytes"]
    assert 0 <= out["fragmentation_bytes"] <= out["peak_reserved_bytes"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "peak reserved" in table and "fragmentation" in table and "expandable_segments:True" in table
    assert main(["estimate", PRESET, "--size", "tiny", "--alloc-conf", "nope:1"]) != 0
    assert "'nope'" in capsys.readouterr().err


def test_timeline_figure_draws_reserved(tiny_cuda):
    from memkit.plots import timeline_figure

    names = [t.name for t in timeline_figure(tiny_cuda).data]
    assert "reserved" in names
    cpu = memkit.estimate(PRESET, size="tiny", device="cpu", progress=False)
    assert "reserved" not in [t.name for t in timeline_figure(cpu).data]


# full Flux, every block (~30 s): in `make test-extended`; CI's tests/test_memo.py::test_full_size[flux-kwargs0]
# holds the whole reserved series and baseline of the same pair equal
@pytest.mark.extended
def test_spliced_baseline_gives_the_reserved_of_every_block():
    # the memoized timeline's baseline blocks are the probe's, the middle block's repeated (_spliced_baseline)
    spliced = memkit.estimate("flux", progress=False)
    every = memkit.estimate("flux", progress=False, memoize=False)
    assert spliced.meta["memoized"] and not every.meta["memoized"]
    assert spliced.baseline_reserved_bytes == every.baseline_reserved_bytes
    keys = ("first_step_peak_reserved_bytes", "steady_peak_reserved_bytes", "fragmentation_bytes")
    assert [spliced.meta[k] for k in keys] == [every.meta[k] for k in keys]


@pytest.mark.slow  # full Flux four times (memoized: ~5 s each)
@pytest.mark.extended  # CI time (16 s): the README table re-estimated in make test-extended
def test_the_readme_reserved_table_is_what_the_estimates_say(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text[text.index("| FLUX.1-dev (full size, bf16 AdamW") :].split("\n\n")[0].splitlines()[2:]
    assert len(table) == 2
    for row in table:
        command, *figures = re.fullmatch(
            r"\| .*\(`(memkit estimate [^`]+)`\) \| ([\d.]+) GiB \| ([\d.]+) GiB \| ([\d.]+) GiB \|", row
        ).groups()
        got = []
        for conf in ("", "expandable_segments:True"):
            assert main([*command.split()[1:], "--json", "--alloc-conf", conf]) == 0
            got.append(json.loads(capsys.readouterr().out))
        plain, expandable = got
        key = "steady_peak_reserved_bytes"
        shown = [plain["steady_peak_bytes"], plain[key], expandable[key]]
        assert [f"{b / 2**30:.2f}" for b in shown] == figures, row


# diffusers PR #10611 (the gradient-checkpointing patterns PR, ../shared/seeds/): LTX-Video (1.9B) in bfloat16 on a
# GPU, batch 1, 512x768 px, 81 frames, 128 text tokens, `output.mean().backward()` in a loop without an optimizer
# after two warm-up iterations and `empty_cache()`; it printed torch.cuda.max_memory_reserved() / 1024**3 per
# pattern. memkit's allocated peak sat 6-10% below these; its reserved estimate must meet them (the issue asks
# within 10%; seen: within 0.5%, bench/RESULTS.md "reserved"). The patterns that checkpoint some blocks run every
# block (~12 s each): in `make test-extended`.
PR_10611 = {"none": 26.719, "every:4": 22.188, "every:2": 17.658, "all": 9.316}


@pytest.mark.slow
@pytest.mark.parametrize(
    "pattern", [p if p in ("none", "all") else pytest.param(p, marks=pytest.mark.extended) for p in PR_10611]
)
def test_the_published_reserved_figures_of_pr_10611(pattern):
    tl = memkit.estimate(
        "ltx-video", dtype=torch.bfloat16, optimizer=None, steps=2, progress=False,
        optimizations=[memkit.Checkpointing.parse(pattern)], height=512, width=768, frames=81, text_len=128,
    )  # fmt: skip
    assert tl.meta["measured"] == "steady"
    assert tl.peak_reserved_bytes / 2**30 == pytest.approx(PR_10611[pattern], rel=0.02)
    assert tl.peak_bytes < tl.peak_reserved_bytes  # the allocated peak alone would be what users compared before
