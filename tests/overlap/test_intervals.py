"""Interval math against hand-computed numbers."""

import math

import pytest

from lightning_static_dist.overlap.intervals import intersection, merge, step_metrics, total
from lightning_static_dist.overlap.timeline import CommRecord, StepTimeline


def test_merge_sorts_joins_and_drops_empty() -> None:
    assert merge([(3, 4), (0, 2), (1, 3), (5, 5), (7, 6)]) == [(0, 4)]
    assert merge([(0, 1), (2, 3)]) == [(0, 1), (2, 3)]
    assert merge([(0, 1), (1, 2)]) == [(0, 2)]  # touching intervals join
    assert merge([]) == []


def test_total_counts_shared_time_once() -> None:
    assert total([(0, 2), (1, 3)]) == 3
    assert total([(0, 1), (0, 1), (0, 1)]) == 1  # identical
    assert total([(0, 10), (2, 3)]) == 10  # nested


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([(0, 10)], [(2, 3)], 1.0),  # nested
        ([(0, 1)], [(2, 3)], 0.0),  # disjoint
        ([(0, 1)], [(1, 2)], 0.0),  # touching
        ([(0, 4)], [(0, 4)], 4.0),  # identical
        ([(0, 4)], [(2, 6)], 2.0),  # partial
        ([(0, 10)], [(2, 3), (2.5, 4), (12, 13)], 2.0),  # overlapping comm counted once
        ([(0, 2), (4, 6)], [(1, 5)], 2.0),  # one comm across a compute gap
        ([], [(0, 1)], 0.0),
    ],
)
def test_intersection(a: list, b: list, expected: float) -> None:
    assert intersection(a, b) == pytest.approx(expected)
    assert intersection(b, a) == pytest.approx(expected)


def timeline(compute: list, comm: list) -> StepTimeline:
    return StepTimeline(step=1, rank=0, compute=compute, comm=[CommRecord(*c) for c in comm])


def test_step_metrics_exact() -> None:
    # forward 0-10 ms, backward 10-30 ms, optimizer 32-34 ms; bucket 0 overlaps backward fully (15-20),
    # bucket 1 half (25-35, 5 ms inside backward, 2 inside the optimizer), ready 1 ms before issue
    t = timeline(
        [("forward", 0.000, 0.010), ("backward", 0.010, 0.030), ("optimizer", 0.032, 0.034)],
        [(0, 1000, 0.015, 0.015, 0.020), (1, 3000, 0.024, 0.025, 0.035)],
    )
    m = step_metrics(t)
    assert m["comm_ms"] == pytest.approx(15.0)
    assert m["compute_ms"] == pytest.approx(32.0)
    # overlap: 5 (b0) + 5 (b1 in backward) + 2 (b1 in optimizer) = 12 ms
    assert m["hidden_comm_fraction"] == pytest.approx(12 / 15)
    assert m["overlap_ratio"] == pytest.approx(12 / 32)
    assert m["exposed_comm_ms"] == pytest.approx(3.0)
    assert m["trigger_delay_ms"] == pytest.approx(0.5)  # median of 0 and 1 ms
    assert m["trigger_delay_worst_bucket_ms"] == pytest.approx(1.0)
    assert m["bytes_sent"] == 4000
    assert m["comm_start_frac"] == pytest.approx(0.25)  # first issue at 15 ms of backward 10-30 ms


def test_all_comm_after_backward_is_fully_exposed() -> None:
    t = timeline([("forward", 0, 1), ("backward", 1, 3)], [(0, 10, 3.0, 3.0, 4.0), (1, 10, 3.0, 3.0, 4.5)])
    m = step_metrics(t)
    assert m["overlap_ratio"] == 0 and m["hidden_comm_fraction"] == 0
    assert m["exposed_comm_ms"] == pytest.approx(1500)
    assert m["comm_start_frac"] == 1.0  # issued after backward ended: clamped


def test_no_collectives_gives_nan_ratios_and_zero_comm() -> None:
    m = step_metrics(timeline([("forward", 0, 1)], []))
    assert math.isnan(m["overlap_ratio"]) and math.isnan(m["hidden_comm_fraction"])
    assert m["comm_ms"] == 0 and m["exposed_comm_ms"] == 0 and m["bytes_sent"] == 0
    assert math.isnan(m["comm_start_frac"])
