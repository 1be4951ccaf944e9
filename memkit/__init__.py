"""memkit: understand and cut the memory of diffusion transformers.

Load a transformer, track a real step's memory exactly, estimate full-size steps on fake tensors, and
compare optimizations side by side (peak by category, time, output and gradient differences).

Example:
    >>> import memkit
    >>> model = memkit.load_model("flux")             # tiny, random weights
    >>> inputs = memkit.make_inputs(model)
    >>> with memkit.track(model, inputs=inputs) as tl:
    ...     memkit.train_step(model, inputs)
    >>> tl.peak_by_category()
"""

from . import memory, plots
from .checkpointing import Checkpointing
from .compare import Comparison, VariantResult, compare
from .handle import Handle, Optimization
from .memory import CATEGORIES, PHASES, Timeline, track
from .memory.estimate import estimate
from .models import PRESETS, SIZES, load_model, make_inputs, train_step

__all__ = [
    "CATEGORIES",
    "PHASES",
    "PRESETS",
    "SIZES",
    "Checkpointing",
    "Comparison",
    "Handle",
    "Optimization",
    "Timeline",
    "VariantResult",
    "compare",
    "memory",
    "plots",
    "estimate",
    "load_model",
    "make_inputs",
    "track",
    "train_step",
]
__version__ = "0.1.0"
