"""memkit: understand and cut the memory of diffusion transformers."""

from .memory import CATEGORIES, PHASES, Timeline, track

__all__ = ["CATEGORIES", "PHASES", "Timeline", "track"]
__version__ = "0.1.0"
