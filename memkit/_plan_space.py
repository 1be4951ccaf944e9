"""The space :func:`memkit.planning.plan` searches: its dimensions and their levels, which levels save at least as
much memory as which (the order the pruning relies on), the pairs that cannot go together, the configurations at the
top of the space, the step-time prior the search orders by, and the optimizations and ``memkit estimate`` flags of a
configuration."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "optimizer": ("adamw", "adamw8bit"),
    "quantize": (None, "fp8-storage", "nf4"),
    "ff_split": (None, 4),
    "checkpointing": (None, "every:2", "all"),
    "offload": (None, "cpu"),
    "ema": ("device", "offload", "cpu_only"),
    "fsdp": (None,),
}
"""Each searched dimension's default levels, fastest first. ``ema`` is searched when an EMA is among the fixed
optimizations (its placement); ``fsdp``'s sharded levels are the divisors of ``gpus`` above 1 (:func:`fsdp_levels`).
``cpu`` offloading stands for ``disk`` too: the GPU holds the same bytes (the host's differ). Checkpointing every 2nd
block is searched between none and every block: it recomputes half the forwards, and it is often what fits fastest
(full Flux LoRA r16 on a 4090: an nf4 base with every 2nd block checkpointed, 3.12 s per step on the card's roofline,
against 3.61 s for the best configuration checkpointing every block); its estimate is memoized like every block's
(:mod:`memkit._memo_period`: a probe of 3N+2 to 4N+1 blocks per list instead of 4, about twice the time)."""

DEFAULT_SEARCH = ("optimizer", "quantize", "ff_split", "checkpointing", "ema", "fsdp")
"""What the plan searches unless told: every dimension but ``offload``. In training the optimizer step onloads every
group, so offloading's peak is no lower than checkpointing every block's, and often higher (full Flux, LoRA r16, every
block checkpointed: 25.13 GiB reserved, 25.57 offloaded; with an nf4 base 9.43 and 11.81; a full fine-tune 111.9
and 113.0): where checkpointing is searched it cannot turn a run that does not fit into one that does, and costs a
full estimate per configuration (~40-90 s for full Flux). It helps a run that keeps checkpointing off or partial (the
same LoRA, nothing checkpointed: 47.6 GiB, 32.9 offloaded): ``search=[..., "offload"]``."""

CATALOGUE: dict[str, tuple[Any, ...]] = {
    **DIMENSIONS,
    "checkpointing": (None, "every:4", "every:2", "all"),
}
"""The levels ``levels=`` may choose from, in order: each saves at least as much as the one before (``every:4``'s
blocks are among ``every:2``'s). ``every:4`` is searched only when asked for: one more level, and more estimates, for
a pattern between none and every 2nd block."""

ALLOC_CONFS = ("", "expandable_segments:True")

# the order dimensions are relaxed in: the one costing the most step time first (every group's weights over PCIe in
# the forward, the backward and the optimizer step, with the changed ones written back; the EMA's shadows over PCIe or
# updated on the CPU; recompute of the checkpointed blocks' forward; a dequantization per weight per use; smaller
# feed-forward matmuls; all-gathers over more GPUs; an 8-bit optimizer's update)
RELAX_ORDER = ("offload", "ema", "checkpointing", "quantize", "ff_split", "fsdp", "optimizer")

WEIGHTS = {"ema": 5.0, "checkpointing": 4.0, "quantize": 3.0, "ff_split": 2.0, "fsdp": 0.5, "optimizer": 1.0}
"""The step-time prior of a level: its dimension's weight times its rank (:func:`rank`). Offload outweighs every
other dimension together: a configuration offloads only when nothing without it fits."""

_CHECKPOINTED = {None: 0.0, "every:4": 0.25, "every:2": 0.5, "all": 1.0}  # the share of blocks recomputed

CONFLICTS: dict[tuple[str, str], str] = {
    ("fsdp", "quantize"): "memkit.FSDP shards each parameter as a plain DTensor, which drops a quantized base's "
    "state (bitsandbytes' quant state, torchao's and layerwise casting's tensors)",
    ("fsdp", "offload"): "memkit.Offload moves whole blocks' parameters on and off the device and memkit.FSDP "
    "replaces them by shards it gathers itself (FSDP's own cpu_offload is the offload that composes with it)",
    ("ff_split", "quantize"): "memkit.FFSplit slices the feed-forward weights themselves, which a quantized base "
    "stores packed",
}
"""Pairs of dimensions that cannot both be switched on, and why; a configuration with both is never estimated."""


def fsdp_levels(gpus: int) -> tuple[int | None, ...]:
    """``fsdp``'s levels for ``gpus`` GPUs: unsharded, then each divisor of ``gpus`` above 1 (FSDP over k of them,
    replicated ``gpus / k`` times).

    Example:
        >>> fsdp_levels(8)
        (None, 2, 4, 8)
    """
    return (None, *(k for k in range(2, gpus + 1) if gpus % k == 0))


def rank(dim: str, level: Any, levels: Sequence[Any]) -> float:
    """How much of ``dim`` a level switches on: checkpointing the share of blocks recomputed, the others the level's
    place in ``levels`` (0: off)."""
    return _CHECKPOINTED[level] if dim == "checkpointing" else float(levels.index(level))


def at_most(a: Mapping[str, Any], b: Mapping[str, Any], space: Mapping[str, Sequence[Any]]) -> bool:
    """Whether ``a`` saves no more memory than ``b`` in every dimension, so that ``a`` cannot fit where ``b`` does
    not (the pruning's premise). A configuration that offloads compares with none: offloading can raise the peak,
    and under it checkpointing more can too (Flux small at 256x256, LoRA r4: every 2nd block checkpointed 84 MiB
    reserved, every block 86). FSDP's sharded levels compare among themselves (shards of 1/k), not with no FSDP,
    whose gathered blocks and buffers can outweigh what 2 shards save (the same Flux: 128 MiB unsharded, 140 over 2
    GPUs)."""
    for d, x in a.items():
        y = b[d]
        if d == "offload":
            if x is not None or y is not None:
                return False
        elif d == "fsdp":
            if x != y and (x is None or y is None or x > y):
                return False
        elif rank(d, x, space[d]) > rank(d, y, space[d]):
            return False
    return True


def conflict(levels: Mapping[str, Any], pinned: Mapping[str, Any] | None = None) -> str | None:
    """Why ``levels`` (beside the fixed settings' ``pinned`` levels) cannot be estimated, or None: two dimensions of
    :data:`CONFLICTS` both on."""
    levels = {**(pinned or {}), **levels}
    for (x, y), why in CONFLICTS.items():
        if levels.get(x) is not None and levels.get(y) is not None:
            return why
    return None


def grid(dims: Sequence[str], space: Mapping[str, Sequence[Any]] = DIMENSIONS) -> list[dict[str, Any]]:
    """Every configuration of ``dims`` (the brute force the tests hold the search to), conflicting ones included."""
    return [dict(zip(dims, values, strict=True)) for values in itertools.product(*(space[d] for d in dims))]


def tops(dims: Sequence[str], space: Mapping[str, Sequence[Any]], pinned=None) -> list[dict[str, Any]]:
    """The configurations no other one saves more than, offloading none (offload's own are searched one by one):
    every configuration that can be estimated and does not offload is :func:`at_most` one of them, so when none of
    them fits nothing without offload does. One per FSDP or not, each conflict settled both ways."""
    paired = {d for pair in CONFLICTS for d in pair}
    choices = []
    for d in dims:
        top = space[d][-1]
        if d == "offload":
            choices.append((None,))
        elif d in paired:
            choices.append(tuple(dict.fromkeys((space[d][0], top))))
        else:
            choices.append((top,))
    found = [dict(zip(dims, v, strict=True)) for v in itertools.product(*choices)]
    found = [c for c in found if conflict(c, pinned) is None]
    return [c for c in found if not any(o != c and at_most(c, o, space) for o in found)]


def objects(levels: Mapping[str, Any], fixed: Sequence, lora: Any) -> tuple:
    """The optimizations of a configuration: the searched levels', the fixed ones (a fixed EMA at the searched
    placement) and the LoRA, in the registry's order (the order ``memkit estimate``'s flags apply them in)."""
    from .optimizations import REGISTRY, spec_of
    from .parallel import FSDP

    out = [o for o in fixed if not (type(o).__name__ == "EMA" and "ema" in levels)]
    if lora is not None:
        out.append(lora)
    for o in fixed:
        if type(o).__name__ == "EMA" and "ema" in levels:
            out.append(dataclasses.replace(o, mode=levels["ema"]))
    parse = {"quantize": "quantize", "checkpointing": "checkpointing", "offload": "offload"}
    for dim, name in parse.items():
        if levels.get(dim) is not None:
            out.append(REGISTRY[name].config.parse(levels[dim]))
    if levels.get("ff_split") is not None:
        out.append(REGISTRY["ff-split"].config(splits=levels["ff_split"]))
    if levels.get("fsdp") is not None:
        out.append(FSDP(world_size=levels["fsdp"]))
    order = list(REGISTRY)
    return tuple(sorted(out, key=lambda o: order.index(spec_of(o).name) if spec_of(o) else len(order)))


def flags_of(levels: Mapping[str, Any], conf: str, fixed: Sequence = ()) -> tuple[str, ...]:
    """The ``memkit estimate`` flags that reproduce a configuration beside the fixed ones; a searched EMA's
    ``--ema`` comes after them and replaces the fixed one's (argparse keeps the last).

    Example:
        >>> flags_of({"optimizer": "adamw8bit", "checkpointing": "all", "fsdp": 4}, "")
        ('--optimizer', 'adamw8bit', '--checkpointing', 'all', '--fsdp', '4')
    """
    out: list[str] = []
    if levels.get("optimizer", "adamw") != "adamw":
        out += ["--optimizer", levels["optimizer"]]
    for dim in ("quantize", "ff_split", "checkpointing", "offload", "fsdp"):
        if levels.get(dim) is not None:
            out += ["--" + dim.replace("_", "-"), str(levels[dim])]
    if "ema" in levels:
        ema = next(o for o in fixed if type(o).__name__ == "EMA")
        out += ["--ema", str(dataclasses.replace(ema, mode=levels["ema"])).removeprefix("ema:")]
    if conf:
        out += ["--alloc-conf", conf]
    return tuple(out)


def parse_levels(dim: str, values: Sequence[Any], gpus: int) -> tuple[Any, ...]:
    """``levels=``'s entry for ``dim`` checked: levels of its catalogue, in the catalogue's order, each once; strings
    as the command line gives them (``"none"``, ``"every:2"``, ``"4"``) name the level they print as.

    Example:
        >>> parse_levels("checkpointing", ["none", "every:2", "all"], gpus=1)
        (None, 'every:2', 'all')
    """
    allowed = fsdp_levels(gpus) if dim == "fsdp" else CATALOGUE[dim]
    named = {("none" if v is None else str(v)): v for v in allowed}
    out = []
    for v in values:
        level = named.get(v, v) if isinstance(v, str) else v
        if level not in allowed or isinstance(level, bool):
            shown = ", ".join(named)
            raise ValueError(f"levels[{dim!r}] names {v!r}; {dim}'s levels are {shown}" + (
                f" (the divisors of gpus={gpus})" if dim == "fsdp" else ""))  # fmt: skip
        out.append(level)
    idx = [allowed.index(v) for v in out]
    if not out or idx != sorted(set(idx)):
        shown = ", ".join("none" if v is None else str(v) for v in allowed)
        raise ValueError(f"levels[{dim!r}] must name one or more of {shown}, each once, in that order (fastest "
                         f"first); got {list(values)!r}")  # fmt: skip
    return tuple(out)
