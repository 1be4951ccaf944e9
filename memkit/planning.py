"""Planning from estimates: which blocks to checkpoint for a memory budget.

It runs :func:`memkit.estimate`, so it sits beside it, above the optimizations it chooses among (it was
``memkit.optimizations.checkpoint_plan``, which still imports, with a deprecation warning). One entry:
:func:`plan_checkpointing`; ``Checkpointing(budget_bytes=...)``, ``estimate(optimizations=[...])`` with such a
config, and ``memkit estimate --checkpointing auto --budget SIZE`` all call it.

Checkpointing more blocks lowers the activations the forward keeps and costs more recompute, so the best pattern for
a budget is the one that checkpoints the fewest blocks while its peak still fits. The solver asks
:func:`memkit.estimate` (fake tensors: nothing is allocated, so it works for a full-size model on a laptop) for the
peak of "k blocks checkpointed, spread evenly" and searches k: ``none`` and ``all`` first, then k where the straight
line between their peaks crosses the budget (each block checkpointed drops about the same bytes) and that k's
neighbour across the budget (twice at most, in the bracket left), which settle the search where the peak falls
evenly with the blocks checkpointed, and a bisection of what is left where it does not: full LTX-Video, 28 blocks, a
16 GiB budget, estimates 16, 15 and 14 after none and all, where bisection estimated 14, 21, 18, 16 and 15; at most
four more than bisection's ``log2(n)``. The peak is taken not to grow when more blocks are checkpointed. A preset's
blocks are counted on a fake copy, so ``none`` and ``all`` are the plain patterns, whose estimates are memoized and
which :func:`memkit.estimate` keeps for the process (asking for them again costs nothing). The estimate is the
tracker's own step on fake tensors, so the prediction is the peak a real step of that model, inputs and step would
reach on ``device``.

The fastest configuration that fits a GPU: :func:`plan`.

The user fixes what they will not change (the model, its size and inputs, the batch, LoRA or a full fine-tune, the
precision); :func:`plan` searches what they may change, each an ordered list of levels from the fastest (nothing
switched on) to the one saving the most memory:

- ``optimizer``: AdamW, then bitsandbytes' 8-bit AdamW (the same maths, one byte per moment);
- ``quantize`` (LoRA runs: the frozen base): none, fp8 storage (diffusers' layerwise casting), nf4 (QLoRA);
- ``ff_split``: none, the feed-forward in 4 sequential chunks;
- ``checkpointing``: none, every 2nd block, every block (``levels=`` adds ``every:4``);
- ``ema`` (with an EMA among the fixed optimizations): its shadows on the device, offloaded, updated on the CPU;
- ``fsdp`` (``gpus=N`` above 1): none, then FSDP over each divisor of N (rank 0's memory);
- ``offload`` (only when ``search`` names it): none, the blocks' weights in CPU memory (disk holds the same GPU bytes);
- ``alloc_conf``: torch's defaults, ``expandable_segments:True`` (the same events replayed: no new estimate).

Each level saves memory and costs time (more recompute, dequantization, smaller kernels, transfers), so the
configurations that fit form an up-set of the grid and the interesting ones are its minimal elements. One exception,
measured: fp8 storage without checkpointing keeps each layer's upcast bf16 weight for the backward and needs more than
no quantization (full Flux LoRA r16: 58.0 GiB reserved against 47.6); the relaxation tries each dimension's lower
levels first, so it meets no quantization before fp8, and the brute-force tests hold the search to the grid.

The search does not walk the grid: it estimates the configurations with every dimension at its last level first (several
where two dimensions do not compose: FSDP with a quantized base or with offloading, the split with a quantized base;
such pairs are never estimated, and a fixed setting that conflicts with a dimension leaves it out, in ``Plan.refused``).
If none fits, nothing does, and the plan says so with the smallest peak found and what holds it. Then it relaxes one
dimension at a time, the most expensive in step time first, to the lowest level that still fits, and certifies that no
cheaper configuration fits, pruning those that switch on no more than one that failed (and, with step times, those
that cannot be faster than the fastest fitting one found: a step-time bound from the configurations estimated, which
switch on no more of quantization, the split or checkpointing). Two dimensions are not a chain,
as measured: FSDP over k GPUs saves more than over fewer but is not compared with no FSDP (Flux small at 256x256, LoRA
r4: 128 MiB reserved unsharded, 140 over 2 GPUs; full Flux LoRA r16, all checkpointed: 25.1, 15.0, 9.2, 6.4 GiB over 1,
2, 4, 8); offloading compares with nothing (in training the optimizer step onloads every group: full Flux LoRA r16 all
checkpointed 25.13 GiB, offloaded 25.57), so it is the last resort: its configurations are estimated one by one,
cheapest first, only where nothing without it fits. Every estimate counts its steady step's ops as it runs
(``estimate(count_ops=True)``), so every configuration estimated that fits is ranked by its step time on the GPU
(:mod:`memkit.steptime`'s roofline, where the GPU has a FLOP/s figure for the step's dtype), and says what it spends
beside the configuration with nothing switched on (estimated too: :attr:`Plan.unconstrained`). ``Plan.frontier()`` keeps
the timed configurations no other beats in both step time and peak reserved bytes; :func:`memkit.plots.plan_figure`
draws them against the GPU's usable bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._maximize import MAXIMIZE, Largest, maximize  # noqa: F401 (memkit.planning's: re-exported)
from ._plan_search import ALLOC_CONFS, DIMENSIONS, Candidate, NothingFits, Plan, _levels_grid, plan  # noqa: F401
from ._plan_space import CATALOGUE, CONFLICTS, DEFAULT_SEARCH, fsdp_levels  # noqa: F401
from .optimizations.checkpointing import Checkpointing


@dataclass(frozen=True)
class CheckpointPlan:
    """The pattern a budget asks for, and what the solver measured to choose it.

    Example:
        >>> plan = memkit.plan_checkpointing("ltx-video", budget_bytes=40 * 2**30, device="cuda")
        >>> plan.config, plan.predicted_peak_bytes / 2**30, plan.fits
    """

    config: Checkpointing
    """The chosen configuration: ``pattern`` is ``"none"``, ``"all"`` or the tuple of block indices."""
    predicted_peak_bytes: int
    """The estimated peak of one step with ``config``."""
    budget_bytes: int
    """The budget asked for."""
    blocks: int
    """How many blocks the model has."""
    checkpointed: int
    """How many of them ``config`` checkpoints."""
    tried: tuple[tuple[int, int], ...]
    """``(blocks checkpointed, estimated peak)`` for every candidate estimated, in the order tried."""

    @property
    def fits(self) -> bool:
        """False when even checkpointing every block does not fit (``config`` is then ``"all"``)."""
        return self.predicted_peak_bytes <= self.budget_bytes

    def __str__(self) -> str:
        from .units import format_bytes

        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"{self.config}: {self.checkpointed} of {self.blocks} blocks checkpointed, predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)}, {verdict} the budget of {format_bytes(self.budget_bytes)}"
        )


def spread(k: int, n: int) -> tuple[int, ...]:
    """``k`` of ``n`` block indices, spread evenly from block 0 (``every:N`` when ``N = n / k`` is whole).

    Example:
        >>> spread(3, 12)
        (0, 4, 8)
    """
    if not 0 <= k <= n:
        raise ValueError(f"k must be between 0 and n={n}, got {k}")
    return tuple(sorted({i * n // k for i in range(k)})) if k else ()


def _config(k: int, n: int, provider: str) -> Checkpointing:
    if k == 0:
        return Checkpointing(pattern="none", provider=provider)
    if k == n:
        return Checkpointing(pattern="all", provider=provider)
    return Checkpointing(pattern=spread(k, n), provider=provider)


def plan_checkpointing(
    model: str | Callable[[], torch.nn.Module],
    budget_bytes: int,
    *,
    provider: str = "torch",
    inputs: Callable[[torch.nn.Module], Mapping[str, Any]] | None = None,
    optimizations: tuple = (),
    **estimate_kwargs: Any,
) -> CheckpointPlan:
    """The pattern with the least recompute whose estimated peak fits ``budget_bytes``.

    ``model``, ``inputs`` and ``estimate_kwargs`` (``size``, ``dtype``, ``device``, ``step`` or ``optimizer``,
    ``batch_size``, image and video sizes...) are :func:`memkit.estimate`'s and describe the step the budget
    is for; ``optimizations`` are applied beside checkpointing in every candidate. A full-size model takes
    ``none``'s and ``all``'s estimates and usually two or three more (at most ``4 + log2(blocks)``), ~10–30 s each.

    Example:
        >>> plan = memkit.plan_checkpointing("flux", 60 * 2**30, dtype=torch.bfloat16, device="cuda")
        >>> print(plan)                      # checkpointing:0,2,4,...: 29 of 57 blocks, predicted peak ...
        >>> memkit.train_step(model, inputs) # after plan.config.apply(model)
    """
    from .estimation import estimate

    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int (bytes), got {budget_bytes!r}")
    Checkpointing(provider=provider)  # validates the provider before any estimate runs
    estimate_kwargs.setdefault("progress", False)
    counted: list[int] = []

    def count(index: int, block: torch.nn.Module) -> bool:
        counted.append(index)
        return False

    peaks: dict[int, int] = {}
    tried: list[tuple[int, int]] = []

    def peak(k: int, config: Checkpointing) -> int:
        if k not in peaks:
            tl = estimate(model, inputs, optimizations=[*optimizations, config], **estimate_kwargs)
            peaks[k] = tl.peak_bytes
            tried.append((k, tl.peak_bytes))
        return peaks[k]

    n = _preset_blocks(model, estimate_kwargs.get("size", "full"))
    if n is None:  # a callable or a config: counted by the pattern itself, in the estimate with no block checkpointed
        peak(0, Checkpointing(pattern=count, provider=provider))
        n = len(set(counted))
    if n == 0:
        raise ValueError("the model has no blocks to checkpoint")
    lo, hi = 0, n  # once none fails and all fits: peak(lo) > budget >= peak(hi); the answer is in (lo, hi]

    def probe(k: int) -> bool:  # estimates k blocks checkpointed; the bracket keeps the side the budget is on
        nonlocal lo, hi
        fits = peak(k, _config(k, n, provider)) <= budget_bytes
        lo, hi = (lo, k) if fits else (k, hi)
        return fits

    if peak(0, _config(0, n, provider)) <= budget_bytes:
        hi = 0
    elif peak(n, _config(n, n, provider)) <= budget_bytes:
        # up to two rounds of a guess where the line through the bracket's two peaks crosses the budget (each
        # checkpointed block drops about the same bytes) and its neighbour across the budget, which settle a peak
        # that falls evenly; bisection for the rest, and at once where a guess and its neighbour have the same peak
        rounds = 2
        while hi - lo > 1:
            if rounds == 0:
                probe((lo + hi) // 2)
                continue
            rounds -= 1
            over, drop = peaks[lo] - budget_bytes, peaks[lo] - peaks[hi]
            guess = min(max(lo + -(-over * (hi - lo) // drop), lo + 1), hi - 1)
            fits = probe(guess)
            if hi - lo > 1:
                near = hi - 1 if fits else lo + 1
                probe(near)
                if peaks[near] == peaks[guess]:
                    rounds = 0
    return CheckpointPlan(
        config=_config(hi, n, provider),
        predicted_peak_bytes=peaks[hi],
        budget_bytes=budget_bytes,
        blocks=n,
        checkpointed=hi,
        tried=tuple(tried),
    )


def _preset_blocks(model, size: str) -> int | None:
    """How many blocks a preset has, counted on a fake copy (nothing allocated); None for anything else."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .blocks import find_blocks
    from .models import load_model
    from .presets import PRESETS

    if not isinstance(model, str) or model not in PRESETS:
        return None
    with FakeTensorMode():
        return len(find_blocks(load_model(model, size=size)))


def _plan_budgets(model_fn, inputs, optimizations, **kwargs):
    """Each ``Checkpointing(budget_bytes=...)`` replaced by the pattern it plans for this very estimate (its
    step, sizes, dtype, device and the other optimizations), before the estimate itself runs."""
    resolved, plans = list(optimizations), []
    for i, o in enumerate(resolved):
        if getattr(o, "budget_bytes", None) is None:
            continue
        others = tuple(x for j, x in enumerate(resolved) if j != i)
        chosen = plan_checkpointing(
            model_fn, o.budget_bytes, provider=o.provider, inputs=inputs, optimizations=others, **kwargs
        )
        resolved[i] = chosen.config
        plans.append(chosen)
    return resolved, plans
