"""Overlap measurement: step timelines, pure interval math, the recorder and the picture (the callback that
logs them is ``callbacks/monitor.py``)."""

from lightning_static_dist.overlap.intervals import intersection, merge, step_metrics, total
from lightning_static_dist.overlap.timeline import CommRecord, StepTimeline

__all__ = ["CommRecord", "StepTimeline", "intersection", "merge", "step_metrics", "total"]
