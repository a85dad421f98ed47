"""Trace-derived overlap metrics (profiler mode) against hand-built Chrome traces with exact expected numbers."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lightning_static_dist.callbacks.monitor import OverlapMonitor
from lightning_static_dist.overlap.trace import classify, trace_metrics


def event(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1, pid: int = 10) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_gpu_trace_classifies_kernels_like_hta() -> None:
    trace = {"traceEvents": [
        event("ProfilerStep#4", -500, 900, cat="user_annotation"),          # the CPU's mark of the step (counted)
        event("ProfilerStep#4", 0, 1000, cat="gpu_user_annotation", pid=0),  # the GPU's
        event("sm90_xmma_gemm_bf16", 100, 400, cat="kernel", pid=0, tid=7),      # compute 100..500
        event("triton_poi_fused_add", 450, 150, cat="kernel", pid=0, tid=7),     # compute 450..600
        event("ncclDevKernel_AllReduce_Sum_f32", 500, 300, cat="kernel", pid=0, tid=20),  # comm 500..800
        event("Memcpy DtoD (Device -> Device)", 700, 200, cat="kernel", pid=0, tid=7),  # neither
        event("aten::mm", 0, 900),                                                # CPU op: ignored on GPU
    ]}
    steps, compute, comm, kind = classify(trace)
    assert kind == "gpu" and steps == [(-500.0, 400.0)] and len(compute) == 2 and comm == [(500.0, 800.0)]
    metrics = trace_metrics(trace)
    # comm 300 us, compute union 500 us (100..600), both 100 us (500..600)
    assert metrics["hidden_comm_fraction"] == pytest.approx(100 / 300)
    assert metrics["overlap_ratio"] == pytest.approx(100 / 500)
    assert metrics["comm_ms"] == pytest.approx(0.3)
    assert metrics["compute_ms"] == pytest.approx(0.5)
    assert metrics["exposed_comm_ms"] == pytest.approx(0.2)


def test_cpu_trace_uses_gloo_ranges_and_the_training_thread_per_step() -> None:
    trace = {"traceEvents": [
        event("ProfilerStep#1", 0, 100, cat="user_annotation", tid=1),
        event("ProfilerStep#2", 100, 100, cat="user_annotation", tid=1),
        event("aten::addmm", 0, 50, tid=1),
        event("aten::mm", 20, 20, tid=1),                       # nested in addmm: counted once
        event("c10d::allreduce_", 50, 5, tid=1),                # issuing a collective is not compute
        event("aten::mm", 130, 40, tid=1),
        event("aten::add", 0, 100, tid=3),                      # another thread (a dataloader): not the step's compute
        event("gloo:all_reduce", 40, 30, cat="user_annotation", tid=9),   # step 1: 40..70, 10 us hidden
        event("gloo:all_reduce", 150, 60, cat="user_annotation", tid=9),  # step 2: 150..200 inside, 20 us hidden
        event("gloo:all_reduce", 500, 10, cat="user_annotation", tid=9),  # outside every step
    ]}
    steps, compute, comm, kind = classify(trace)
    assert kind == "cpu" and steps == [(0.0, 100.0), (100.0, 200.0)]
    metrics = trace_metrics(trace)
    comm_us, comp_us, both_us = 30 + 50, 50 + 40, 10 + 20
    assert metrics["hidden_comm_fraction"] == pytest.approx(both_us / comm_us)
    assert metrics["overlap_ratio"] == pytest.approx(both_us / max(comm_us, comp_us))
    assert metrics["comm_ms"] == pytest.approx(comm_us / 2 / 1e3)  # per step
    assert metrics["exposed_comm_ms"] == pytest.approx((comm_us - both_us) / 2 / 1e3)


def test_trace_without_communication_has_no_hidden_fraction() -> None:
    metrics = trace_metrics({"traceEvents": [event("ProfilerStep#0", 0, 10), event("aten::mm", 0, 5)]})
    assert math.isnan(metrics["hidden_comm_fraction"]) and metrics["comm_ms"] == 0 and metrics["compute_ms"] == 0.005


@pytest.mark.parametrize(
    ("options", "fragment"),
    [({"active": 0}, "profiler.active=0: must be an integer >= 1"), ({"wait": -1}, "profiler.wait=-1"),
     ({"enabled": "yes"}, "profiler.enabled='yes'"), ({"steps": 3}, "profiler.steps=3: unknown key")],
)
def test_profiler_options_are_validated(options: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        OverlapMonitor(profiler=options)


def test_overlapping_step_windows_count_each_moment_once() -> None:
    trace = {"traceEvents": [
        event("ProfilerStep#1", 0, 100),
        event("ProfilerStep#2", 80, 120),  # (marks that overlap: each moment must still count once)
        event("aten::mm", 0, 50),
        event("gloo:all_gather", 85, 20, cat="user_annotation", tid=9),
    ]}
    metrics = trace_metrics(trace)
    assert metrics["comm_ms"] == pytest.approx(0.020 / 2)  # 20 us over 2 steps, not 40
    assert metrics["hidden_comm_fraction"] == 0.0


def test_gpu_kernels_count_even_outside_the_gpu_step_marks() -> None:
    # on the H200 the GPU's ProfilerStep marks covered 0.06 ms of each step's 4 ms of kernels: kernels are not cut
    trace = {"traceEvents": [
        event("ProfilerStep#1", 0, 50, cat="user_annotation"),
        event("ProfilerStep#1", 10, 5, cat="gpu_user_annotation", pid=0),
        event("gemm", 100, 200, cat="kernel", pid=0, tid=7),
        event("ncclDevKernel_AllReduce", 250, 100, cat="kernel", pid=0, tid=17),
    ]}
    metrics = trace_metrics(trace)
    assert metrics["compute_ms"] == pytest.approx(0.2) and metrics["comm_ms"] == pytest.approx(0.1)
    assert metrics["hidden_comm_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize(("run", "rank", "hta"), [
    ("hta-traces-2gpu-2026-11-29", 0, 0.0666),  # the 10.8M char GPT: communication mostly exposed
    ("hta-traces-2gpu-2026-11-29", 1, 0.0),
    ("hta-traces-gpt2s-2gpu-2026-11-30", 0, 0.4954),  # GPT-2 small (gpu2-gpt2s --trace): about half hidden
    ("hta-traces-gpt2s-2gpu-2026-11-30", 1, 0.4166),
])
def test_real_two_gpu_traces_agree_with_holistic_trace_analysis(run: str, rank: int, hta: float) -> None:
    # traces of 2 x H200 static_dist runs (profiler mode), and HTA 0.5.0's get_comm_comp_overlap on them
    # (hta-check-2gpu-2026-11-29.json; gpu2-gpt2s-2026-11-30.json's hta_check): the target is agreement within 0.05
    import gzip
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", run, f"rank{rank}.pt.trace.json.gz")
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    assert trace["distributedInfo"]["rank"] == rank
    assert abs(trace_metrics(trace)["hidden_comm_fraction"] - hta) <= 0.05
