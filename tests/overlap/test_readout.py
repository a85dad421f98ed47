"""The monitor's readout on 2 real Gloo ranks: a recorded step is read only once every rank has completed it, under its
own step, with every rank's own figures combined on the host exactly as ``RankAggregate`` combined them; the end of
an epoch's read waits and loses nothing. A step is held back here by a real collective one rank has not joined yet:
its work handle says so without waiting, as a CUDA event does on a GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from lightning_static_dist.overlap.intervals import step_metrics
from lightning_static_dist.callbacks.monitor import METRICS, RankAggregate
from lightning_static_dist.overlap.readout import StepReadout, gather_on_host, row_of
from lightning_static_dist.overlap.recorder import StepRecorder

pytestmark = pytest.mark.multiprocess
NO_MAX = ("trigger_delay_worst_bucket_ms",)


def _host_max(values: list[float]) -> list[float]:
    """What the Trainer's ``host_max`` does: a maximum over the ranks' Gloo group, of a CPU tensor."""
    flat = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return flat.tolist()


def _gather(rank: int, world: int) -> tuple[int, list[list[float]], dict[str, float], list[float]]:
    # rank 0 has read two steps, rank 1 one: the first is agreed; rank 0 measured no "b" (NaN)
    figures = [[1.0 + rank, math.nan if rank == 0 else 5.0, 2.0 * rank], [9.0, 9.0, 9.0]][:2 - rank]
    agreed, tables = gather_on_host(_host_max, rank, world, figures, slots=2, width=3)
    row = row_of(("a", "b", "c"), tables[0], prefix="x_", no_max=("c",))
    reference = RankAggregate(3)(torch.tensor(figures[0], dtype=torch.float64)).tolist()  # the device's aggregate
    return agreed, tables[0].tolist(), row, reference


def test_the_ranks_agree_on_the_steps_all_of_them_read_and_combine_them_as_rank_aggregate_did() -> None:
    results = run_ranks(_gather, 2)
    for agreed, table, row, reference in results:
        assert agreed == 1
        assert table[0][0] == 1.0 and math.isnan(table[0][1]) and table[0][2] == 0.0
        assert table[1] == [2.0, 5.0, 2.0]
        assert row == {"static_dist/x_a": 1.5, "static_dist/x_b": 5.0, "static_dist/x_c": 1.0,
                       "static_dist/x_a_max": 2.0, "static_dist/x_b_max": 5.0}
        # the same numbers as the device aggregate the Trainer's monitor used before (and Fabric's still does)
        assert [row[f"static_dist/x_{k}"] for k in "abc"] + [row["static_dist/x_a_max"], row["static_dist/x_b_max"]] \
            == reference[:3] + reference[3:5]


@dataclass
class _InFlight:
    """A bucket's reduction in flight, as the synchroniser hands it to the recorder: its collective's work."""

    work: Optional[dist.Work]


def _record(recorder: StepRecorder, step: int, rank: int, group: Any, send: bool) -> Optional[dist.Work]:
    """One recorded step: forward, then a backward during which (``send``) bucket 0's all-reduce is issued on
    ``group`` and not waited for. The step is closed into the readout by the caller."""
    recorder.active = True
    recorder.begin_step(step=step, rank=rank)
    recorder.begin("forward")
    recorder.end("forward")
    recorder.begin("backward")
    work = None
    if send:
        flat = torch.full((8,), float(rank + 1))
        work = dist.all_reduce(flat, group=group, async_op=True)
        recorder.bucket_ready(0)
        recorder.bucket_issued(0, flat.numel() * 4, _InFlight(work))
    recorder.end("backward")
    return work


def _deferred(rank: int, world: int) -> dict[str, Any]:
    held_back = dist.new_group([0, 1])  # the buckets' group; the readout talks on the default group
    recorder = StepRecorder(torch.device("cpu"))
    readout = StepReadout(METRICS, _host_max, rank, world, no_max=NO_MAX)
    # step 7: rank 1 issues its bucket; rank 0 issues its own only after the first read, so rank 1's is not complete
    work = _record(recorder, 7, rank, held_back, send=rank == 1)
    closed = recorder.close_step()
    assert closed is not None
    readout.add(closed)
    first = readout.read()
    pending_after_first = readout.pending
    if rank == 0:
        dist.all_reduce(torch.full((8,), 1.0), group=held_back)  # joins rank 1's collective
    else:
        assert work is not None
        work.wait()
    second = readout.read()
    # steps 8 and 9: both ranks' buckets in flight, never waited for here: the end of the epoch's read waits
    for step in (8, 9):
        _record(recorder, step, rank, held_back, send=True)
        closed = recorder.close_step()
        assert closed is not None
        readout.add(closed)
    last = readout.read(wait=True)
    mine = {timeline.step: step_metrics(timeline) for timeline, _ in second + last}  # this rank's own figures
    return {"first": first, "pending_after_first": pending_after_first, "pending_at_end": readout.pending,
            "read": [(t.step, row) for t, row in second + last], "mine": mine}


def _nan_as_none(row: dict[str, float]) -> dict[str, Optional[float]]:
    return {key: None if math.isnan(value) else value for key, value in row.items()}


def test_a_step_one_rank_has_not_completed_is_read_later_under_its_own_step_and_the_last_ones_at_the_end() -> None:
    results = run_ranks(_deferred, 2)
    for result in results:
        assert result["first"] == [] and result["pending_after_first"] == 1  # rank 1's collective was in flight
        assert [step for step, _ in result["read"]] == [7, 8, 9] and result["pending_at_end"] == 0
    # every rank logs the same rows (NaN: a figure no rank measured, embed_gather_* here)
    assert [(step, _nan_as_none(row)) for step, row in results[0]["read"]] == \
        [(step, _nan_as_none(row)) for step, row in results[1]["read"]]
    for step, row in results[0]["read"]:
        # each rank's own figures, combined: rank 0 recorded no bucket at step 7
        own = [results[r]["mine"][step]["bytes_sent"] for r in (0, 1)]
        assert own == ([0.0, 32.0] if step == 7 else [32.0, 32.0])
        assert row["static_dist/bytes_sent"] == sum(own) / 2 and row["static_dist/bytes_sent_max"] == 32.0
        computes = [results[r]["mine"][step]["compute_ms"] for r in (0, 1)]
        assert row["static_dist/compute_ms"] == sum(computes) / 2 and row["static_dist/compute_ms_max"] == max(computes)
        assert "static_dist/trigger_delay_worst_bucket_ms_max" not in row


def test_a_step_not_recorded_records_nothing() -> None:
    recorder = StepRecorder(torch.device("cpu"))
    recorder.active = False
    recorder.begin_step(step=3, rank=0)
    recorder.begin("forward")
    recorder.end("forward")
    recorder.bucket_ready(0)
    recorder.bucket_issued(0, 16, _InFlight(None))
    recorder.bucket_waited(0)
    assert recorder.close_step() is None and recorder.end_step() is None
    recorder.active = True  # the next recorded step starts clean
    recorder.begin_step(step=4, rank=0)
    recorder.begin("optimizer")
    closed = recorder.close_step()
    assert closed is not None and closed.complete() and closed.step == 4
    timeline = closed.timeline()
    assert [phase for phase, _, _ in timeline.compute] == ["optimizer"] and timeline.comm == []
