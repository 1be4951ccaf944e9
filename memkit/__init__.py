"""memkit: understand and cut the memory of diffusion transformers.

Load a transformer, track a real step's memory exactly, estimate full-size steps on fake tensors, and
compare optimizations side by side (peak by category, time, output and gradient differences).

The house: measure (``memory/``: tracker, Timeline, snapshots) → optimize (``optimizations/``: one file each,
and the registry) → run (``step.py``: the one step; ``comparison.py``, ``estimation.py``) → show (``plots.py``,
``cli/``). Models and their inputs come from ``presets/`` and ``models.py``.

Names are imported on first use, so ``import memkit.plots`` or ``memkit.Timeline`` does not load torch and
diffusers.

Example:
    >>> import memkit
    >>> model = memkit.load_model("flux")             # tiny, random weights
    >>> inputs = memkit.make_inputs(model)
    >>> with memkit.track(model, inputs=inputs) as tl:
    ...     memkit.train_step(model, inputs)
    >>> tl.peak_by_category()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._torch_compat import warn_if_unsupported as _warn_if_unsupported

__version__ = "0.1.0"

_warn_if_unsupported()  # a torch outside the supported range: one warning naming it (torch itself is not loaded)

# public name -> module that defines it (relative to memkit)
_EXPORTS = {
    "CATEGORIES": ".memory.events",
    "PHASES": ".memory.events",
    "Timeline": ".memory.timeline",
    "track": ".memory.recording",
    "PRESETS": ".presets",
    "SIZES": ".presets",
    "load_model": ".models",
    "make_inputs": ".models",
    "Step": ".step",
    "train_step": ".step",
    "Handle": ".handle",
    "Optimization": ".handle",
    "Checkpointing": ".optimizations",
    "CheckpointPlan": ".planning",
    "plan_checkpointing": ".planning",
    "plan": ".planning",
    "Plan": ".planning",
    "EMA": ".optimizations.ema",
    "FFSplit": ".optimizations.feedforward",
    "Offload": ".optimizations.offload",
    "LoRA": ".optimizations.lora",
    "Quantize": ".optimizations.quantization",
    "compare": ".comparison",
    "Comparison": ".comparison",
    "Variant": ".comparison",
    "VariantResult": ".comparison",
    "estimate": ".estimation",
    "estimate_job": ".pipeline",
    "Pipeline": ".pipeline",
    "Job": ".pipeline",
    "FSDP": ".parallel",
    "Playground": ".widgets.app",
}
_SUBMODULES = (
    "memory",
    "optimizations",
    "optimizers",
    "plots",
    "step",
    "models",
    "presets",
    "handle",
    "comparison",
    "estimation",
    "parallel",
    "widgets",
    "gpus",
    "pipeline",
    "steptime",
)

__all__ = [
    "CATEGORIES",
    "CheckpointPlan",
    "Checkpointing",
    "Comparison",
    "EMA",
    "FFSplit",
    "FSDP",
    "Handle",
    "Job",
    "LoRA",
    "Offload",
    "Optimization",
    "PHASES",
    "PRESETS",
    "Pipeline",
    "Plan",
    "Playground",
    "Quantize",
    "SIZES",
    "Step",
    "Timeline",
    "Variant",
    "VariantResult",
    "compare",
    "estimate",
    "estimate_job",
    "load_model",
    "make_inputs",
    "memory",
    "optimizations",
    "parallel",
    "plan",
    "plan_checkpointing",
    "plots",
    "track",
    "train_step",
    "widgets",
]

if TYPE_CHECKING:
    from . import memory, optimizations, parallel, plots, widgets
    from .comparison import Comparison, Variant, VariantResult, compare
    from .estimation import estimate
    from .handle import Handle, Optimization
    from .memory.events import CATEGORIES, PHASES
    from .memory.recording import track
    from .memory.timeline import Timeline
    from .models import load_model, make_inputs
    from .optimizations import Checkpointing
    from .optimizations.ema import EMA
    from .optimizations.feedforward import FFSplit
    from .optimizations.offload import Offload
    from .parallel import FSDP
    from .pipeline import Job, Pipeline, estimate_job
    from .planning import CheckpointPlan, Plan, plan, plan_checkpointing
    from .presets import PRESETS, SIZES
    from .step import Step, train_step
    from .widgets.app import Playground


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, _SUBMODULES)
