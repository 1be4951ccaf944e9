"""Exact memory timelines: the event schema, the live-storage tracker and the fake-tensor estimator."""

from .events import CATEGORIES, PHASES
from .timeline import Timeline
from .tracker import Tracker, phase, tag, track, tracking

__all__ = ["CATEGORIES", "PHASES", "Timeline", "Tracker", "phase", "tag", "track", "tracking"]
