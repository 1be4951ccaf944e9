"""Deprecated: the budget solver moved beside the estimate it runs, to :mod:`memkit.planning`.

``from memkit.optimizations.checkpoint_plan import plan_checkpointing`` keeps working for one release, with a
``DeprecationWarning``; ``memkit.plan_checkpointing`` is the name to use.
"""

from __future__ import annotations

import warnings

from ..planning import CheckpointPlan, plan_checkpointing, spread

__all__ = ["CheckpointPlan", "plan_checkpointing", "spread"]

warnings.warn(
    "memkit.optimizations.checkpoint_plan moved to memkit.planning (memkit.plan_checkpointing); the old path goes "
    "in the next release",
    DeprecationWarning,
    stacklevel=2,
)
