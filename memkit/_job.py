"""A job's phases and their figures (:func:`memkit.estimate_job` makes them; :mod:`memkit.pipeline` says how)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .memory.timeline import Timeline


@dataclasses.dataclass
class Phase:
    """One phase of a job: its device timeline, which component each byte belongs to, and its host memory.

    Example:
        >>> phase = memkit.estimate_job("flux", memkit.Pipeline(validate=(100, 28))).phases["validation"]
        >>> phase.peak_reserved_bytes, phase.host_bytes, phase.note
    """

    name: str
    timeline: Timeline
    owner: np.ndarray
    """Per event: the index in :attr:`Job.components` of the component it belongs to."""
    baseline_by_component: dict[str, int]
    host_bytes: int
    note: str = ""

    @property
    def peak_bytes(self) -> int:
        return self.timeline.peak_bytes

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self.timeline.peak_reserved_bytes

    def by_component_at(self, index: int | None, components: Sequence[str]) -> dict[str, int]:
        """Bytes per component after event ``index`` (None: the baseline)."""
        out = {c: int(self.baseline_by_component.get(c, 0)) for c in components}
        if index is not None and len(self.owner):
            signed = self.timeline.signed_bytes[: index + 1]
            sums = np.bincount(self.owner[: index + 1], weights=signed, minlength=len(components))
            for i, c in enumerate(components):
                out[c] += int(sums[i])
        return out


@dataclasses.dataclass
class Job:
    """The phases of a run and their peaks (see :func:`estimate_job`).

    Example:
        >>> job = memkit.estimate_job("flux", memkit.Pipeline(text_encoders="gpu"))
        >>> job.peak_phase, job.peak_by_phase, job.host_peak_bytes
    """

    phases: dict[str, Phase]
    components: list[str]
    """``"transformer"`` first, then the pipeline's components by attribute (``"text_encoder_2"``, ``"vae"``)."""
    step: Timeline
    """The training steps' (or the denoising step's) own estimate, as :func:`memkit.estimate` returns it."""
    pipeline: Any
    """The :class:`memkit.Pipeline` the job was estimated with."""
    parameters_by_component: dict[str, int]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def _key(self, phase: Phase) -> tuple[int, int]:
        reserved = phase.peak_reserved_bytes
        return (reserved if reserved is not None else phase.peak_bytes, phase.peak_bytes)

    @property
    def peak_phase(self) -> str:
        """The phase that sets the job's peak (reserved bytes on a CUDA estimate, else allocated)."""
        return max(self.phases.values(), key=self._key).name

    @property
    def peak_bytes(self) -> int:
        """The job's peak allocated bytes (the largest phase's)."""
        return max(p.peak_bytes for p in self.phases.values())

    @property
    def peak_reserved_bytes(self) -> int | None:
        """The job's peak reserved bytes (CUDA estimates; None otherwise)."""
        values = [p.peak_reserved_bytes for p in self.phases.values()]
        return None if any(v is None for v in values) else max(values)

    @property
    def peak_by_phase(self) -> dict[str, dict[str, int | None]]:
        """Phase -> ``{"allocated": peak, "reserved": peak or None, "host": host bytes}``, in the job's order."""
        return {
            name: {"allocated": p.peak_bytes, "reserved": p.peak_reserved_bytes, "host": p.host_bytes}
            for name, p in self.phases.items()
        }

    @property
    def peak_by_component(self) -> dict[str, int]:
        """Allocated bytes of each component at the peak of the phase that sets the job's peak (the transformer's
        weights, gradients, optimizer state and activations under ``"transformer"``)."""
        phase = self.phases[self.peak_phase]
        tl = phase.timeline
        index = tl.peak_index if len(tl) and tl.peak_bytes > tl.baseline_bytes else None
        return phase.by_component_at(index, self.components)

    @property
    def host_peak_bytes(self) -> int:
        """The most host (CPU) memory any phase holds: a checkpoint being loaded, CPU-placed components, offloaded
        state (the step's ``meta["host_bytes"]``), the weights being saved."""
        return max(p.host_bytes for p in self.phases.values())

    def summary(self) -> dict[str, Any]:
        """The job's figures as a JSON-ready dict (the command line's ``--json`` fields)."""
        return dict(
            peak_phase=self.peak_phase,
            job_peak_bytes=self.peak_bytes,
            job_peak_reserved_bytes=self.peak_reserved_bytes,
            peak_by_phase=self.peak_by_phase,
            peak_by_component=self.peak_by_component,
            parameters_by_component=self.parameters_by_component,
            host_peak_bytes=self.host_peak_bytes,
            pipeline=str(self.pipeline),
            phase_notes={n: p.note for n, p in self.phases.items() if p.note},
            lower_bound_phases={
                n: p.timeline.meta["lower_bound"] for n, p in self.phases.items() if p.timeline.meta.get("lower_bound")
            },  # fmt: skip
        )

    def __repr__(self) -> str:
        gib = 2**30
        rows = ", ".join(f"{n} {p.peak_bytes / gib:.2f}" for n, p in self.phases.items())
        return f"Job(peak {self.peak_bytes / gib:.2f} GiB allocated in {self.peak_phase}; phases: {rows})"
