"""Interval math for overlap metrics: pure functions over ``(start, end)`` pairs, no clocks, no processes.

The definitions for one step (the names every logger shows: README, "Overlap monitor"), with ``comm`` the union of collective intervals and ``comp`` the union
of compute intervals::

    overlap_ratio        = |comm ∩ comp| / max(|comm|, |comp|)
    hidden_comm_fraction = |comm ∩ comp| / |comm|          (Holistic Trace Analysis' definition)
    exposed_comm         = |comm| - |comm ∩ comp|

Unions matter: Gloo runs several collectives at once and two overlapping all-reduces must not count their common
time twice. The intersection of two unions is computed with a sweep over the interval end points: every boundary of the first
set changes a running count by ±1 and every boundary of the second by ±2, so the running sum is 3 exactly where
both are active (the trick HTA uses for communication and compute kernels).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from lightning_static_dist.overlap.timeline import StepTimeline

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty and inverted intervals are dropped.

    Example::

        >>> merge([(3, 4), (0, 2), (1, 3), (5, 5)])
        [(0, 4)]
    """
    ordered = sorted((s, e) for s, e in intervals if e > s)
    merged: list[Interval] = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals``."""
    return sum(e - s for s, e in merge(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of (union of ``a``) ∩ (union of ``b``).

    Example::

        >>> intersection([(0, 10)], [(2, 3), (2.5, 4), (12, 13)])
        2.0
    """
    events: list[tuple[float, int]] = []
    for s, e in merge(a):
        events += [(s, 1), (e, -1)]
    for s, e in merge(b):
        events += [(s, 2), (e, -2)]
    # at equal times apply the ends first, so touching intervals do not count as overlapping
    events.sort(key=lambda ev: (ev[0], ev[1]))
    level, previous, both = 0, 0.0, 0.0
    for time, change in events:
        if level == 3:
            both += time - previous
        level += change
        previous = time
    return both


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def step_metrics(timeline: StepTimeline) -> dict[str, float]:
    """The ``static_dist/*`` overlap metrics of one rank's step (milliseconds where the name says ``_ms``).

    Without collectives (one rank, or a step under gradient accumulation) the comm figures are 0 and the
    ratios are NaN: nothing was there to hide. ``comm_start_frac`` is the fraction of backward that had passed
    when the step's first collective was issued (clamped to [0, 1]); ``compression_ratio`` is the bytes the step's
    buckets would have sent uncompressed over the bytes they sent (1.0 without compression). ``embed_gather_ms``
    (issue to completion of the sharded embeddings' all-gather) and ``embed_gather_exposed_ms`` (how long the forward
    waited for it) are NaN without sharded embeddings.
    """
    comp = [(s, e) for _, s, e in timeline.compute]
    comm = [(c.issued_s, c.done_s) for c in timeline.comm]
    comm_s, comp_s = total(comm), total(comp)
    both = intersection(comm, comp)
    delays = [max(c.trigger_delay_s, 0.0) for c in timeline.comm]
    sent = sum(c.nbytes for c in timeline.comm)
    nan = float("nan")
    # where in backward the first collective went out: ~0 when gradients stream out block by block,
    # ~1 when they all became ready at the end (whole-model compile)
    backward = [(start, end) for phase, start, end in timeline.compute if phase == "backward" and end > start]
    start_frac = nan
    if comm and backward:
        b_start, b_end = backward[0]
        first_issue = min(issued for issued, _ in comm)
        start_frac = min(max((first_issue - b_start) / (b_end - b_start), 0.0), 1.0)
    return {
        "overlap_ratio": both / max(comm_s, comp_s) if comm_s > 0 and comp_s > 0 else nan,
        "hidden_comm_fraction": both / comm_s if comm_s > 0 else nan,
        "comm_ms": 1e3 * comm_s,
        "compute_ms": 1e3 * comp_s,
        "exposed_comm_ms": 1e3 * (comm_s - both),
        "trigger_delay_ms": 1e3 * _percentile(delays, 0.5) if delays else 0.0,
        "trigger_delay_worst_bucket_ms": 1e3 * max(delays) if delays else 0.0,
        "bytes_sent": float(sent),
        "comm_start_frac": start_frac,
        "embed_gather_ms": timeline.extra.get("embed_gather_ms", nan),
        "embed_gather_exposed_ms": timeline.extra.get("embed_gather_exposed_ms", nan),
        "compression_ratio": (
            sum(c.nbytes if c.dense_nbytes < 0 else c.dense_nbytes for c in timeline.comm) / sent if sent else nan
        ),
    }


def median_of(values: Iterable[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")
