"""Checkpointing patterns: the memory/time frontier on CPU, and diffusers PR #10611's LTX-Video table estimated.

Part 1 (real tensors, CPU, float32, one thread): the ``small`` Flux (6 blocks, 384x384 px) and LTX-Video (8
blocks, 256x256 px, 49 frames) presets, one training step without an optimizer (``memkit.train_step``,
gradients reset before each step), for each pattern (none, every:4, every:2, skip-every:4, all) and provider
(torch, selective). Inputs are larger than the presets' defaults so that activations, not weights and
gradients, set the peak of the plain step. Memory: one tracked step per configuration (``memkit.track``);
peak, its phase and its categories, and the activations alive when backward starts (what checkpointing cuts;
the peak itself can sit at the end of backward, where weights and gradients dominate). Time: every
configuration once per round, in an order rotated each round so none always runs first, after one warm-up
round; the median of the rounds (3), as a ratio to no checkpointing from the same rounds.

Part 2 (fake tensors, ``memkit.estimate(..., device="cuda")``): the full-size LTX-Video transformer (1.9B) in
bfloat16 with PR #10611's setup: batch 1, 512x768 px, 81 frames (11x16x24 latents: 4,224 tokens), 128 text
tokens, forward and backward without an optimizer in a loop (``steps=2``: the gradients of the previous
iteration are alive, as in the PR's timed loop), per pattern, and with provider "offload" (the checkpointed
blocks' inputs in CPU memory; on the CPU frontier it moves nothing, so it is not there). Memory only: no GPU
here, so no it/s.
"""

from __future__ import annotations

import statistics
import time

import torch

import memkit

from . import Section, Table, log, one_thread

TITLE = "checkpointing: memory/time frontier per pattern and provider; PR #10611's LTX-Video table estimated"
MiB, GiB = 2**20, 2**30
CASES = (("flux", {"height": 384, "width": 384}), ("ltx-video", {"frames": 49}))
PATTERNS = ("none", "every:4", "every:2", "skip-every:4", "all")
PROVIDERS = ("torch", "selective")
PR = {  # diffusers PR #10611, LTX-Video on a GPU: torch.cuda.max_memory_reserved() / 2**30 ("GB"), it/s
    "none": (26.719, 1.680),
    "every:4": (22.188, 1.658),
    "every:2": (17.658, 1.539),
    "all": (9.316, 1.358),
}
PR_SIZES = {"height": 512, "width": 768, "frames": 81, "text_len": 128}


def _activation_at_backward_start(tl: memkit.Timeline) -> int:
    phases = tl.column("phase")
    first = int((phases == memkit.PHASES.index("backward")).argmax())
    return tl.bytes_by_category_at(first - 1)["activation"]


def _configs() -> dict[str, memkit.Checkpointing]:
    out = {"none": memkit.Checkpointing(pattern="none")}
    for provider in PROVIDERS:
        for pattern in PATTERNS[1:]:
            config = memkit.Checkpointing(pattern=pattern, provider=provider)
            out[str(config).removeprefix("checkpointing:")] = config
    return out


def _frontier(preset: str, sizes: dict, rounds: int) -> list[dict]:
    model = memkit.load_model(preset, size="small")
    inputs = memkit.make_inputs(model, **sizes)
    configs = _configs()
    n_blocks = len(configs["none"].select(model))

    def step(config: memkit.Checkpointing) -> float:
        model.zero_grad(set_to_none=True)
        with config.apply(model):
            t0 = time.perf_counter()
            memkit.train_step(model, inputs)
            return time.perf_counter() - t0

    memory = {}
    for name, config in configs.items():
        model.zero_grad(set_to_none=True)
        with config.apply(model), memkit.track(model, inputs=inputs) as tl:
            memkit.train_step(model, inputs)
        memory[name] = tl
    log(f"  {preset}: tracked {len(configs)} configurations; {rounds} timed rounds after 1 warm-up")
    names = list(configs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dt = step(configs[name])
            if r:
                times[name].append(dt)
    model.zero_grad(set_to_none=True)
    median = {n: statistics.median(times[n]) for n in names}
    base_tl = memory["none"]
    base_act = _activation_at_backward_start(base_tl)
    rows = []
    for name, config in configs.items():
        tl = memory[name]
        peak = tl.peak_by_category()
        act = _activation_at_backward_start(tl)
        chosen = sum(c for _, c in config.select(model))
        rows.append(
            {
                "preset": f"{preset} small {','.join(f'{k}={v}' for k, v in sizes.items())}",
                "pattern": config.pattern,
                "provider": config.provider if chosen else "-",
                "blocks": f"{chosen}/{n_blocks}",
                "peak MiB": tl.peak_bytes / MiB,
                "peak / none": tl.peak_bytes / base_tl.peak_bytes,
                "peak phase": tl.peak_phase,
                "activation at peak MiB": peak["activation"] / MiB,
                "gradient at peak MiB": peak["gradient"] / MiB,
                "parameter MiB": peak["parameter"] / MiB,
                "activation at backward start MiB": act / MiB,
                "activation at backward start / none": act / base_act,
                "step s (median)": median[name],
                "time / none": median[name] / median["none"],
            }
        )
    return rows


def _pr_rows(patterns: tuple[str, ...]) -> list[dict]:
    rows = []
    base = None
    for name in patterns:
        config = memkit.Checkpointing.parse(name)
        tl = memkit.estimate(
            "ltx-video",
            size="full",
            dtype=torch.bfloat16,
            device="cuda",
            optimizer=None,  # forward and backward in a loop, as in the PR's table
            steps=2,
            optimizations=[config],
            progress=False,
            **PR_SIZES,
        )
        base = base or tl.peak_bytes
        peak = tl.peak_by_category()
        pr_gb, pr_its = PR.get(name, (float("nan"), float("nan")))  # the PR measured provider torch only
        rows.append(
            {
                "pattern": name,
                "PR GB (reserved)": pr_gb,
                "PR it/s": pr_its,
                "memkit GiB (allocated)": tl.peak_bytes / GiB,
                "Δ vs PR": f"{tl.peak_bytes / GiB / pr_gb - 1:+.1%}" if name in PR else "-",
                "PR / PR none": pr_gb / PR["none"][0] if name in PR else float("nan"),
                "memkit / memkit none": tl.peak_bytes / base,
                "activation at peak GiB": peak["activation"] / GiB,
                "parameter + gradient GiB": (peak["parameter"] + peak["gradient"]) / GiB,
                "in CPU memory GiB": tl.meta["host_bytes"].get("activation", 0) / GiB,
                "peak phase": tl.peak_phase,
                "estimate s": tl.meta["seconds"],
            }
        )
        log(f"  full ltx-video {name}: {tl.peak_bytes / GiB:.2f} GiB in {tl.meta['seconds']:.0f} s")
    return rows


def _notes(frontier: list[dict], pr: list[dict]) -> list[str]:
    notes = []
    for preset, _ in CASES:
        mine = [r for r in frontier if r["preset"].startswith(preset) and r["provider"] in ("-", "torch")]
        acts = [r["activation at backward start MiB"] for r in mine]
        ordered = acts == sorted(acts, reverse=True)
        notes.append(
            f"{preset}: activations at backward start ordered none > every:4 > every:2 > skip-every:4 > all "
            f"(provider torch): {'yes' if ordered else 'NO'}; all keeps {acts[-1] / acts[0]:.0%} of none's."
        )
    full = {r["pattern"]: r for r in pr}
    worst = max(abs(r["memkit GiB (allocated)"] / r["PR GB (reserved)"] - 1) for r in pr if r["pattern"] in PR)
    if "all@offload" in full:
        off, on = full["all@offload"], full["all"]
        notes.append(
            f"all@offload: {off['memkit GiB (allocated)']:.2f} GiB on the GPU against all's "
            f"{on['memkit GiB (allocated)']:.2f} GiB; the blocks' inputs wait in CPU memory "
            f"({off['in CPU memory GiB']:.2f} GiB there at most), for one host round trip of them per step "
            "(not timed: no GPU here)."
        )
    notes.append(
        f"Full-size LTX-Video: worst |Δ| against the PR's GPU measurements {worst:.1%}; memkit estimates allocated "
        "bytes (what torch.cuda.max_memory_allocated reports), the PR printed max_memory_reserved (allocated plus "
        "the caching allocator's free cached blocks), so the estimate should sit below it."
    )
    if "every:2" in full:
        pr_share = (PR["none"][0] - PR["every:2"][0]) / (PR["none"][0] - PR["all"][0])
        ours = (full["none"]["memkit GiB (allocated)"] - full["every:2"]["memkit GiB (allocated)"]) / (
            full["none"]["memkit GiB (allocated)"] - full["all"]["memkit GiB (allocated)"]
        )
        notes.append(
            f"every:2 saves {ours:.0%} of what all saves in the estimate, {pr_share:.0%} in the PR "
            "(half of the 28 blocks checkpointed: the saving is linear in the share of blocks)."
        )
    notes.append(
        "What differs from the PR: random weights (same shapes and dtype); an all-ones float encoder_attention_mask "
        "(the PR's was random booleans); memkit's loss mean(out.float()**2) (the PR's out.mean()); "
        "rope_interpolation_scale passed as LTXPipeline does; attention kernels and cuBLAS workspaces as the "
        "estimator models them on fake CPU tensors, not the CUDA SDPA backend the GPU picked."
    )
    notes.append(
        "CPU step times on a shared 2-core machine (see the load average): ratios within about ±10% of each other "
        "are noise; torch's recompute costs about one extra forward of the checkpointed blocks."
    )
    return notes


def run(quick: bool = False) -> Section:
    with one_thread():
        full = ("none", "every:4", "every:2", "skip-every:4", "all", "every:2@offload", "all@offload")
        pr = _pr_rows(("none", "all", "all@offload") if quick else full)
        frontier = []
        for preset, sizes in CASES:
            frontier += _frontier(preset, sizes, rounds=1 if quick else 3)
    notes = _notes(frontier, pr)
    return Section(
        name="checkpointing",
        title=TITLE,
        text=__doc__.split("\n", 1)[1],
        tables=[
            Table("Frontier on CPU (real tensors, float32, one thread, no optimizer)", frontier),
            Table(
                "Full-size LTX-Video, PR #10611's setup (bf16, 512x768, 81 frames, batch 1), memkit.estimate "
                "device='cuda', beside the PR's GPU measurements",
                pr,
            ),
        ],
        notes=notes,
    )
