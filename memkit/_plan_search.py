"""The search behind :func:`memkit.planning.plan` (see :mod:`memkit.planning`): the dimensions, the candidates, the
plan, and the step-time ranking."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import gpus
from ._plan_fastest import _time_bound, fastest_fitting
from ._plan_fastest import fastest as _fastest
from ._plan_space import (
    ALLOC_CONFS,
    CONFLICTS,
    DEFAULT_SEARCH,
    DIMENSIONS,
    RELAX_ORDER,
    WEIGHTS,
    at_most,
    conflict,
    flags_of,
    fsdp_levels,
    parse_levels,
    rank,
    tops,
)
from ._plan_space import grid as _levels_grid
from ._plan_space import objects as _objects


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration the plan estimated.

    Example:
        >>> c = memkit.plan("flux", "4090", lora=16).best
        >>> c.flags, c.peak_reserved_bytes / 2**30, c.fits, c.step_seconds
    """

    levels: dict[str, Any]
    """Each searched dimension's setting (``None``: off)."""
    alloc_conf: str
    optimizations: tuple
    """The optimization objects of the configuration (the fixed ones first)."""
    flags: tuple[str, ...]
    """The ``memkit estimate`` flags that reproduce it, beside the fixed ones the plan was given."""
    peak_bytes: int
    """Peak allocated bytes of the larger of the first and the steady step (device cuda)."""
    peak_reserved_bytes: int
    """Peak reserved bytes under ``alloc_conf``: what the GPU must hold."""
    fits: bool
    headroom_bytes: int
    step_seconds: float | None = None
    """Estimated seconds per step on the GPU, from the estimate's own ops (:mod:`memkit.steptime`; None where the GPU
    has no compute figures, or with ``step_time=False``)."""
    why: str = ""
    """Why it is slower than the fastest configuration of the grid (:attr:`Plan.unconstrained`), where it is."""
    step_time: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The :class:`memkit.steptime.StepTime` behind ``step_seconds`` (where the seconds go), or None."""

    def summary(self) -> dict[str, Any]:
        return dict(
            flags=list(self.flags), peak_bytes=self.peak_bytes, peak_reserved_bytes=self.peak_reserved_bytes,
            fits=self.fits, headroom_bytes=self.headroom_bytes, step_seconds=self.step_seconds, why=self.why,
            settings={k: v for k, v in self.levels.items()} | {"alloc_conf": self.alloc_conf},
        )  # fmt: skip


@dataclasses.dataclass
class Plan:
    """What :func:`plan` found: the configurations that fit, fastest first, and every one it estimated.

    Example:
        >>> p = memkit.plan("flux", "4090", lora=16)
        >>> p.best.flags, p.estimates, len(p.configs)
    """

    gpu: gpus.GPU
    configs: list[Candidate]
    """The configurations that fit, fastest first (by estimated step time, else by the levels switched on)."""
    tried: list[Candidate]
    """Every configuration estimated, in the order tried."""
    estimates: int
    """How many estimates the search ran (the allocator settings replayed, not re-estimated)."""
    seconds: float
    interrupted: bool = False
    """True when the search was stopped (Ctrl-C): ``configs`` holds what it found so far."""
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    """Dimensions left out of the search because the fixed settings refuse them, with the refusal."""
    unconstrained: Candidate | None = None
    """The configuration with nothing switched on (the fastest of the grid), fitting or not, where step times were
    estimated: each configuration's ``why`` says what it costs beside it."""
    untimed: str = ""
    """Why the configurations have no step time ("" where they have one): ``step_time=False``, or a GPU without a
    FLOP/s figure for the step's dtype (a T4 has no bf16)."""

    @property
    def best(self) -> Candidate | None:
        return self.configs[0] if self.configs else None

    @property
    def timed(self) -> list[Candidate]:
        """Every configuration estimated that has a step time, fitting or not, in the order tried (a timed entry of
        ``configs`` in place of its untimed one in ``tried``).

        Example:
            >>> p = memkit.plan("flux", "4090", lora=16)
            >>> [(c.flags, c.step_seconds) for c in p.timed]
        """
        timed = {c.flags: c for c in self.configs if c.step_seconds is not None}
        return [c for c in (timed.get(c.flags, c) for c in self.tried) if c.step_seconds is not None]

    def frontier(self) -> list[Candidate]:
        """The timed configurations (:attr:`timed`, fitting or not) that no other beats in both step time and peak
        reserved bytes (one beats another when it is no slower and no larger, and better in one), fastest first.

        The trade-off the plan chooses on: along it each configuration saves memory only by costing time. The GPU's
        usable bytes cut it; with every configuration timed, the fastest frontier one under the cut is as fast as the
        plan's ``best``. Configurations with the same time and bytes (the same levels, whose allocator settings
        reserve alike) are all kept.

        Raises a ValueError when no configuration has a step time (``step_time=False``, or a GPU without a FLOP/s
        figure for the step's dtype: :attr:`untimed` says which).

        Example:
            >>> p = memkit.plan("flux", "4090", lora=16)
            >>> [(c.flags, c.step_seconds, c.peak_reserved_bytes / 2**30) for c in p.frontier()]
        """
        timed = self.timed
        if not timed:
            raise ValueError(f"the plan has no configuration with a step time ({self.untimed or 'none timed'}): "
                             + _NO_STEP_TIMES)  # fmt: skip
        return _frontier(timed)

    def summary(self) -> dict[str, Any]:
        """The plan as the command line's ``--json`` prints it."""
        return dict(
            gpu=self.gpu.key, gpu_name=self.gpu.name, usable_bytes=list(self.gpu.usable_bytes()),
            configs=[c.summary() for c in self.configs], tried=[c.summary() for c in self.tried],
            estimates=self.estimates, seconds=self.seconds, interrupted=self.interrupted, refused=self.refused,
            unconstrained=self.unconstrained.summary() if self.unconstrained is not None else None,
            untimed=self.untimed,
        )  # fmt: skip


_NO_STEP_TIMES = (
    "plan with step_time=True (the default; memkit plan without --no-time) for a GPU with a FLOP/s figure for the "
    "step's dtype (memkit.gpus)"
)


def _frontier(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other beats in both ``step_seconds`` and ``peak_reserved_bytes``, fastest first: one sweep
    in (time, bytes) order, keeping each (time, bytes) whose bytes are below every faster or equally fast one's."""
    ordered = sorted(candidates, key=lambda c: (c.step_seconds, c.peak_reserved_bytes))
    out: list[Candidate] = []
    least = None  # the fewest bytes of the (time, bytes) pairs before the current one
    for (_, reserved), same in itertools.groupby(ordered, key=lambda c: (c.step_seconds, c.peak_reserved_bytes)):
        if least is None or reserved < least:
            out += same
            least = reserved
    return out


class NothingFits(ValueError):
    """No configuration in the search fits the GPU: the smallest peak found, and what holds it."""


def plan(
    model: str,
    gpu: str | gpus.GPU,
    *,
    lora: int | None = None,
    optimizations: Sequence = (),
    search: Sequence[str] | None = None,
    levels: Mapping[str, Sequence[Any]] | None = None,
    gpus: int = 1,
    size: str = "full",
    progress: Callable[[str], None] | None = None,
    step_time: bool = True,
    **estimate_kwargs: Any,
) -> Plan:
    """The fastest configuration of ``model``'s training step that fits ``gpu``, and the others that fit.

    Args:
        model: a preset name (or anything :func:`memkit.estimate` takes).
        gpu: a GPU of :mod:`memkit.gpus` (``"4090"``, ``"h100"``, ``"24GiB"``), each of the ``gpus``.
        lora: the LoRA rank, or None for a full fine-tune (the quantize dimension applies to LoRA runs only).
        optimizations: fixed optimizations applied in every configuration (an EMA, a checkpointing the user wants).
            A fixed one takes its dimension out of the search, but for an EMA, whose placement (``mode``) is then
            searched (leave ``"ema"`` out of ``search`` to keep the one given). A fixed setting that conflicts with
            a dimension (an Offload or a Quantize with FSDP's) leaves that dimension out, in ``Plan.refused``.
        search: the dimensions to search, of :data:`DIMENSIONS`; None: those of :data:`DEFAULT_SEARCH` that apply
            (``quantize`` with LoRA, ``ema`` with a fixed EMA, ``fsdp`` with ``gpus`` > 1): ``offload`` only when
            named (it cannot beat checkpointing every block; see :data:`DEFAULT_SEARCH`).
        levels: a dimension's levels instead of its default ones, fastest first, of those :data:`CATALOGUE` lists
            (``{"checkpointing": (None, "every:4", "every:2", "all")}``: every 4th block too).
        gpus: the GPUs the run has: above 1, ``fsdp`` searches sharding over each divisor of it (rank 0's memory;
            replicated over the rest).
        size, estimate_kwargs: :func:`memkit.estimate`'s (``batch_size``, ``mixed_precision``, ``height``...); the
            estimates are for ``device="cuda"``, the first and the steady step.
        progress: called with a line per estimate.
        step_time: count each estimate's ops as it runs (``estimate(count_ops=True)``, about a fifth more time per
            estimate) and rank the configurations that fit by their step time on ``gpu`` (:mod:`memkit.steptime`'s
            roofline), against the configuration with nothing switched on (estimated too: :attr:`Plan.
            unconstrained`). False, or a GPU without compute figures: ranked by the levels switched on alone.

    Returns a :class:`Plan`. Raises :class:`NothingFits` (a ValueError) when none of the configurations at the top of
    the space fits (every dimension at its last level; FSDP or not, conflicts settled both ways) nor, where offload
    is searched, any offloading one, naming the smallest peak found and the categories holding it. A Ctrl-C during
    the search returns the plan so far (``interrupted`` True).

    Example:
        >>> p = memkit.plan("flux", "4090", lora=16)
        >>> print(p.best.flags, p.best.peak_reserved_bytes / 2**30, p.best.step_seconds)
        >>> memkit.plan("flux", "h100", gpus=8, optimizations=[memkit.EMA()]).best.flags  # FSDP's degree, EMA's mode
    """
    from . import gpus as gpus_module  # the argument gpus is the count
    from .estimation import estimate
    from .memory.reserved import replay_reserved
    from .optimizations import REGISTRY
    from .units import format_bytes

    t0 = time.perf_counter()
    card = gpus_module.find(gpu)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an int >= 1 (the GPUs the run has), got {gpus!r}")
    explicit = search is not None
    search = list(DEFAULT_SEARCH) if search is None else list(search)
    unknown = [d for d in search if d not in DIMENSIONS]
    if unknown:
        raise ValueError(f"search names {unknown}; the dimensions are {list(DIMENSIONS)}")
    for key in ("device", "optimizer", "alloc_conf", "gpu", "parallel"):
        if key in estimate_kwargs:
            raise ValueError(f"plan searches or fixes {key} itself; leave it out (fixed optimizations go in "
                             "optimizations=)")  # fmt: skip
    space = {**DIMENSIONS, "fsdp": fsdp_levels(gpus)}
    for dim, given in (levels or {}).items():
        if dim not in DIMENSIONS:
            raise ValueError(f"levels names {dim!r}; the dimensions are {list(DIMENSIONS)}")
        space[dim] = parse_levels(dim, given, gpus)
    fixed = list(optimizations)
    given_lora = [o for o in fixed if type(o).__name__ == "LoRA"]
    if given_lora and lora is not None:
        raise ValueError("give the LoRA either as lora=RANK or among optimizations, not both")
    if given_lora:  # a LoRA with its own settings (alpha, targets): kept as given
        lora_object = given_lora[0]
        fixed = [o for o in fixed if o is not lora_object]
        lora = lora_object.rank
    elif lora is not None and not (isinstance(lora, int) and not isinstance(lora, bool) and lora >= 1):
        raise ValueError(f"lora must be a positive rank or None (a full fine-tune), got {lora!r}")
    else:
        lora_object = REGISTRY["lora"].config(rank=lora) if lora is not None else None
    names = {type(o).__name__ for o in fixed}
    sharded = [o for o in fixed if type(o).__name__ == "FSDP"]
    if sharded and gpus > 1 and gpus % sharded[0].world_size:
        raise ValueError(f"the fixed {sharded[0]} shards over {sharded[0].world_size} GPUs, which does not divide "
                         f"gpus={gpus}")  # fmt: skip
    if lora is None and "Quantize" in names:
        raise ValueError("a quantized base trains only adapters: give lora=RANK with a fixed Quantize")
    needs = {"quantize": (lora is not None, "lora=RANK (a quantized base trains only adapters)"),
             "ema": ("EMA" in names, "an EMA among optimizations (the plan searches its placement)"),
             "fsdp": (gpus > 1, "gpus=N above 1 (the sharding is over them)")}  # fmt: skip
    for dim, (ok, what) in needs.items():
        if dim in search and not ok:
            if explicit:
                raise ValueError(f"search names {dim!r}, which needs {what}")
            search.remove(dim)
    taken = {"Quantize": "quantize", "FFSplit": "ff_split", "Checkpointing": "checkpointing", "Offload": "offload",
             "FSDP": "fsdp"}  # fmt: skip
    fixed_dims = {taken[n]: o for o in fixed if (n := type(o).__name__) in taken}
    dims = [d for d in search if d not in fixed_dims]
    refused: dict[str, str] = {}
    for (x, y), why in CONFLICTS.items():  # a fixed setting that conflicts with a dimension leaves it out, named
        for dim, other in ((x, y), (y, x)):
            if dim in dims and other in fixed_dims:
                refused[dim] = f"{why}: it conflicts with the fixed {fixed_dims[other]}"
                dims.remove(dim)
    ema = next((o for o in fixed if type(o).__name__ == "EMA"), None)
    pinned = {"fsdp": fixed_dims["fsdp"].world_size} if "fsdp" in fixed_dims else {}
    if ema is not None and "ema" not in dims:
        pinned["ema"] = ema.mode

    def objects(levels: dict[str, Any]) -> tuple:
        return _objects(levels, fixed, lora_object)

    tried: list[Candidate] = []
    seen: dict[tuple, list[Candidate]] = {}
    count = 0

    def evaluate(levels: dict[str, Any]) -> list[Candidate]:
        nonlocal count
        key = tuple(levels.get(d) for d in DIMENSIONS)
        if key in seen:
            return seen[key]
        if progress is not None:
            progress(f"estimating {dict((k, v) for k, v in levels.items() if v) or 'nothing switched on'}")
        opts = objects(levels)
        # counted whenever step times are asked for, even where this GPU cannot time them: a plan for another GPU
        # reuses the estimate (its cached copy carries the counts)
        tl = estimate(model, size=size, optimizations=list(opts), optimizer=levels.get("optimizer", "adamw"),
                      device="cuda", progress=False, count_ops=step_time, **estimate_kwargs)  # fmt: skip
        count += 1
        timed = _step_time(tl, card, estimate_kwargs) if timing else None
        found = []
        for conf in ALLOC_CONFS:
            if conf == "":
                reserved = tl.peak_reserved_bytes
            else:  # the same events through another allocator: no new estimate
                reserved = replay_reserved(tl, baseline_blocks=tl.baseline_blocks or (), alloc_conf=conf).peak_bytes
            v = gpus_module.verdict(reserved, card)
            cand = Candidate(dict(levels), conf, opts, flags_of(levels, conf, fixed), tl.peak_bytes, reserved, v.fits,
                             v.headroom_bytes, timed and timed.seconds, step_time=timed)  # fmt: skip
            found.append(cand)
            tried.append(cand)
        seen[key] = found
        return found

    def fits(levels: dict[str, Any]) -> bool:
        return any(c.fits for c in evaluate(levels))

    flops = getattr(card, "flops", None)
    kind = _matmul_dtype(estimate_kwargs)
    untimed = (
        "step_time=False" if not step_time
        else f"{card.name} has no compute figures in memkit.gpus" if flops is None
        else f"{card.name} has no {kind} FLOP/s figure ({', '.join(sorted(flops))} only): a {kind} step's time on it "
        "is not modelled" if kind not in flops
        else ""
    )  # fmt: skip
    timing = not untimed

    def failed_above(levels: dict[str, Any]) -> bool:
        """Whether a configuration saving as much or more in every dimension already failed (so this one cannot fit)."""
        return any(at_most(levels, cands[0].levels, space) for cands in seen.values() if not any(c.fits for c in cands))

    interrupted = False
    weight = dict(WEIGHTS)
    weight["offload"] = 1 + sum(weight[d] * rank(d, space[d][-1], space[d]) for d in dims if d != "offload")

    def cost(levels: dict[str, Any]) -> tuple[float, tuple]:
        """The search's order of configurations, cheapest in step time first: the levels switched on, weighed by
        :data:`WEIGHTS` (a prior; :mod:`memkit.steptime` ranks what fits)."""
        return (sum(weight[d] * rank(d, v, space[d]) for d, v in levels.items()), tuple(map(str, levels.values())))

    try:
        current = None
        while True:
            try:
                current = _first_fit(dims, space, cost, fits, pinned)
                break
            except _Refused as refusal:  # the fixed settings refuse a dimension: it leaves the search
                error, levels = refusal.args
                culprit = _refusing(levels, dims, evaluate, space)
                if culprit is None:
                    raise error from None
                refused[culprit] = str(error)
                dims.remove(culprit)
        if current is None:
            smallest = min(tried, key=lambda c: c.peak_reserved_bytes)
            tl = estimate(model, size=size, optimizations=list(smallest.optimizations),
                          optimizer=smallest.levels.get("optimizer", "adamw"), device="cuda", progress=False,
                          **estimate_kwargs)  # fmt: skip
            held = sorted(tl.peak_by_category().items(), key=lambda kv: -kv[1])[:3]
            what = ", ".join(f"{c} {format_bytes(v)}" for c, v in held if v)
            raise NothingFits(
                f"no configuration fits {card.name} ({format_bytes(card.usable_bytes()[0])} usable): the smallest "
                f"peak found is {format_bytes(smallest.peak_reserved_bytes)} reserved with "
                f"{' '.join(smallest.flags) or 'nothing switched on'} (at its peak: {what})"
            )
        for dim in [d for d in RELAX_ORDER if d in dims]:
            for level in space[dim][: space[dim].index(current[dim])]:
                trial = {**current, dim: level}
                if conflict(trial, pinned) is None and not failed_above(trial) and fits(trial):
                    current = trial
                    break
        # the fastest of the grid, fitting or not: what every configuration's step time is set against
        unconstrained = evaluate({d: space[d][0] for d in dims})[0] if timing else None
        # certify: every configuration cheaper than the one found is estimated, unless it conflicts or one saving as
        # much or more already failed; the cheapest that fits wins. Timed, the answer is the fastest that fits, so a
        # configuration whose step time cannot beat the fastest fitting one found (memkit._plan_fastest's bound) is
        # not estimated either (full Flux LoRA r16 on a 4090: 8-bit AdamW, fp8 storage, every block checkpointed)
        for levels in sorted(_levels_grid(dims, space), key=cost):
            if cost(levels) >= cost(current):
                break
            if conflict(levels, pinned) is not None or failed_above(levels):
                continue
            if timing and _time_bound(levels, seen, space) >= fastest_fitting(tried):
                continue
            if fits(levels):
                current = levels
        if timing:  # the prior's cheapest that fits need not be the fastest: the grid's fastest that fits is
            _fastest(sorted(_levels_grid(dims, space), key=cost), space, pinned, seen, tried, evaluate, failed_above)
    except KeyboardInterrupt:
        interrupted, unconstrained = True, None
    fitting = [c for c in tried if c.fits]
    # fastest first (else the fewest levels switched on), then torch's allocator defaults first
    fitting.sort(key=lambda c: (c.step_seconds if timing else 0, cost(c.levels), c.alloc_conf != ""))
    fitting = list(dict((c.flags, c) for c in fitting).values())
    if unconstrained is not None:
        fitting = [dataclasses.replace(c, why=_slower(c, unconstrained)) for c in fitting]
    return Plan(card, fitting, tried, count, time.perf_counter() - t0, interrupted, refused, unconstrained, untimed)


class _Refused(Exception):
    """An estimate raised: ``args`` are the error and the configuration."""


def _first_fit(dims, space, cost, fits, pinned) -> dict[str, Any] | None:
    """A configuration that fits: the cheapest of the :func:`tops` that fits, else the cheapest offloading one that
    fits (offloading is not monotone: each is estimated, in cost order), else None (nothing fits)."""
    off = "offload" in dims
    candidates = []
    if not off or None in space["offload"]:
        candidates += sorted(tops(dims, {**space, "offload": (None,)} if off else space, pinned), key=cost)
    if off:
        grid = sorted(_levels_grid(dims, space), key=cost)
        candidates += [c for c in grid if c["offload"] is not None and conflict(c, pinned) is None]
    for levels in candidates:
        try:
            if fits(levels):
                return levels
        except (ValueError, NotImplementedError) as e:
            raise _Refused(e, levels) from e
    return None


def _refusing(top: dict[str, Any], dims: Sequence[str], evaluate, space) -> str | None:
    """The dimension whose level in ``top`` the estimate refuses: the first whose first level makes it run."""
    for dim in ("ff_split", "quantize", "offload", "fsdp", "checkpointing", "ema", "optimizer"):
        if dim in dims and top[dim] != space[dim][0]:
            try:
                evaluate({**top, dim: space[dim][0]})
            except (ValueError, NotImplementedError):
                continue
            return dim
    return None


def _matmul_dtype(estimate_kwargs) -> str:
    """The roofline's dtype for the step's matmuls: the mixed-precision one, else the step's dtype (bf16 default)."""
    dtype = str(estimate_kwargs.get("dtype") or "").replace("torch.", "")
    return estimate_kwargs.get("mixed_precision") or {"float16": "fp16", "float32": "tf32"}.get(dtype, "bf16")


def _step_time(tl, card, estimate_kwargs):
    """The roofline time on ``card`` of the ops the estimate ``tl`` counted, at the step's matmul dtype."""
    from . import steptime

    return steptime.step_seconds(tl.op_counts, card, dtype=_matmul_dtype(estimate_kwargs))


def _slower(c: Candidate, base: Candidate) -> str:
    """What ``c`` spends beside ``base`` (the configuration with nothing switched on): recompute, bytes moved over the
    host link or disk, and the other device ops' extra seconds with the class most of them are in (elementwise: a
    dequantization's work, a chunked feed-forward's copies; optimizer: an 8-bit update's)."""
    from .units import format_seconds

    if c.step_time is None or base.step_time is None or c.step_seconds <= base.step_seconds:
        return ""
    t, b = c.step_time, base.step_time
    parts = []
    if t.recompute_seconds > b.recompute_seconds:
        parts.append(f"{format_seconds(t.recompute_seconds - b.recompute_seconds)} recomputing checkpointed forwards")
    if t.transfer_seconds > b.transfer_seconds:
        moved = format_seconds(t.transfer_seconds - b.transfer_seconds)
        parts.append(f"{moved} moving bytes over the host link or disk")
    device = (t.compute_bound_seconds + t.memory_bound_seconds - t.recompute_seconds) - (
        b.compute_bound_seconds + b.memory_bound_seconds - b.recompute_seconds
    )
    if device > 0.005 * base.step_seconds:
        kinds = ("matmul", "attention", "conv", "elementwise", "optimizer")
        first = {k: t.by_class[k] - t.recompute_by_class[k] - b.by_class[k] + b.recompute_by_class[k] for k in kinds}
        lead = max(kinds, key=first.__getitem__)
        parts.append(f"{format_seconds(device)} more in the other device ops (most in {lead})")
    ratio = c.step_seconds / base.step_seconds
    return f"{ratio:.2f}x the step with nothing switched on: " + ("; ".join(parts) or "the same ops, reordered")
