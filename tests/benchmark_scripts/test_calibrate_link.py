"""benchmarks/calibrate_link.py: the transfer split, the two-rate fit, the slowdown fit and the SM lookup on
hand-made numbers, and the committed record re-derived from the committed traces."""

from __future__ import annotations

import gzip
import json
import os
import sys
from typing import Any

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)
import calibrate_link as cal  # noqa: E402


def _kernel(name: str, ts: float, dur: float, stream: int, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, **args}}


def _allreduce(ts: float, dur: float, nelems: int) -> dict[str, Any]:
    return _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ts, dur, 17, **{
        "Collective name": "allreduce", "In msg nelems": nelems, "dtype": "Float", "grid": [24, 1, 1]})


def _write(path: str, events: list[dict[str, Any]]) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({"deviceProperties": [{"name": "GPU", "numSms": 132}], "distributedInfo": {"nccl_version": "x"},
                   "traceEvents": events}, f)


def test_bytes_move_from_the_later_start_and_count_busy_where_either_rank_computes(tmp_path: Any) -> None:
    # microseconds. Rank 0 launches the 4 MB all-reduce at 100, rank 1 at 150: 50 us of waiting on rank 0, then the
    # transfer 150-250. Rank 0 computes 140-180, rank 1 200-220: 30 + 20 us of the transfer are busy.
    barrier = {"Collective name": "barrier", "In msg nelems": 0, "dtype": "Byte", "grid": [1, 1, 1]}
    for rank, (start, compute) in enumerate(((100, (140, 40)), (150, (200, 20)))):
        _write(str(tmp_path / f"rank{rank}.json.gz"), [
            _kernel("ncclDevKernel_AllReduce_barrier", 0, 5, 7, **barrier),
            _allreduce(start, 250 - start, 1 << 20),
            _kernel("gemm", *compute, 7)])
    ranks = [cal.load_rank(str(tmp_path / f"rank{r}.json.gz")) for r in (0, 1)]
    [row] = cal.transfers("t", ranks)
    assert row["bytes"] == 4 << 20 and row["ctas"] == 24
    assert row["transfer_us"] == pytest.approx(100)
    assert row["busy_us"] == pytest.approx(50)
    assert row["busy_us_per_rank"] == [30, 20]
    assert row["wait_us"] == [50, 0]


def _row(nbytes: float, busy_fraction: float, busy: float, idle: float, latency: float) -> dict[str, Any]:
    """A transfer that follows the link model exactly: latency, then the bytes at the rates mixed by the fraction."""
    moving = nbytes / 1e3 / (busy_fraction * busy + (1 - busy_fraction) * idle)  # us, at GB/s = 1e3 bytes/us
    transfer = latency + moving
    return {"bytes": nbytes, "transfer_us": transfer, "busy_us": busy_fraction * transfer}


def test_the_fit_recovers_both_rates_and_the_fixed_cost_of_an_exact_link() -> None:
    rows = [_row(b, f, 200.0, 300.0, 20.0) for b in (20e6, 150e6) for f in (0.0, 0.5, 1.0)]
    link = cal.fit_link(rows)
    assert link["latency_total_us"] == 20.0
    assert link["busy_gbps"] == pytest.approx(200.0)
    assert link["idle_gbps"] == pytest.approx(300.0)
    assert link["time_error"] == pytest.approx(0.0, abs=1e-9)


def test_the_rates_are_not_separated_where_every_transfer_is_alike() -> None:
    assert cal.fit_rates([_row(20e6, f, 200.0, 300.0, 0.0) for f in (0.0, 0.1, 0.2)], 0.0) is None


def test_the_slowdown_is_the_excess_per_ms_of_nccl_beside_a_kernel() -> None:
    # three steps (barriers at 0, 1000, 2000), kernel "g" once per step, 100 us alone. In step 1 a transfer
    # (1050-1150) covers 100 us of g, which takes 140 us there: 0.4 ms per ms. In step 2 rank 0's NCCL kernel spins
    # for the peer 2000-2200, all through g, which takes 125 us there: 0.2 ms per ms.
    g = [{"name": "g", "ts": 50, "end": 150}, {"name": "g", "ts": 1050, "end": 1190},
         {"name": "g", "ts": 2000, "end": 2125}]
    rank0 = cal.Rank(compute=g, barriers=[0, 1000, 2000])
    rows = [{"start": 1050, "end": 1150, "starts": [1050, 1050]}, {"start": 2200, "end": 2300, "starts": [2000, 2200]}]
    fit = cal.slowdown([rank0, cal.Rank(barriers=[0, 1000, 2000])], rows, only_rank=0)
    assert fit["ms_per_ms_transfer"] == pytest.approx(0.4)
    assert fit["ms_per_ms_wait"] == pytest.approx(0.2)
    assert fit["instances"] == 3 and fit["instances_beside_transfer"] == 1


def test_the_sms_are_read_off_the_measured_curve() -> None:
    curve = [(0, 0.0), (24, 0.264), (48, 0.36)]
    assert cal.sms_for(0.312, curve) == {"sms": 36, "note": None}
    assert cal.sms_for(0.5, curve)["sms"] == 48 and "outside" in cal.sms_for(0.5, curve)["note"]


def test_the_committed_record_is_what_the_committed_traces_give() -> None:
    with open(os.path.join(BENCH, "results", "link-calibration-traces-2026-12-04.json")) as f:
        record = json.load(f)["summary"]
    res = cal.analyse(BENCH)
    head, _ = cal.headline_slowdown(res["slowdown"])
    assert res["link"]["busy_gbps"] == pytest.approx(record["busy_gbps"], abs=1e-3)
    assert res["link"]["idle_gbps"] == pytest.approx(record["idle_gbps"], abs=1e-3)
    assert res["link"]["latency_total_us"] / 2 == record["latency_us"]
    assert head["ms_per_ms_transfer"] == pytest.approx(record["slowdown_ms_per_ms"], abs=1e-3)
    assert cal.sms_for(head["ms_per_ms_transfer"], cal.sm_curve(BENCH))["sms"] == record["sms"]
