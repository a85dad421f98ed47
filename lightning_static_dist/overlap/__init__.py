"""Overlap measurement: step timelines, pure interval math, the recorder, the monitor callback and the picture."""

from lightning_static_dist.overlap.intervals import intersection, merge, step_metrics, total
from lightning_static_dist.overlap.timeline import CommRecord, StepTimeline

__all__ = ["CommRecord", "StepTimeline", "intersection", "merge", "step_metrics", "total"]
