"""What one rank did during one training step: compute phases and collectives, in seconds from the step's start.

A :class:`StepTimeline` is plain data: the recorder fills it, the interval math reads it, the picture draws it,
and it pickles cleanly so rank 0 can gather every rank's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommRecord:
    """One collective: which bucket, how many payload bytes, and when it was ready, issued and done."""

    bucket: int
    nbytes: int
    ready_s: float
    """When the bucket's last gradient became ready."""
    issued_s: float
    """When its collective was issued."""
    done_s: float
    """When the collective completed."""
    dense_nbytes: int = -1
    """What the bucket would have sent uncompressed (-1: the same as ``nbytes``)."""

    @property
    def trigger_delay_s(self) -> float:
        return self.issued_s - self.ready_s


@dataclass
class StepTimeline:
    """One rank's step.

    Example::

        timeline = StepTimeline(step=10, rank=0)
        timeline.compute.append(("backward", 0.012, 0.030))
        timeline.comm.append(CommRecord(bucket=0, nbytes=4096, ready_s=0.015, issued_s=0.015, done_s=0.019))
    """

    step: int
    rank: int
    compute: list[tuple[str, float, float]] = field(default_factory=list)
    """(phase, start, end): ``forward``, ``backward``, ``optimizer``."""
    comm: list[CommRecord] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)
    """Figures measured outside the buckets, in milliseconds (``embed_gather_ms``, ``embed_gather_exposed_ms``)."""
