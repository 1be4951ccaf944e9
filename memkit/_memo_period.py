"""Checkpointing some blocks and not others in block memoization (see :mod:`memkit._memo`): a probe whose middle
repeats a period of blocks.

A block's events depend on its own checkpointing and on its neighbours' (the loop's code between two blocks, the
next block's checkpoint bookkeeping included, is the block before's; a block keeps its input for the backward as
its neighbour made it). With ``"every:N"`` (or ``"skip-every:N"``) the blocks of each list repeat with period N, so
the full list is its first block, periods of N blocks, and its last ones; the probe keeps the first block and two
periods, then a period and the last blocks (:func:`memkit._memo.probe_length`: ``3N + 2`` to ``4N + 1`` blocks, as
many as keep the full model's phase), each checkpointed as the full block it is (:func:`probe_optimizations`). Every
middle block of the full model then has a probe block of its own phase whose neighbours on both sides are
checkpointed as its own are: the forward repeats the period after the first two, the backward (going down) the
second period, whose block before (the period after it) is a middle one too (:mod:`memkit._splice`). The first
period is the full model's own: it holds the lowest block of each kind, where the backward frees what every block
of that kind keeps (the input all blocks share, kept by each checkpointed block until its recompute: with
``"skip-every:2"`` the second block frees it, and a probe repeating the first period would free it in every
middle block; the splice refuses that, :class:`memkit._memo.Unsupported`).

Why a period and not one probe block per kind (checkpointed, not): with ``"every:3"`` a block not checkpointed has
either a checkpointed block before it or one after it, and their events differ; the period holds every neighbourhood
the full model has, in its own order, so the splice repeats consecutive probe blocks as they ran. A pattern whose
blocks repeat with no period (a tuple, as the planner's ``spread`` and ``budget_bytes`` make; a callable; ``first:K``
and ``last:K``, one change of kind) runs every block, and :func:`why_not_periodic` says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from ._memo import PROBE, Unsupported, head


def period_of(checkpointing: Any) -> int | None:
    """The period a :class:`memkit.Checkpointing`'s pattern repeats with: 1 for ``"all"`` and ``"none"``, N for
    ``"every:N"`` and ``"skip-every:N"``; None for any other (its blocks repeat in no period)."""
    pattern = checkpointing.pattern
    if checkpointing.budget_bytes is not None or not isinstance(pattern, str):
        return None
    if pattern in ("all", "none"):
        return 1
    form, _, k = pattern.partition(":")
    return int(k) if form in ("every", "skip-every") else None


def why_not_periodic(checkpointing: Any) -> str:
    """Why a :class:`memkit.Checkpointing` whose :func:`period_of` is None runs every block."""
    pattern = checkpointing.pattern
    if checkpointing.budget_bytes is not None:
        why = "budget_bytes plans a tuple of blocks by estimating"
    elif callable(pattern):
        why = "a callable chooses each block by itself"
    elif isinstance(pattern, str):
        why = f"{pattern.partition(':')[0]}:K checkpoints one run of blocks, the block where it ends in no period"
    else:
        why = "a tuple of blocks (the planner's spread) repeats no group of blocks"
    return (
        f"{checkpointing} checkpoints some blocks and not others in no repeating period (memoized: 'all', 'none', "
        f"'every:N', 'skip-every:N'): {why}"
    )


def no_list(period: int) -> str:
    """Why a model with no list longer than its probe is not memoized."""
    if period == 1:
        return f"the model has no list of more than {PROBE} blocks whose middle blocks are identical"
    shortest, longest = head(period) + period + 1, head(period) + 2 * period
    return (
        f"the model has no list of identical blocks longer than its probe for a checkpointing period of {period} "
        f"({shortest} to {longest} blocks)"
    )


def spliced(period: int) -> str:
    """How a memoized estimate was made (``meta["memo"]``)."""
    if period == 1:
        return f"spliced from a probe of {PROBE} blocks per list"
    return f"spliced from a probe whose middle repeats the checkpointing's period of {period} blocks"


def period(optimizations: Sequence[Any]) -> int:
    """The period the probe's middle repeats (:func:`memkit._memo.probe_length`): the least common multiple of the
    checkpointing patterns' periods, 1 without one that has a period."""
    from .optimizations.checkpointing import Checkpointing

    periods = [period_of(o) for o in optimizations if isinstance(o, Checkpointing)]
    return math.lcm(1, *(p for p in periods if p is not None))


def probe_optimizations(
    model: nn.Module, lists: list[tuple[str, int, nn.ModuleList]], optimizations: Sequence[Any], period: int
) -> list[Any]:
    """``optimizations`` with each :class:`memkit.Checkpointing` of ``"every:N"`` or ``"skip-every:N"`` given the
    probe's blocks by index: each probe block checkpointed as the full block it is (:func:`memkit._memo.kept`),
    numbered in the full model's order (each cut list counted at its full length). Raises :class:`Unsupported` where
    a cut list's blocks do not repeat with ``period`` in the full model."""
    from .optimizations.checkpointing import Checkpointing, _selected

    out = list(optimizations)
    for i, o in enumerate(out):
        if not isinstance(o, Checkpointing) or o.pattern in ("all", "none"):
            continue
        blocks = [b for _, b in o._blocks(model)]
        where = {id(b): (n, len(bs), q) for _, n, bs in lists for q, b in enumerate(bs)}
        numbers, total, starts = [], 0, []  # each probe block's number in the full model; where each cut list starts
        for b in blocks:
            if id(b) not in where:
                numbers.append(total)
                total += 1
                continue
            n, size, q = where[id(b)]
            if q == 0:
                starts.append((total, n))
                total += n
            numbers.append(starts[-1][0] + (q if q < head(period) else q + n - size))  # the full block it is (kept)
        chosen = _selected(o.pattern, [None] * total)
        for start, n in starts:
            kinds = chosen[start : start + n]
            if any(kinds[j] != kinds[j + period] for j in range(n - period)):
                raise Unsupported(f"{o}'s blocks do not repeat every {period} blocks in a cut list")
        out[i] = dataclasses.replace(o, pattern=tuple(k for k, J in enumerate(numbers) if chosen[J]))
    return out
