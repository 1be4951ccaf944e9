"""The search behind :func:`memkit.planning.plan` (see :mod:`memkit.planning`): the dimensions, the candidates, the
plan, and the step-time ranking."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import gpus

DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "optimizer": ("adamw", "adamw8bit"),
    "quantize": (None, "fp8-storage", "nf4"),
    "ff_split": (None, 4),
    "checkpointing": (None, "all"),
}
"""Each searched dimension's levels, fastest first."""

ALLOC_CONFS = ("", "expandable_segments:True")

# the order dimensions are relaxed in: the one costing the most step time first (recompute of every block's forward,
# a dequantization per weight per use, smaller feed-forward matmuls, an 8-bit optimizer's update on the adapters)
RELAX_ORDER = ("checkpointing", "quantize", "ff_split", "optimizer")


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

    def summary(self) -> dict[str, Any]:
        """The plan as the command line's ``--json`` prints it."""
        return dict(
            gpu=self.gpu.key, gpu_name=self.gpu.name, usable_bytes=list(self.gpu.usable_bytes()),
            configs=[c.summary() for c in self.configs], tried=[c.summary() for c in self.tried],
            estimates=self.estimates, seconds=self.seconds, interrupted=self.interrupted, refused=self.refused,
            unconstrained=self.unconstrained.summary() if self.unconstrained is not None else None,
            untimed=self.untimed,
        )  # fmt: skip


class NothingFits(ValueError):
    """No configuration in the search fits the GPU: the smallest peak found, and what holds it."""


def plan(
    model: str,
    gpu: str | gpus.GPU,
    *,
    lora: int | None = None,
    optimizations: Sequence = (),
    search: Sequence[str] = tuple(DIMENSIONS),
    size: str = "full",
    progress: Callable[[str], None] | None = None,
    step_time: bool = True,
    **estimate_kwargs: Any,
) -> Plan:
    """The fastest configuration of ``model``'s training step that fits ``gpu``, and the others that fit.

    Args:
        model: a preset name (or anything :func:`memkit.estimate` takes).
        gpu: a GPU of :mod:`memkit.gpus` (``"4090"``, ``"h100"``, ``"24GiB"``).
        lora: the LoRA rank, or None for a full fine-tune (the quantize dimension applies to LoRA runs only).
        optimizations: fixed optimizations applied in every configuration (an EMA, a checkpointing the user wants).
            A fixed one takes its dimension out of the search.
        search: the dimensions to search, of :data:`DIMENSIONS` (all by default).
        size, estimate_kwargs: :func:`memkit.estimate`'s (``batch_size``, ``mixed_precision``, ``height``...); the
            estimates are for ``device="cuda"``, the first and the steady step.
        progress: called with a line per estimate.
        step_time: count each estimate's ops as it runs (``estimate(count_ops=True)``, about a fifth more time per
            estimate) and rank the configurations that fit by their step time on ``gpu`` (:mod:`memkit.steptime`'s
            roofline), against the configuration with nothing switched on (estimated too: :attr:`Plan.
            unconstrained`). False, or a GPU without compute figures: ranked by the levels switched on alone.

    Returns a :class:`Plan`. Raises :class:`NothingFits` (a ValueError) when even every dimension at its last level
    does not fit, naming the smallest peak found and the categories holding it. A Ctrl-C during the search returns
    the plan so far (``interrupted`` True).

    Example:
        >>> p = memkit.plan("flux", "4090", lora=16)
        >>> print(p.best.flags, p.best.peak_reserved_bytes / 2**30, p.best.step_seconds)
    """
    from .estimation import estimate
    from .memory.reserved import replay_reserved
    from .optimizations import REGISTRY
    from .units import format_bytes

    t0 = time.perf_counter()
    card = gpu if isinstance(gpu, gpus.GPU) else gpus.find(gpu)
    unknown = [d for d in search if d not in DIMENSIONS]
    if unknown:
        raise ValueError(f"search names {unknown}; the dimensions are {list(DIMENSIONS)}")
    for key in ("device", "optimizer", "alloc_conf", "gpu", "parallel"):
        if key in estimate_kwargs:
            raise ValueError(f"plan searches or fixes {key} itself; leave it out (fixed optimizations go in "
                             "optimizations=)")  # fmt: skip
    fixed = list(optimizations)
    given_lora = [o for o in fixed if type(o).__name__ == "LoRA"]
    if given_lora and lora is not None:
        raise ValueError("give the LoRA either as lora=RANK or among optimizations, not both")
    if given_lora:  # a LoRA with its own settings (alpha, targets): kept as given
        lora_object = given_lora[0]
        fixed = [o for o in fixed if o is not lora_object]
        lora = lora_object.rank
    else:
        lora_object = None
    names = {type(o).__name__ for o in fixed}
    if "FSDP" in names and (set(search) & {"quantize"}) and lora is not None:
        search = [d for d in search if d != "quantize"]  # FSDP refuses a quantized base
    taken = {"Quantize": "quantize", "FFSplit": "ff_split", "Checkpointing": "checkpointing"}
    dims = [d for d in search if d not in {taken[n] for n in names if n in taken}]
    if lora is None:
        if "Quantize" in names:
            raise ValueError("a quantized base trains only adapters: give lora=RANK with a fixed Quantize")
        dims = [d for d in dims if d != "quantize"]
    elif not (isinstance(lora, int) and not isinstance(lora, bool) and lora >= 1):
        raise ValueError(f"lora must be a positive rank or None (a full fine-tune), got {lora!r}")

    def objects(levels: dict[str, Any]) -> tuple:
        out = []
        if levels.get("quantize"):
            out.append(REGISTRY["quantize"].config.parse(levels["quantize"]))
        out += [o for o in fixed if type(o).__name__ == "Quantize"]
        if lora is not None:
            out.append(lora_object if lora_object is not None else REGISTRY["lora"].config(rank=lora))
        out += [o for o in fixed if type(o).__name__ != "Quantize"]
        if levels.get("ff_split"):
            out.append(REGISTRY["ff-split"].config(splits=levels["ff_split"]))
        if levels.get("checkpointing"):
            out.append(REGISTRY["checkpointing"].config.parse(levels["checkpointing"]))
        return tuple(out)

    def flags_of(levels: dict[str, Any], conf: str) -> tuple[str, ...]:
        out: list[str] = []
        if levels.get("optimizer", "adamw") != "adamw":
            out += ["--optimizer", levels["optimizer"]]
        for dim, flag in (("quantize", "--quantize"), ("ff_split", "--ff-split"), ("checkpointing", "--checkpointing")):
            if levels.get(dim):
                out += [flag, str(levels[dim])]
        if conf:
            out += ["--alloc-conf", conf]
        return tuple(out)

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
            v = gpus.verdict(reserved, card)
            cand = Candidate(dict(levels), conf, opts, flags_of(levels, conf), tl.peak_bytes, reserved, v.fits,
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
    interrupted = False
    refused: dict[str, str] = {}
    weight = {d: len(RELAX_ORDER) - i for i, d in enumerate(RELAX_ORDER)}

    def cost(levels: dict[str, Any]) -> tuple[int, tuple]:
        """The search's order of configurations, cheapest in step time first: the levels switched on, checkpointing
        weighing most (a prior; :mod:`memkit.steptime` ranks what fits)."""
        return (sum(weight[d] * DIMENSIONS[d].index(v) for d, v in levels.items()), tuple(map(str, levels.values())))

    try:
        top = {d: DIMENSIONS[d][-1] for d in dims}
        while True:  # a dimension the fixed settings refuse (FFSplit with LoRA in the feed-forward) leaves the search
            try:
                evaluate(top)
                break
            except (ValueError, NotImplementedError) as e:
                culprit = _refusing(top, dims, evaluate)
                if culprit is None:
                    raise
                refused[culprit] = str(e)
                dims = [d for d in dims if d != culprit]
                top = {d: DIMENSIONS[d][-1] for d in dims}
        if not fits(top):
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
        current = dict(top)
        for dim in [d for d in RELAX_ORDER if d in dims]:
            for level in DIMENSIONS[dim][: DIMENSIONS[dim].index(current[dim])]:
                trial = {**current, dim: level}
                if fits(trial):
                    current = trial
                    break
        # certify: every configuration cheaper than the one found, unless a configuration switching on as much or more
        # in every dimension already failed (it cannot fit then), is estimated; the cheapest that fits wins
        for levels in sorted(_levels_grid(dims), key=cost):
            if cost(levels) >= cost(current):
                break
            failed = [cands[0].levels for cands in seen.values() if not any(c.fits for c in cands)]
            if any(_at_most(levels, f) for f in failed):
                continue
            if fits(levels):
                current = levels
        # the fastest of the grid, fitting or not: what every configuration's step time is set against
        unconstrained = evaluate({d: DIMENSIONS[d][0] for d in dims})[0] if timing else None
    except KeyboardInterrupt:
        interrupted, unconstrained = True, None
    fitting = [c for c in tried if c.fits]
    # fastest first (else the fewest levels switched on), then torch's allocator defaults first
    fitting.sort(key=lambda c: (c.step_seconds if timing else 0, cost(c.levels), c.alloc_conf != ""))
    fitting = list(dict((c.flags, c) for c in fitting).values())
    if unconstrained is not None:
        fitting = [dataclasses.replace(c, why=_slower(c, unconstrained)) for c in fitting]
    return Plan(card, fitting, tried, count, time.perf_counter() - t0, interrupted, refused, unconstrained, untimed)


def _refusing(top: dict[str, Any], dims: Sequence[str], evaluate) -> str | None:
    """The dimension whose last level the estimate refuses: the first whose level 0 in ``top`` makes it run."""
    for dim in ("ff_split", "quantize", "checkpointing", "optimizer"):
        if dim in dims and top[dim] != DIMENSIONS[dim][0]:
            try:
                evaluate({**top, dim: DIMENSIONS[dim][0]})
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
    from .units import format_seconds

    """What ``c`` spends beside ``base`` (the configuration with nothing switched on): recompute, bytes moved over the
    host link or disk, and the other device ops' extra seconds with the class most of them are in (elementwise: a
    dequantization's work, a chunked feed-forward's copies; optimizer: an 8-bit update's)."""
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


def _at_most(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a`` switches on no more than ``b`` in every dimension (so it saves no more memory)."""
    return all(DIMENSIONS[d].index(a[d]) <= DIMENSIONS[d].index(b[d]) for d in a)


def _levels_grid(dims: Sequence[str]) -> list[dict[str, Any]]:
    """Every configuration of ``dims`` (the brute force the tests hold the search to)."""
    return [dict(zip(dims, values, strict=True)) for values in itertools.product(*(DIMENSIONS[d] for d in dims))]
