"""benchmarks/profile_summary.py on a small hand-made Chrome trace: every figure it reports, checked by hand."""

from __future__ import annotations

import gzip
import json
import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from profile_summary import summarise  # noqa: E402


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


@pytest.fixture
def trace(tmp_path: Any) -> str:
    # microseconds. Host: a matmul launched at 10 (its kernel runs 20-120: 10 us of lead), an all-reduce kernel
    # 80-180 on another stream (60 us of it beside no compute), a blocking read (aten::item: 250 us of
    # cudaStreamSynchronize), then an add launched at 610 whose kernel runs 620-630 (the GPU idled 180-620)
    events = [
        _x("cpu_op", "aten::mm", 0, 50),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("kernel", "gemm", 20, 100, tid=7, correlation=1),
        _x("kernel", "ncclDevKernel_AllReduce_Sum_f32", 80, 100, tid=8, correlation=2),
        _x("cpu_op", "aten::item", 200, 300),
        _x("cuda_runtime", "cudaStreamSynchronize", 210, 250),
        _x("cpu_op", "aten::add", 600, 50),
        _x("cuda_runtime", "cudaLaunchKernel", 610, 5, correlation=3),
        _x("kernel", "add_kernel", 620, 10, tid=7, correlation=3),
    ]
    path = str(tmp_path / "trace.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_the_summary_splits_a_step_into_compute_communication_and_idle_time(trace: str) -> None:
    s = summarise(trace, steps=1)
    assert s["step_ms"] == pytest.approx(0.61)  # first kernel start 20 to last kernel end 630
    assert s["compute_ms"] == pytest.approx(0.11)
    assert s["comm_ms"] == pytest.approx(0.10)
    assert s["exposed_comm_ms"] == pytest.approx(0.06)
    assert s["idle_ms"] == pytest.approx(0.44)
    assert s["kernels_per_step"] == 3 and s["nccl_kernels_per_step"] == 1


def test_the_summary_names_the_host_waits_and_what_ended_each_idle_gap(trace: str) -> None:
    s = summarise(trace, steps=1)
    assert s["host_syncs"] == {"cudaStreamSynchronize": {"count": 1, "ms": 0.25, "under": {"aten::item": 1}}}
    assert s["gaps"] == [{"ms": 0.44, "next_kernel": "add_kernel", "launched_under": ["aten::add"]}]
    assert s["host_lead_ms_median"] == pytest.approx(0.01)  # both launched kernels started 10 us after their launch
    assert s["host_bound_kernel_share"] == 1.0


def test_per_step_figures_divide_by_the_profiled_steps(trace: str) -> None:
    assert summarise(trace, steps=2)["idle_ms"] == pytest.approx(0.22)


def test_a_launch_is_named_by_its_innermost_enclosing_ops_outermost_first() -> None:
    from profile_summary import _enclosing

    nest = [{"name": f"op{d}", "tid": 1, "ts": float(d), "dur": 100.0 - 2 * d} for d in range(5)]  # op0 holds op1 ...
    other = {"name": "other-thread", "tid": 2, "ts": 0.5, "dur": 99.0}
    ops = sorted(nest + [other], key=lambda e: e["ts"])
    launch = {"tid": 1, "ts": 10.0, "dur": 1.0}
    assert _enclosing(ops, [e["ts"] for e in ops], launch, depth=3) == ["op2", "op3", "op4"]
    assert _enclosing(ops, [e["ts"] for e in ops], launch, depth=9) == ["op0", "op1", "op2", "op3", "op4"]
