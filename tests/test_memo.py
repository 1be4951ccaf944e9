"""Block memoization: an estimate spliced from a probe of four blocks per list is byte-equal to running every block.

"Byte-equal" is checked on everything a timeline holds: each event's action, bytes, category, phase, device, op
and frame; which allocation each free pairs with (the storage keys differ, their pairing must not); the baseline
by category; the parameter count; where each step starts; the two step peaks. Every preset is built with more
blocks than the probe keeps (tiny widths, so each estimate takes about a second), under every setting memoization
supports; the full-size checks (Flux, Wan, LTX-Video) and the pairs of preset and setting beyond one per setting
are marked slow.
"""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from conftest import CORE_PRESETS

import memkit
from memkit import _memo, _splice
from memkit.presets import PRESETS

# `make test-fast` keeps these cases (tests/conftest.py): the splice with one block list and with two, a
# checkpointed and a quantized-LoRA step, and inference; every other preset and setting runs in `make test` and CI
FAST_CASES = {
    "test_every_preset_default_step": {"wan"},  # Flux's two block lists: flux-checkpointing below
    "test_every_setting": {"flux-checkpointing", "wan-nf4-lora", "ltx-video-inference", "flux-ema"},
    "test_ema_every_preset": {"ltx-video-ema-cpu-only"},  # an EMA's buffer grown in host memory, staged
    "test_other_presets_settings": {"dit-inference"},
    "test_single_stream_presets_settings": set(),
    "test_fsdp": set(),  # FSDP's steady step: tests/test_steady.py::test_fsdp_runs_the_steady_step
    "test_a_preset_builds_its_probe_directly": set(),
    "test_a_refused_model_runs_every_block_and_says_why": {"cogview4"},
    "test_what_is_not_memoized_says_why": {
        "kwargs0-in no repeating period", "kwargs1-is not memoized when ops are counted", "kwargs2-memoize=False"},
    # one list whose first block is not checkpointed; Flux's two lists of uneven lengths (every:2, ~11 s) run in
    # `make test`, and test_a_periodic_probe_keeps_a_head_and_a_period_in_phase checks their probe here
    "test_periodic_checkpointing": {"wan-skip-every-2"},
}  # fmt: skip

LAYERS = {  # more blocks per list than the probe keeps (4)
    "flux": {"num_layers": 5, "num_single_layers": 6},
    "sd3": {"num_layers": 5},
    "ltx-video": {"num_layers": 5},
    "ltx-2": {"num_layers": 5},  # two streams per block, a prediction each
    "wan": {"num_layers": 6},
    "hunyuanvideo": {"num_layers": 5, "num_single_layers": 6},
    "cogvideox-5b": {"num_layers": 5},
    "cogvideox-2b": {"num_layers": 5},
    "pixart": {"num_layers": 5},
    "dit": {"num_layers": 5},
    "sana": {"num_layers": 5},
    "wan2.2-ti2v-5b": {"num_layers": 5},  # a timestep per token: per-token modulations in every block
    "sd3.5-large": {"num_layers": 5},  # QK norm
    "sd3.5-medium": {"num_layers": 5},  # its first block (only) with a second attention
    "flux2-dev": {"num_layers": 5, "num_single_layers": 6},
    "chroma": {"num_layers": 5, "num_single_layers": 6, "approximator_layers": 5},  # as released: 5 (not blocks)
    "auraflow": {"num_mmdit_layers": 5, "num_single_dit_layers": 6},
    "z-image": {"n_layers": 5},  # a list of latents and of captions in, a list out
    "lumina2": {"num_layers": 5},  # reads its attention mask's values (caption lengths)
}


def deep(preset: str, **config):
    """A builder of the tiny preset with the blocks of ``LAYERS`` (memkit's tiny inputs), ``config`` set over it."""
    config = dict(PRESETS[preset].configs["tiny"]) | LAYERS[preset] | config
    cls = getattr(diffusers, PRESETS[preset].model_class)

    def build():
        model = cls(**config)
        model._memkit_preset, model._memkit_size = preset, "tiny"
        return model

    build.__name__ = preset
    return build


def periodic(preset: str, n: int):
    """:func:`deep` with ``n`` blocks in the preset's first list and ``n + 1`` in its second, if any."""
    layers = {k: v if k == "approximator_layers" else n + i for i, (k, v) in enumerate(LAYERS[preset].items())}
    return deep(preset, **layers)


def _pairs(tl: memkit.Timeline) -> list[int]:
    """For each event: the index of the allocation a free pairs with (-1: a storage from before the window)."""
    live: dict[int, int] = {}
    out = []
    for i, (action, key) in enumerate(zip(tl.column("action").tolist(), tl.column("storage").tolist(), strict=True)):
        if key == -1:
            out.append(-2)
        elif action == 0:
            live[key] = i
            out.append(-3)
        else:
            out.append(live.pop(key, -1))
    return out


def assert_same(memo: memkit.Timeline, slow: memkit.Timeline) -> None:
    assert memo.meta["memoized"], memo.meta["memo"]
    assert not slow.meta["memoized"]
    assert len(memo) == len(slow)
    for name in ("action", "bytes", "category", "phase", "device", "op", "frame"):
        a, b = memo.column(name), slow.column(name)
        assert np.array_equal(a, b), f"column {name!r} differs first at event {int(np.argmax(a != b))}"
    assert (memo.ops, memo.devices) == (slow.ops, slow.devices)
    assert _pairs(memo) == _pairs(slow)
    assert memo.baseline_by_category == slow.baseline_by_category
    for key in (
        "parameters",
        "trainable_parameters",
        "step_starts",
        "first_step_peak_bytes",
        "steady_peak_bytes",
        "host_bytes",
    ):
        assert memo.meta[key] == slow.meta[key], key
    assert memo.peak_bytes == slow.peak_bytes
    # the caching-allocator replay sees the same blocks: the spliced baseline's repeated storages included
    assert memo.baseline_reserved_bytes == slow.baseline_reserved_bytes
    if memo.reserved_bytes is not None:
        assert np.array_equal(memo.reserved_bytes, slow.reserved_bytes)


def both(model, **kwargs) -> tuple[memkit.Timeline, memkit.Timeline]:
    kwargs.setdefault("progress", False)
    return memkit.estimate(model, **kwargs), memkit.estimate(model, memoize=False, **kwargs)


# CI time: LTX-2 (15 s, the largest probe) is spliced in make test-extended only
@pytest.mark.parametrize(
    "preset", [p if p != "ltx-2" else pytest.param(p, marks=pytest.mark.extended) for p in sorted(LAYERS)]
)
def test_every_preset_default_step(preset):
    # bf16 AdamW on "cuda", first and steady step: the default every user sees
    assert_same(*both(deep(preset)))


@pytest.mark.parametrize("preset", ["qwen-image", "cogview4", "mochi", "hunyuanvideo-1.5"])
def test_a_refused_model_runs_every_block_and_says_why(preset):
    from memkit.presets import PRESETS

    tl = memkit.estimate(preset, size="tiny", progress=False)
    assert not tl.meta["memoized"] and "the splice does not reproduce" in tl.meta["memo"]
    assert _memo.refused(PRESETS[preset].model_class) and _memo.refused("FluxTransformer2DModel") is None


@pytest.mark.slow  # ~20 s; the fast suite cuts Chroma's blocks through test_every_preset_default_step[chroma]
def test_a_preset_with_layers_sized_by_its_block_counts_is_probed_from_the_whole_model_cut():
    # Chroma's modulation table has a row per block modulation (its approximator runs each): a probe built with four
    # blocks per list would shrink it; the whole model cut keeps it. Small Chroma has six single blocks.
    kwargs = dict(size="small", height=64, width=64, text_len=8, progress=False)
    assert_same(memkit.estimate("chroma", **kwargs), memkit.estimate("chroma", memoize=False, **kwargs))
    assert _memo.cut_whole("ChromaTransformer2DModel") and not _memo.cut_whole("FluxTransformer2DModel")


SETTINGS = {
    "checkpointing": dict(optimizations=[memkit.Checkpointing()]),
    "selective": dict(optimizations=[memkit.Checkpointing(provider="selective")]),
    "ff-split": dict(optimizations=[memkit.FFSplit(splits=2)]),
    "ff-sequence": dict(optimizations=[memkit.FFSplit(splits=2, mode="sequence")]),
    "both": dict(optimizations=[memkit.Checkpointing(), memkit.FFSplit(splits=2)]),
    "sgd-3-steps": dict(optimizer="sgd", steps=3),
    "no-optimizer": dict(optimizer=None),
    "first-step": dict(steps=1),
    "grad-accum-2": dict(grad_accum=2),
    "fused-backward": dict(fused_backward=True),
    "inference": dict(mode="inference"),
    "fp32-cpu": dict(device="cpu", dtype=torch.float32, optimizer="adam"),
    "batch-2": dict(batch_size=2),
    "lora": dict(optimizations=[memkit.LoRA(rank=4)]),
    "dora-checkpointing": dict(optimizations=[memkit.LoRA(rank=4, dora=True), memkit.Checkpointing()]),
    # a quantized base whose state is the parameters themselves (layerwise casting, torchao): spliced from the probe
    "fp8-storage-lora": dict(optimizations=[memkit.Quantize(method="fp8-storage"), memkit.LoRA(rank=4)]),
    "int8wo-lora": dict(optimizations=[memkit.Quantize(method="int8wo"), memkit.LoRA(rank=4)]),
    # bitsandbytes' quant states (absmax, code, the nested level) belong to their blocks as the weights do
    "nf4-lora": dict(optimizations=[memkit.Quantize(method="nf4"), memkit.LoRA(rank=4)]),
    "nf4-dq-lora": dict(optimizations=[memkit.Quantize(method="nf4-dq"), memkit.LoRA(rank=4)]),
    # an EMA's shadows: views of one buffer of every block's, grown by the blocks the probe leaves out
    "ema": dict(optimizations=[memkit.EMA()]),
    "ema-loop": dict(optimizations=[memkit.EMA(foreach=False)]),
    "ema-every-2": dict(optimizations=[memkit.EMA(update_every=2)]),
    # staged through buffers sized by every block's shadows (the probe's weighted by the blocks each stands for)
    "ema-fp32": dict(optimizations=[memkit.EMA(dtype=torch.float32)]),
    "ema-offload": dict(optimizations=[memkit.EMA(mode="offload")]),  # the shadows in host memory, grown as well
    "ema-cpu-only": dict(optimizations=[memkit.EMA(mode="cpu_only", dtype=torch.float32, foreach=False)]),
    "ema-lora-checkpointing": dict(optimizations=[memkit.LoRA(rank=4), memkit.Checkpointing(), memkit.EMA()]),
}


# The splice is the same code for every preset (each preset's blocks are checked by the default step above): the
# fast set (and CI's `make test`) runs each setting once, Flux (two block lists) for most, Wan and LTX-Video (one
# list each) for the rest; `make test-extended` runs every other pair (~6 s each).
FAST_PRESET = {"ff-sequence": "wan", "no-optimizer": "wan", "fp32-cpu": "wan", "inference": "ltx-video",
               "batch-2": "ltx-video", "sgd-3-steps": "ltx-video", "first-step": "ltx-video",
               "dora-checkpointing": "wan", "fused-backward": "wan", "grad-accum-2": "wan",
               "int8wo-lora": "wan", "nf4-lora": "wan", "nf4-dq-lora": "wan", "both": "wan",
               "ema-loop": "wan", "ema-every-2": "ltx-video", "ema-offload": "wan", "ema-cpu-only": "ltx-video",
               "ema-lora-checkpointing": "wan"}  # fmt: skip


def _pairs_of(presets, settings, fast):
    return [
        pytest.param(p, s, marks=() if (p, s) in fast else pytest.mark.extended, id=f"{p}-{s}")
        for p in presets
        for s in settings
    ]


@pytest.mark.parametrize(
    "preset, setting",
    _pairs_of(["flux", "wan", "ltx-video"], sorted(SETTINGS), {(FAST_PRESET.get(s, "flux"), s) for s in SETTINGS}),
)
def test_every_setting(preset, setting):
    assert_same(*both(deep(preset), **SETTINGS[setting]))


@pytest.mark.parametrize(
    "preset, setting",
    _pairs_of(
        ["sd3", "pixart", "dit", "hunyuanvideo", "cogvideox-5b", "cogvideox-2b"],
        ["checkpointing", "ff-split", "inference", "lora"],
        {("sd3", "checkpointing"), ("pixart", "ff-split"), ("dit", "inference")},
    ),
)
def test_other_presets_settings(preset, setting):
    assert_same(*both(deep(preset), **SETTINGS[setting]))


@pytest.mark.parametrize(
    "preset, setting",
    # Lumina2 in a batch of 2: the caption lengths it reads from its mask (one per sample) stay known in the probe.
    # No ff-split: their feed-forwards are SwiGLU (w1, w3 into w2), which FFSplit does not split
    _pairs_of(["z-image", "lumina2"], ["checkpointing", "inference", "lora", "batch-2"], {("lumina2", "batch-2")}),
)
def test_single_stream_presets_settings(preset, setting):
    assert_same(*both(deep(preset), **SETTINGS[setting]))


FSDP = {
    "fsdp-2": ("flux", dict(parallel=memkit.FSDP(world_size=2))),
    "fsdp-4-checkpointing": ("flux", dict(parallel=memkit.FSDP(world_size=4), optimizations=[memkit.Checkpointing()])),
    "fsdp-keep-unsharded": ("wan", dict(parallel=memkit.FSDP(world_size=2, reshard_after_forward=False))),
    "fsdp-fp16-params": ("flux", dict(parallel=memkit.FSDP(world_size=2, mixed_precision=torch.float16))),
    "fsdp-8-ff-split": ("sd3", dict(parallel=memkit.FSDP(world_size=8), optimizations=[memkit.FFSplit(splits=2)])),
    "fsdp-ltx": ("ltx-video", dict(parallel=memkit.FSDP(world_size=2), optimizer="sgd", steps=3)),
    "fsdp-pixart": ("pixart", dict(parallel=memkit.FSDP(world_size=2))),
    "fsdp-hunyuanvideo": ("hunyuanvideo", dict(parallel=memkit.FSDP(world_size=2))),
    # optimizer state before the measured step: the optimizer holds local shards, owned by their blocks' storage
    "fsdp-adam-3-steps": (
        "wan",
        dict(parallel=memkit.FSDP(world_size=4), optimizer="adam", steps=3, optimizations=[memkit.Checkpointing()]),
    ),
    "fsdp-3-batch-2": ("flux", dict(parallel=memkit.FSDP(world_size=3), batch_size=2)),
    # an EMA of the shards: a shadow of its own per parameter, its block's as the optimizer's state is
    "fsdp-ema": ("flux", dict(parallel=memkit.FSDP(world_size=2), optimizations=[memkit.EMA()])),
}


# a batch of 2 is spliced in test_every_setting (in CI), and each preset's blocks in test_every_preset_default_step
# (FSDP's hooks are the same for every block): these under FSDP, and FSDP with checkpointing (fsdp-adam-3-steps), in
# `make test-extended` (~11-15 s each)
_FSDP_TIER = {  # fsdp-fp16-params (11 s): FSDP's param dtype, its hooks the same as fsdp-2's
    c: pytest.mark.extended
    # fsdp-adam-3-steps (11-13 s): FSDP with checkpointing and earlier steps' state, fsdp-2's hooks (CI time)
    for c in (
        "fsdp-3-batch-2",
        "fsdp-4-checkpointing",
        "fsdp-hunyuanvideo",
        "fsdp-ltx",
        "fsdp-fp16-params",
        "fsdp-adam-3-steps",
    )
}


@pytest.mark.parametrize(
    "case",
    [c if c == "fsdp-2" else pytest.param(c, marks=_FSDP_TIER.get(c, pytest.mark.slow)) for c in sorted(FSDP)],
)
def test_fsdp(case):
    # FSDP's hooks gather each block's parameters before its forward, reshard after it, free the last gather's
    # buffer in the next block's, gather the block before in each block's backward (prefetch) and reduce-scatter
    # its gradients: every one of them tagged to the block whose hook or autograd node ran it
    preset, kwargs = FSDP[case]
    assert_same(*both(deep(preset), **kwargs))


EMA_SETTINGS = ["ema", "ema-fp32", "ema-offload", "ema-cpu-only", "ema-loop", "ema-every-2"]


@pytest.mark.parametrize(
    "preset, setting",
    # one EMA setting per preset, in turn: every preset's blocks under an EMA, every mode on several presets
    [
        pytest.param(p, s, marks=() if p == "ltx-video" else pytest.mark.slow, id=f"{p}-{s}")
        for i, p in enumerate(sorted(LAYERS))
        if p != "ltx-2"  # CI time: its probe (15 s) is spliced in test_every_preset_default_step, extended
        for s in [EMA_SETTINGS[i % len(EMA_SETTINGS)]]
    ],
)
def test_ema_every_preset(preset, setting):
    assert_same(*both(deep(preset), **SETTINGS[setting]))


@pytest.mark.parametrize("ema", [memkit.EMA(dtype=torch.float32), memkit.EMA(mode="offload")], ids=str)
@pytest.mark.slow  # ~5 s each: the staged settings are spliced at tiny widths in test_every_setting
def test_an_emas_staging_buffers_are_the_full_models(ema):
    """A staged EMA update (fp32 shadows of bf16 parameters; shadows in host memory) goes through buffers sized by
    every shadow's elements (1/64 of them, within 64 Ki elements and ``chunk_mb``): blocks wide enough that the
    probe's own shadows would make a smaller buffer. Its EMA weighs each shadow by the blocks its block stands for."""
    wide = deep("wan", num_attention_heads=3, attention_head_dim=128, ffn_dim=1536)
    memo, slow = both(wide, optimizations=[ema])
    assert_same(memo, slow)
    staged = memo.column("bytes")[(memo.column("phase") == memkit.PHASES.index("ema")) & (memo.column("action") == 0)]
    assert staged.max() > 4 * 2**16  # above the floor of 64 Ki elements: sized by the shadows


def test_memoized_estimate_runs_only_the_probe():
    """The probe keeps four blocks per list: the tracker sees fewer events than the timeline holds."""
    seen = []
    real = _splice.splice

    def spy(tagger, rows, retags, baseline):
        seen.append((len(rows), [len(blocks) for _, _, blocks in tagger.lists], [n for _, n, _ in tagger.lists]))
        return real(tagger, rows, retags, baseline)

    _splice.splice = spy
    try:
        tl = memkit.estimate(deep("flux"), progress=False)
    finally:
        _splice.splice = real
    [(probe_events, kept, full)] = seen
    assert kept == [4, 4] and full == [5, 6]
    assert probe_events < len(tl)
    assert tl.meta["memo"].startswith("spliced")


def every(pattern: str, **kwargs) -> list:
    return [memkit.Checkpointing(pattern=pattern, **kwargs)]


PERIODIC = {  # (blocks in the first list, settings): a checkpointing pattern whose blocks repeat with a period
    # 13 and 14 blocks: probes of 9 and 8, two and three periods repeated, an odd list and an even one
    "every-2": (13, dict(optimizations=every("every:2"))),
    # 17 and 18 blocks: probes of 11 and 12, two periods repeated each
    "every-3": (17, dict(optimizations=every("every:3"))),
    # the first block not checkpointed: the backward frees an input all blocks keep in the lowest checkpointed one
    "skip-every-2": (13, dict(optimizations=every("skip-every:2"))),
    "every-2-selective": (13, dict(optimizations=every("every:2", provider="selective"))),
    # the EMA's shadows and the adapters' per block, weighed by the blocks each probe block stands for
    "every-2-lora-ema": (13, dict(optimizations=[memkit.LoRA(rank=4), *every("every:2"), memkit.EMA()])),
    "every-3-ff-split": (14, dict(optimizations=[*every("every:3"), memkit.FFSplit(splits=2)])),  # probe of 12
}


def _periodic_tier(preset: str, setting: str):
    if preset not in CORE_PRESETS:
        return pytest.mark.slow
    if preset in ("wan", "ltx-video") and setting not in ("every-2", "skip-every-2"):
        return pytest.mark.extended
    return ()


@pytest.mark.parametrize(
    "preset, setting",
    [
        # CI time: the presets beyond the core ones are slow, so the extended tier (tests/conftest.py) runs them; so
        # are Wan's and LTX-Video's combinations (~85 CPU-s): their one list's splice is the plain patterns' (every-2,
        # skip-every-2, kept here), and each combination runs on Flux's two lists here
        pytest.param(p, s, marks=_periodic_tier(p, s), id=f"{p}-{s}")
        for p in sorted(LAYERS)
        if p != "ltx-2"  # CI time: its probe (15 s) is spliced in test_every_preset_default_step, extended
        for s in PERIODIC
        if s == "every-2" or p in ("flux", "wan", "ltx-video")
    ],
)
def test_periodic_checkpointing(preset, setting):
    """Some blocks checkpointed and not others, in a period: every middle block has a probe block of its phase whose
    neighbours are checkpointed as its own are (memkit._memo_period), and the splice repeats the period."""
    n, kwargs = PERIODIC[setting]
    memo, slow = both(periodic(preset, n), **kwargs)
    assert_same(memo, slow)
    assert "period" in memo.meta["memo"]


def test_a_periodic_probe_keeps_a_head_and_a_period_in_phase(monkeypatch):
    seen = []
    real = _splice.splice

    def spy(tagger, rows, retags, baseline):
        seen.append(([len(blocks) for _, _, blocks in tagger.lists], [n for _, n, _ in tagger.lists], tagger.period))
        return real(tagger, rows, retags, baseline)

    monkeypatch.setattr(_splice, "splice", spy)
    memkit.estimate(periodic("flux", 13), optimizations=every("every:2"), progress=False)
    # the first block and two periods, a period, the last block (and one more to keep 13's phase)
    assert seen == [([9, 8], [13, 14], 2)]
    for period in (1, 2, 3, 5):
        for n in range(_memo.head(period) + period + 1, 40):
            size = _memo.probe_length(n, period)
            kept = _memo.kept(n, size, period)
            assert len(kept) == size and (n - size) % period == 0 and size <= _memo.head(period) + 2 * period
            assert [_memo.own(J, n, size, period) for J in kept] == list(range(size))
            assert sum(_memo.stands_for(b, n, size, period) for b in range(size)) == n


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(optimizations=every("first:2")), "in no repeating period"),
        # the counter gives each op the block of the shadow it writes: a staged EMA update writes its staging buffer
        (dict(optimizations=[memkit.EMA(mode="offload")], count_ops=True), "is not memoized when ops are counted"),
        (dict(memoize=False), "memoize=False"),
        (dict(optimizations=[memkit.Checkpointing(pattern=(0, 3))]), "a tuple of blocks (the planner's spread)"),
        (dict(optimizations=every("every:2", provider="offload")), "keeps checkpoint inputs off the device"),
        # a period too long for the lists: the probe would be the model
        (dict(optimizations=every("every:4")), "longer than its probe for a checkpointing period of 4"),
        # shards offloaded to host memory: not a device timeline the splice repeats
        (dict(parallel=memkit.FSDP(world_size=2, cpu_offload=True)), "keeps memory off the device"),
    ],
)
def test_what_is_not_memoized_says_why(kwargs, reason):
    tl = memkit.estimate(deep("ltx-video"), progress=False, **kwargs)  # one list: the cheapest deep preset to run
    assert tl.meta["memoized"] is False
    assert reason in tl.meta["memo"]


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_a_model_without_block_lists_runs_every_block():
    tl = memkit.estimate("unet", size="tiny", progress=False)
    assert tl.meta["memoized"] is False
    assert "no list" in tl.meta["memo"]


def test_block_lists_need_identical_blocks():
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(5)])
    assert _memo.block_lists(torch.nn.Sequential(blocks)) == [("0", blocks)]
    blocks[2] = torch.nn.Linear(4, 4, bias=False)
    assert _memo.block_lists(torch.nn.Sequential(blocks)) == []
    short = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(4)])  # no more blocks than the probe keeps
    assert _memo.block_lists(torch.nn.Sequential(short)) == []


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_a_probe_that_does_not_split_falls_back(monkeypatch):
    """Events the splice cannot place make the estimate run every block, saying so: never a wrong number."""

    def refuse(*args, **kwargs):
        raise _memo.Unsupported("test refusal")

    monkeypatch.setattr(_splice, "splice", refuse)
    memo = memkit.estimate(deep("ltx-video"), progress=False)
    slow = memkit.estimate(deep("ltx-video"), progress=False, memoize=False)
    assert memo.meta["memoized"] is False and "test refusal" in memo.meta["memo"]
    assert np.array_equal(memo.column("bytes"), slow.column("bytes"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, kwargs",
    [
        ("flux", {}),
        # Wan under FSDP over 8 (~30 s): test_fsdp splices Wan's FSDP at a smaller depth in CI
        pytest.param("wan", dict(parallel=memkit.FSDP(world_size=8)), marks=pytest.mark.extended),
        # the settings below are spliced at a smaller depth in test_every_setting (in CI); at full size, in
        # `make test-extended` (~20 s each)
        pytest.param("flux", dict(optimizations=[memkit.Checkpointing()]), marks=pytest.mark.extended),
        pytest.param("wan", dict(optimizations=[memkit.FFSplit(splits=4)]), marks=pytest.mark.extended),
        pytest.param(
            "ltx-video",
            dict(optimizations=[memkit.Checkpointing(provider="selective"), memkit.FFSplit(splits=2)]),
            marks=pytest.mark.extended,
        ),
        # an EMA's one buffer of every block's shadows, grown from the probe's (~15 s, ~12 of them every block's run)
        ("flux", dict(optimizations=[memkit.EMA()])),
        # every other block checkpointed: probes of 9 and 8 blocks for 19 and 38 (~30 s, ~24 of them every block's)
        ("flux", dict(optimizations=every("every:2"))),
    ],
)
def test_full_size(preset, kwargs):
    assert_same(*both(preset, **kwargs))


def test_a_list_whose_middle_blocks_differ_is_not_probed():
    # SD3.5 Medium: blocks 0-12 of 24 have a second attention, 13-22 not: no block stands for all the middle ones
    medium = PRESETS["sd3.5-medium"]
    assert _memo.probe_builder(medium, "full", torch.bfloat16, 0) is None
    # its small size, block 0 of 5 apart: the probe's first block stands for it
    build, lengths = _memo.probe_builder(medium, "small", torch.float32, 0)
    assert lengths == {"transformer_blocks": 5}
    with torch.device("meta"):
        probe = build()
    assert probe.config.dual_attention_layers == (0,) and len(probe.transformer_blocks) == 4
    assert [b.attn2 is not None for b in probe.transformer_blocks] == [True, False, False, False]


@pytest.mark.parametrize(  # one preset per config key name in the fast set ("blocks", "transformer_blocks")
    "preset",
    [
        "wan",
        "ltx-video",
        pytest.param("pixart", marks=pytest.mark.slow),
        pytest.param("dit", marks=pytest.mark.slow),
        pytest.param("sd3.5-medium", marks=pytest.mark.slow),  # a first block apart, marked in the probe's config
    ],
)
def test_a_preset_builds_its_probe_directly(preset, monkeypatch):
    """A preset's probe is built with four blocks per list (not built whole and cut): byte-equal all the same."""
    built = []
    real = _memo.cut

    def spy(model, lengths=None, period=1):
        built.append((lengths, [len(b) for _, _, b in real(model, lengths, period)] if lengths else None))
        return real(model, lengths, period)

    monkeypatch.setattr(_memo, "cut", spy)
    memo, slow = both(preset, size="small")
    monkeypatch.undo()
    assert built and built[0][0] and set(built[0][1]) == {4}
    assert_same(memo, slow)
