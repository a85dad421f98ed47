"""Summarise ``torch.profiler`` Chrome traces of training steps: where a step's GPU time goes, and what the host did
while the GPU waited.

For each trace (one rank of one job, e.g. ``gpuN_gpt2s.py --profile-steps 3``), over the span from the first to the
last GPU kernel:

- ``compute_ms`` / ``comm_ms``: the union of non-NCCL kernels / of NCCL kernels, every stream; ``exposed_comm_ms``:
  NCCL time with no compute kernel beside it; ``idle_ms``: no kernel at all (the GPU waited for the host);
- ``host_syncs``: the CUDA runtime calls that block the host (stream/device/event synchronize, blocking memcpy),
  each with its count, total ms and the CPU ops it ran under;
- ``host_lead_ms_median``: how far the host runs ahead of the GPU, the median over kernels of (kernel start - its
  launch call's start); ``host_bound_kernel_share``: the share of kernels that started within 0.1 ms of their launch
  (the GPU was waiting for the host to launch them: host-bound stretches);
- ``gaps``: the longest idle stretches, each with the CPU ops that launched the kernel ending it.

Divide by the number of profiled steps for per-step figures (``--steps``).

    python benchmarks/profile_summary.py benchmarks/results/profile-*-rank0.json.gz --steps 3
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from typing import Any

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy\0")
"""Blocking runtime calls (matched on the whole name: ``cudaMemcpy``, not ``cudaMemcpyAsync``)."""


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total


def _enclosing(cpu_ops: list[dict], starts: list[float], event: dict, depth: int = 3) -> list[str]:
    """Names of the ``depth`` innermost CPU ops (same thread) enclosing ``event``, listed outermost first."""
    names = []  # innermost first: among the enclosing ops, the one that started last is the deepest
    i = bisect.bisect_right(starts, event["ts"])
    for op in reversed(cpu_ops[max(0, i - 400):i]):
        if op["tid"] == event["tid"] and op["ts"] <= event["ts"] and op["ts"] + op["dur"] >= event["ts"] + event["dur"]:
            names.append(op["name"])
    return list(reversed(names[:depth]))


def summarise(path: str, steps: int, top: int = 8) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])  # streams interleave
    if not kernels:
        return {"trace": path, "error": "no GPU kernels in the trace"}
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    busy = _union(comm + compute)
    span = (busy[0][0], busy[-1][1])
    cpu_ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")),
                     key=lambda e: e["ts"])
    starts = [e["ts"] for e in cpu_ops]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = {e["args"].get("correlation"): e for e in runtime if "correlation" in e.get("args", {})}

    syncs: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "ms": 0.0, "under": defaultdict(int)})
    for e in runtime:
        if any((e["name"] + "\0").startswith(name) for name in SYNC_CALLS):
            s = syncs[e["name"]]
            s["count"] += 1
            s["ms"] += e["dur"] / 1e3
            s["under"][" > ".join(_enclosing(cpu_ops, starts, e)) or "(no CPU op)"] += 1

    gaps = []
    kernel_starts = [k["ts"] for k in kernels]
    for (_, end), (nxt, _) in zip(busy, busy[1:]):
        if nxt - end > 20:
            at = bisect.bisect_left(kernel_starts, nxt)
            first = kernels[at] if at < len(kernels) else None
            launch = launches.get(first["args"].get("correlation")) if first else None
            gaps.append({"ms": round((nxt - end) / 1e3, 3), "next_kernel": first["name"][:60] if first else None,
                         "launched_under": _enclosing(cpu_ops, starts, launch, depth=4) if launch else None})
    gaps.sort(key=lambda g: -g["ms"])
    leads = sorted(k["ts"] - launches[c]["ts"] for k in kernels if (c := k["args"].get("correlation")) in launches)
    per = 1e3 * steps
    return {
        "trace": path,
        "steps": steps,
        "step_ms": round((span[1] - span[0]) / per, 3),
        "compute_ms": round(_length(compute) / per, 3),
        "comm_ms": round(_length(comm) / per, 3),
        "exposed_comm_ms": round((_length(comm) - _intersection(comm, compute)) / per, 3),
        "idle_ms": round((span[1] - span[0] - _length(busy)) / per, 3),
        "idle_gaps_over_20us": len(gaps),
        "host_lead_ms_median": round(leads[len(leads) // 2] / 1e3, 3) if leads else None,
        "host_bound_kernel_share": round(sum(lead < 100 for lead in leads) / len(leads), 3) if leads else None,
        "kernels_per_step": round(len(kernels) / steps, 1),
        "nccl_kernels_per_step": round(sum("nccl" in k["name"].lower() for k in kernels) / steps, 1),
        "host_syncs": {name: {"count": s["count"], "ms": round(s["ms"], 3), "under": dict(s["under"])}
                       for name, s in syncs.items()},
        "gaps": gaps[:top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steps", type=int, required=True, help="profiled steps per trace")
    parser.add_argument("--top", type=int, default=8, help="longest idle gaps listed")
    args = parser.parse_args()
    for path in args.traces:
        print(json.dumps(summarise(path, args.steps, args.top), indent=1))


if __name__ == "__main__":
    main()
