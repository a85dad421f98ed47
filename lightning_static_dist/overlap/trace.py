"""Profiler mode: metrics from a ``torch.profiler`` Chrome trace, computed the way Holistic Trace Analysis does.

The trace is the ground truth the recorder's cheap timestamps are checked against. Within each ``ProfilerStep#N``
window of one rank's trace:

- on GPU (the trace has kernels): communication = GPU kernels whose name contains ``nccl``; compute = every other
  kernel; memory copies and sets are neither — HTA's classification of kernels. Kernels are not cut by the steps'
  marks (a step's kernels run after its CPU mark, and the GPU marks need not cover them): all
  kernels of the trace count, which holds only the profiled steps;
- on CPU (Gloo: no kernels): communication = the ``gloo:<collective>`` ranges the process group's worker threads
  record while a collective runs; compute = the operators on the training thread (the thread of the
  ``ProfilerStep`` ranges), except the ``c10d::`` calls that only issue collectives.

Each step gives the same figures as :func:`~lightning_static_dist.overlap.intervals.step_metrics`
(``overlap_ratio``, ``hidden_comm_fraction``, ``comm_ms``, ``compute_ms``, ``exposed_comm_ms``); over several
steps the ratios are taken of the summed times (HTA: overlapped communication time / communication time over the
trace) and the times are per step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_static_dist.overlap.intervals import Interval, intersection, merge, total

#: Metrics the trace yields, logged as ``static_dist/trace_<name>``.
TRACE_METRICS = ("overlap_ratio", "hidden_comm_fraction", "comm_ms", "compute_ms", "exposed_comm_ms")

_MEMORY_KERNELS = ("memcpy", "memset")


def _complete_events(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _span(event: Mapping[str, Any]) -> Interval:
    start = float(event["ts"])
    return start, start + float(event["dur"])


def classify(trace: Mapping[str, Any]) -> tuple[list[Interval], list[Interval], list[Interval], str]:
    """``(step windows, compute, communication, kind)`` of one rank's trace, in microseconds; kind is ``gpu``/``cpu``.

    Example::

        steps, compute, comm, kind = classify(json.load(open("rank0.pt.trace.json")))
    """
    events = _complete_events(trace)
    marks = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    # a CUDA trace marks each step twice: on the CPU (user_annotation) and on the GPU (gpu_user_annotation)
    step_events = [e for e in marks if e.get("cat") != "gpu_user_annotation"]
    steps = [_span(e) for e in step_events] or [_span(e) for e in marks]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        comm = [_span(e) for e in kernels if "nccl" in e["name"].lower()]
        compute = [_span(e) for e in kernels
                   if "nccl" not in e["name"].lower() and not any(m in e["name"].lower() for m in _MEMORY_KERNELS)]
        return steps, compute, comm, "gpu"
    main_threads = {(e.get("pid"), e.get("tid")) for e in step_events}
    comm = [_span(e) for e in events if str(e.get("name", "")).startswith(("gloo:", "nccl:"))]
    compute = [
        _span(e) for e in events
        if e.get("cat") == "cpu_op" and (e.get("pid"), e.get("tid")) in main_threads
        and not str(e.get("name", "")).startswith(("c10d::", "ProfilerStep#"))
    ]
    return steps, compute, comm, "cpu"


def _clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def trace_metrics(trace: Mapping[str, Any]) -> dict[str, float]:
    """The overlap metrics of one rank's trace over its profiled steps (NaN where there is nothing to measure).

    Example::

        >>> trace = {"traceEvents": [
        ...     {"ph": "X", "name": "ProfilerStep#3", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        ...     {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 0, "dur": 60, "pid": 0, "tid": 7},
        ...     {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 40, "dur": 40, "pid": 0, "tid": 8}]}
        >>> trace_metrics(trace)["hidden_comm_fraction"]
        0.5
    """
    steps, compute, comm, kind = classify(trace)
    count = len(steps)
    if kind == "gpu" or not steps:  # kernels: the whole trace (see the module's docstring); no marks: likewise
        spans = compute + comm
        steps = [(min(s for s, _ in spans), max(e for _, e in spans))] if spans else []
    # windows can overlap (a step's collectives still running into the next step's mark): count each moment once
    comm_us = comp_us = both_us = 0.0
    for window in merge(steps):
        step_comm, step_comp = _clip(comm, window), _clip(compute, window)
        comm_us += total(step_comm)
        comp_us += total(step_comp)
        both_us += intersection(step_comm, step_comp)
    longest = max(comm_us, comp_us)
    return {
        "overlap_ratio": both_us / longest if longest > 0 else math.nan,
        "hidden_comm_fraction": both_us / comm_us if comm_us > 0 else math.nan,
        "comm_ms": comm_us / 1e3 / max(count, 1),
        "compute_ms": comp_us / 1e3 / max(count, 1),
        "exposed_comm_ms": (comm_us - both_us) / 1e3 / max(count, 1),
    }


def load_trace(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)
