"""benchmarks/cpu2_split_sensitivity.py's bookkeeping on two hand-made ranks: every figure checked by hand."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from cpu2_split_sensitivity import MONITOR_KEYS, bucket_steps, compare, fit_summary, isolated_ms  # noqa: E402

from lightning_static_dist.overlap.cost_model import Link, Sample
from lightning_static_dist.overlap.timeline import CommRecord, StepTimeline


def _timeline(step: int, backward: tuple[float, float],
              comm: list[tuple[int, int, float, float, float]]) -> StepTimeline:
    timeline = StepTimeline(step=step, rank=0, compute=[("forward", 0.0, backward[0]), ("backward", *backward)])
    timeline.comm = [CommRecord(b, n, ready, issued, done) for b, n, ready, issued, done in comm]
    return timeline


@pytest.fixture
def ranks() -> list[list[tuple[float, StepTimeline]]]:
    # seconds. Rank 1's step starts 2 ms after rank 0's on the shared clock. Bucket 0 (4000 bytes) is ready on
    # both ranks by 100.011 and done by 100.0195 (rank 1 saw it first); bucket 1 (2000 bytes) by 100.030 and
    # 100.040, and rank 1's issue mark (100.041) came after that completion: its call returned late
    # (bucket, bytes, ready, issued, done)
    rank0 = [(100.0, _timeline(1, (0.005, 0.032), [(0, 4000, 0.010, 0.011, 0.020), (1, 2000, 0.030, 0.031, 0.040)])),
             (100.5, _timeline(2, (0.005, 0.032), [(0, 4000, 0.010, 0.011, 0.020)]))]  # rank 1 did not record step 2
    rank1 = [(100.002, _timeline(1, (0.004, 0.028),
                                 [(0, 4000, 0.009, 0.0095, 0.0175), (1, 2000, 0.027, 0.039, 0.039)]))]
    return [rank0, rank1]


def test_bucket_latency_runs_from_the_later_ranks_ready_to_the_first_completion_seen(ranks) -> None:
    (step,) = bucket_steps(ranks)  # step 2 was recorded on one rank only: left out
    assert step["step"] == 1
    b0, b1 = step["buckets"]
    assert (b0["bucket"], b0["nbytes"], b1["nbytes"]) == (0, 4000, 2000)
    assert b0["sync_ms"] == pytest.approx(8.5)  # ready on both at 100.011, done at 100.0195
    assert b0["after_issue_ms"] == pytest.approx(8.0)  # issued by both at 100.0115
    assert b0["issue_to_done_ms"] == pytest.approx(9.0)  # rank 0's own view, waiting for rank 1 included
    assert b0["skew_ms"] == pytest.approx(1.0)
    assert b1["sync_ms"] == pytest.approx(10.0)
    assert b1["after_issue_ms"] == 0.0  # the later issue mark fell after the completion: clamped, a lower bound
    assert b1["skew_ms"] == pytest.approx(1.0)
    # when every rank had each bucket ready, in each rank's own frame, and its backward's end
    assert step["ranks"][0]["all_ready_s"] == pytest.approx([0.011, 0.030])
    assert step["ranks"][1]["all_ready_s"] == pytest.approx([0.009, 0.028])
    assert [r["backward_end_s"] for r in step["ranks"]] == [0.032, 0.028]


def test_the_model_is_set_beside_the_measured_latencies_and_exposed_time(ranks) -> None:
    monitor_rows = [{f"static_dist/{k}": value for k in MONITOR_KEYS} for value in (2.0, float("nan"))]
    # α 1 ms, β 1 MB/s: a 2-rank all-reduce of n bytes costs 2 ms + n µs
    # alone, the calibration's all-reduces took 4 ms at 2000 bytes (median of 3, 4, 5) and 5 ms at 4000
    calibration = [Sample("all_reduce", n, 2, ms / 1e3)
                   for n, ms in [(2000, 3.0), (2000, 5.0), (2000, 4.0), (4000, 5.0)]]
    row = compare(bucket_steps(ranks), monitor_rows, Link(latency_s=1e-3, bandwidth_Bps=1e6), calibration)
    assert (row["buckets"], row["bucket_bytes"], row["recorded_steps"]) == (2, [4000, 2000], 1)
    b0, b1 = row["per_bucket"]
    assert (b0["model_ms"], b0["sync_ms"], b0["rel_error"]) == (6.0, 8.5, round(6 / 8.5 - 1, 3))
    assert (b1["model_ms"], b1["sync_ms"], b1["rel_error"]) == (4.0, 10.0, -0.6)
    assert (b0["isolated_ms"], b1["isolated_ms"]) == (5.0, 4.0)
    assert (row["sync_ms_sum"], row["model_ms_sum"], row["sum_rel_error"]) == (18.5, 10.0, round(10 / 18.5 - 1, 3))
    assert row["isolated_ms_sum"] == 9.0
    assert row["bucket_rel_error_median_abs"] == pytest.approx((0.294 + 0.6) / 2)
    # rank 0: 0.011 + 6 ms = 0.017, then 0.030 + 4 ms = 0.034, 2 ms past backward's end (0.032);
    # rank 1: 0.009 + 6 = 0.015, then 0.028 + 4 = 0.032, 4 ms past 0.028: 3 ms on the mean
    assert row["model_exposed_ms"] == pytest.approx(3.0)
    assert (row["exposed_ms"], row["exposed_rel_error"]) == (2.0, 0.5)  # the monitor's median (NaN rows skipped)
    assert row["monitor"]["hidden_comm_fraction"] == 2.0


def test_the_summary_says_whether_the_model_fits() -> None:
    rows = [{"bucket_rel_error_median_abs": e, "sum_rel_error": s, "exposed_rel_error": x}
            for e, s, x in [(0.1, -0.5, 0.2), (0.3, 0.1, -0.4), (0.2, -0.2, float("nan"))]]
    assert fit_summary(rows) == {"bucket_rel_error_median_abs": 0.2, "sum_rel_error_median_abs": 0.2,
                                 "exposed_rel_error_median_abs": 0.3, "sum_within_15pct": False}
    assert fit_summary(rows, tolerance=0.2)["sum_within_20pct"] is True


def test_an_isolated_all_reduce_is_read_between_the_calibrated_sizes() -> None:
    calibration = [Sample("all_reduce", 1000, 2, 1e-3), Sample("all_reduce", 3000, 2, 3e-3),
                   Sample("all_reduce", 3000, 2, 5e-3)]  # 4 ms at 3000 bytes: the median of the two
    assert isolated_ms(calibration, 2000) == pytest.approx(2.5)
    assert isolated_ms(calibration, 1000) == pytest.approx(1.0)
    assert isolated_ms(calibration, 10) == pytest.approx(1.0)  # outside the range: the nearest size's
    assert isolated_ms(calibration, 9000) == pytest.approx(4.0)
