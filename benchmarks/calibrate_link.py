"""Calibrate the emulated link (``strategy.simulate.link``) from real 2-GPU kernel timelines, not from step times.

Reads the committed ``torch.profiler`` traces of two-rank NCCL runs (one gzipped Chrome trace per rank) and derives:

- **the two rates.** Every gradient all-reduce is one NCCL kernel per rank. A rank's kernel starts when its own
  launch reaches the GPU and then spins until the peer's kernel starts, so bytes move only from the later of the two
  starts to the kernel's end: that stretch is the *transfer*, the rest of the earlier rank's kernel is *wait*
  (rank skew). The transfer is split into the part with a compute kernel running on either rank (busy: the slower
  peer paces a two-rank ring) and the rest (idle). With the bytes known from each kernel's message size,
  ``bytes = busy_gbps * busy_s + idle_gbps * idle_s`` over all buckets is a least-squares fit of the two rates;
  kernels of different busy fractions make it solvable. The fixed cost per all-reduce (the link's ``2 (N-1)
  latency_us``) is chosen with them: the one, on a 0.5 us grid, whose fit predicts the buckets' transfer times best
  (root-mean-square relative error); the tiny all-reduces' own time is printed beside it.
- **the compute slowdown.** The same compute kernel (name and position in its step) runs 3 steps x 2 ranks = 6
  times; the instances with no NCCL kernel beside them give its base duration. Each instance's excess over that
  base is fitted as ``a * transfer_beside_ms + c * wait_beside_ms``: ``a`` is added compute per ms of NCCL moving
  bytes beside compute, ``c`` per ms of NCCL only holding its SMs (spinning for the peer).
- **the SMs the emulated link must hold**: the ``sms`` whose one-GPU emulation adds ``a`` ms per ms held, read
  (linearly between the measured counts) from ``benchmarks/sm_hold_slowdown.py``'s record, ``SM_RECORD``.

The spread of each figure is given over leave-one-step-out refits and over each rank and trace set alone.

    python benchmarks/calibrate_link.py --out benchmarks/results/link-calibration-traces-2026-12-04.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from profile_summary import _union as union  # (benchmarks/ is on sys.path: this script's own folder)

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE_SETS = {
    "gpt2s-2026-11-30": "results/hta-traces-gpt2s-2gpu-2026-11-30",
    "charlm-2026-11-29": "results/hta-traces-2gpu-2026-11-29",
}
"""The committed 2 x H200 traces: GPT-2 small under static_dist (25 MB buckets) and the char-level GPT (2 buckets)."""

DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1}
TINY_BYTES = 64 << 10
"""All-reduces below this size measure the latency (their bytes take < 1 us at any rate seen here)."""
FIT_BYTES = 1 << 20
"""All-reduces from this size on enter the rate fit."""

SM_RECORD = "results/sm-hold-slowdown-1gpu-2026-12-04.json"
"""The emulated link's kernel beside GPT-2 small's backward on one H200: added ms per ms held, per SM count."""
LATENCY_GRID_US = [x / 2 for x in range(0, 81)]
"""Candidate fixed costs per all-reduce (us), 0 to 40."""
LINK_SM_GBPS = 65.0
"""Per-SM bandwidth kept from the two-regime link (NCCL's cost-model figure per all-reduce CTA on Hopper); the
traces cannot give it: their NCCL kernels all ran with the same 24 CTAs."""


@dataclass
class Rank:
    """One rank's trace: its gradient all-reduce kernels and compute kernels (every non-NCCL kernel, copy, fill)."""

    allreduces: list[dict] = field(default_factory=list)
    compute: list[dict] = field(default_factory=list)
    barriers: list[float] = field(default_factory=list)
    """Start of each step's first NCCL kernel on the compute stream (Lightning's barrier): the step boundaries."""
    meta: dict[str, Any] = field(default_factory=dict)


def load_rank(path: str) -> Rank:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    rank = Rank(meta={"gpu": trace["deviceProperties"][0]["name"],
                      "sms": trace["deviceProperties"][0]["numSms"],
                      "nccl": trace["distributedInfo"].get("nccl_version"),
                      "cuda_runtime": trace.get("cuda_runtime_version")})
    for e in sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"]):
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e["args"]
        if "nccl" in e["name"].lower():
            if args.get("Collective name") == "allreduce":
                nbytes = args["In msg nelems"] * DTYPE_BYTES[args["dtype"]]
                rank.allreduces.append({"ts": e["ts"], "end": e["ts"] + e["dur"], "bytes": nbytes,
                                        "ctas": args["grid"][0]})
            elif args.get("Collective name") == "barrier":
                rank.barriers.append(e["ts"])
        else:
            rank.compute.append({"name": e["name"], "ts": e["ts"], "end": e["ts"] + e["dur"]})
    return rank


def covered(a: float, b: float, intervals: list[tuple[float, float]]) -> float:
    """Length of [a, b] covered by ``intervals`` (a union, sorted; a linear scan is enough at these sizes)."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals if x < b and y > a)


def step_of(ts: float, barriers: list[float]) -> int:
    return max(0, sum(b <= ts for b in barriers) - 1)


def transfers(name: str, ranks: list[Rank]) -> list[dict]:
    """One row per all-reduce: its bytes, transfer (from the later start to the end, mean of the ranks' ends),
    the busy part of it (compute on either rank), each rank's wait, and the steps' index."""
    compute = [union([(k["ts"], k["end"]) for k in r.compute]) for r in ranks]
    rows = []
    seq = defaultdict(int)
    for pair in zip(*(r.allreduces for r in ranks)):
        if len({k["bytes"] for k in pair}) != 1:
            raise SystemExit(f"{name}: the ranks' all-reduce sequences differ ({[k['bytes'] for k in pair]} bytes)")
        start = max(k["ts"] for k in pair)
        end = statistics.fmean(k["end"] for k in pair)
        either = union([iv for c in compute for iv in c if iv[1] > start and iv[0] < end])
        step = step_of(pair[0]["ts"], ranks[0].barriers)
        rows.append({"trace": name, "step": step, "bucket": seq[step], "bytes": pair[0]["bytes"],
                     "ctas": pair[0]["ctas"], "transfer_us": end - start,
                     "busy_us": covered(start, end, either),
                     "busy_us_per_rank": [round(covered(start, end, c), 1) for c in compute],
                     "wait_us": [round(start - k["ts"], 1) for k in pair],
                     "end_skew_us": round(abs(pair[0]["end"] - pair[1]["end"]), 1),
                     "start": start, "end": end, "starts": [k["ts"] for k in pair]})
        seq[step] += 1
    return rows


def fit_rates(rows: list[dict], latency_us: float) -> Optional[tuple[float, float]]:
    """Least squares of bytes = busy_gbps * busy_s + idle_gbps * idle_s, each part net of its share of the fixed
    cost ``latency_us``; ``None`` where the busy fractions span less than half of [0, 1] (the two rates cannot be
    told apart)."""
    fractions = [r["busy_us"] / r["transfer_us"] for r in rows]
    if len(rows) < 2 or max(fractions) - min(fractions) < 0.5:
        return None
    sbb = sii = sbi = syb = syi = 0.0
    for r in rows:
        net = max(r["transfer_us"] - latency_us, 1e-3) / r["transfer_us"]
        tb, ti = r["busy_us"] * net * 1e-6, (r["transfer_us"] - r["busy_us"]) * net * 1e-6
        y = r["bytes"] / 1e9
        sbb, sii, sbi, syb, syi = sbb + tb * tb, sii + ti * ti, sbi + tb * ti, syb + y * tb, syi + y * ti
    det = sbb * sii - sbi * sbi
    return (syb * sii - syi * sbi) / det, (syi * sbb - syb * sbi) / det


def time_error(rows: list[dict], latency_us: float, rates: tuple[float, float]) -> float:
    """Root-mean-square relative error of the predicted transfer times: latency + bytes / (the rates mixed by each
    kernel's busy fraction)."""
    busy, idle = rates
    errs = []
    for r in rows:
        f = r["busy_us"] / r["transfer_us"]
        predicted = latency_us + r["bytes"] / 1e3 / (f * busy + (1 - f) * idle)
        errs.append((predicted - r["transfer_us"]) / r["transfer_us"])
    return math.sqrt(statistics.fmean(e * e for e in errs))


def fit_link(rows: list[dict], latency_us: Optional[float] = None) -> Optional[dict[str, float]]:
    """The two rates at ``latency_us`` (total per all-reduce), or with the latency of the grid that fits best."""
    best = None
    for lat in [latency_us] if latency_us is not None else LATENCY_GRID_US:
        rates = fit_rates(rows, lat)
        if rates is None or min(rates) <= 0:
            continue
        err = time_error(rows, lat, rates)
        if best is None or err < best["time_error"]:
            best = {"latency_total_us": lat, "busy_gbps": rates[0], "idle_gbps": rates[1], "time_error": err}
    return best


def slowdown(ranks: list[Rank], rows: list[dict], only_rank: Optional[int] = None,
             skip_step: Optional[int] = None) -> dict[str, Any]:
    """Fit each compute instance's excess over its kernel's base duration to the NCCL time beside it (one rank's
    instances, or every step but one, where asked)."""
    instances = []
    for r, rank in enumerate(ranks):
        if only_rank is not None and r != only_rank:
            continue
        xfer = union([(row["start"], row["end"]) for row in rows])
        wait = union([(row["starts"][r], row["start"]) for row in rows if row["start"] > row["starts"][r]])
        ordinal: dict[tuple[int, str], int] = defaultdict(int)
        for k in rank.compute:
            if k["ts"] < rank.barriers[0]:
                continue
            step = step_of(k["ts"], rank.barriers)
            key = (k["name"], ordinal[(step, k["name"])])
            ordinal[(step, k["name"])] += 1
            if step == skip_step:
                continue
            instances.append({"key": key, "step": step, "rank": r, "dur": k["end"] - k["ts"],
                              "xfer": covered(k["ts"], k["end"], xfer), "wait": covered(k["ts"], k["end"], wait)})
    by_key = defaultdict(list)
    for i in instances:
        by_key[i["key"]].append(i)
    used, base_missing = [], 0
    for group in by_key.values():
        alone = [i["dur"] for i in group if i["xfer"] == 0 and i["wait"] == 0]
        if len(group) < 2 or not alone:
            base_missing += len(group)
            continue
        base = statistics.median(alone)
        for i in group:
            i["excess"] = i["dur"] - base
            used.append(i)
    sxx = sww = sxw = syx = syw = 0.0
    for i in used:
        x, w, y = i["xfer"], i["wait"], i["excess"]
        sxx, sww, sxw, syx, syw = sxx + x * x, sww + w * w, sxw + x * w, syx + y * x, syw + y * w
    det = sxx * sww - sxw * sxw
    a = (syx * sww - syw * sxw) / det if det > 0 else None
    c = (syw * sxx - syx * sxw) / det if det > 0 else None
    beside = [i for i in used if i["xfer"] > 0]
    return {"ms_per_ms_transfer": a, "ms_per_ms_wait": c,
            "ratio_transfer": (sum(i["excess"] for i in beside) / sum(i["xfer"] for i in beside)) if beside else None,
            "instances": len(used), "instances_beside_transfer": len(beside), "instances_without_base": base_missing,
            "xfer_ms": sum(i["xfer"] for i in used) / 1e3, "wait_ms": sum(i["wait"] for i in used) / 1e3}


def sms_for(ms_per_ms: float, curve: list[tuple[int, float]]) -> dict[str, Any]:
    """The SMs an emulated link must hold to add ``ms_per_ms``: linear between the measured (SMs, ms/ms) points."""
    for (s0, g0), (s1, g1) in zip(curve, curve[1:]):
        if g0 <= ms_per_ms <= g1:
            return {"sms": round(s0 + (ms_per_ms - g0) / (g1 - g0) * (s1 - s0)), "note": None}
    edge = curve[0] if ms_per_ms < curve[0][1] else curve[-1]
    return {"sms": edge[0], "note": f"outside the measured curve: {edge[0]} SMs add {edge[1]:.3f} ms/ms"}


def sm_curve(root: str) -> list[tuple[int, float]]:
    with open(os.path.join(root, SM_RECORD)) as f:
        record = json.load(f)
    return sorted((r["sms"], r["added_ms_per_ms_held"]) for r in record["rows"])


def spread(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None]
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3), "n": len(values)} if values else {}


def analyse(root: str) -> dict[str, Any]:
    ranks_by_set = {name: [load_rank(os.path.join(root, rel, f"rank{r}.pt.trace.json.gz")) for r in (0, 1)]
                    for name, rel in TRACE_SETS.items()}
    rows = [row for name, ranks in ranks_by_set.items() for row in transfers(name, ranks)]
    tiny = [r["transfer_us"] for r in rows if r["bytes"] < TINY_BYTES]
    big = [r for r in rows if r["bytes"] >= FIT_BYTES]
    link = fit_link(big)
    for r in big:
        r["busy_fraction"] = r["busy_us"] / r["transfer_us"]
        r["gbps"] = r["bytes"] / (r["transfer_us"] - link["latency_total_us"]) / 1e3
    variants: dict[str, Optional[dict[str, float]]] = {
        "latency of the tiny all-reduces": fit_link(big, statistics.median(tiny))}
    for name in TRACE_SETS:
        variants[f"{name} only"] = fit_link([r for r in big if r["trace"] == name])
        for step in sorted({r["step"] for r in big if r["trace"] == name}):
            variants[f"without {name} step {step}"] = fit_link(
                [r for r in big if not (r["trace"] == name and r["step"] == step)])
    for rank in (0, 1):  # busy = compute on this rank alone, as if the other rank did not pace the ring
        variants[f"busy = compute on rank {rank}"] = fit_link(
            [{**r, "busy_us": r["busy_us_per_rank"][rank]} for r in big])
    slow: dict[str, dict[str, Any]] = {}
    for name, ranks in ranks_by_set.items():
        mine = [r for r in rows if r["trace"] == name]
        slow[name] = slowdown(ranks, mine)
        for rank in (0, 1):
            slow[f"{name} rank {rank}"] = slowdown(ranks, mine, only_rank=rank)
        for step in sorted({r["step"] for r in mine}):
            slow[f"{name} without step {step}"] = slowdown(ranks, mine, skip_step=step)
    waits = {}  # per trace and rank: ms a step's NCCL kernels spin for the peer (the skew the emulation leaves out)
    for name in TRACE_SETS:
        mine = [r for r in rows if r["trace"] == name]
        steps = len({r["step"] for r in mine})
        for rank in (0, 1):
            waits[f"{name} rank {rank}"] = sum(r["wait_us"][rank] for r in mine) / steps / 1e3
    return {"big": big, "tiny": tiny, "link": link, "variants": variants, "slowdown": slow, "waits": waits,
            "meta": ranks_by_set[next(iter(TRACE_SETS))][0].meta}


def headline_slowdown(slow: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[float]]:
    """The fit over the trace set with the most NCCL time beside compute, and the spread over the fits that have at
    least 1 ms of it (the char-level GPT's buckets barely meet compute)."""
    enough = {k: v for k, v in slow.items() if v["xfer_ms"] >= 1.0 and v["ms_per_ms_transfer"] is not None}
    whole = [k for k in TRACE_SETS if k in enough]
    best = max(whole, key=lambda k: enough[k]["xfer_ms"])
    return {"name": best, **enough[best]}, [v["ms_per_ms_transfer"] for v in enough.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the record (JSON) here")
    args = parser.parse_args()
    res = analyse(HERE)
    link = res["link"]
    print(f"{'trace':18} {'step':>4} {'bkt':>3} {'MB':>7} {'xfer us':>8} {'busy':>5} {'GB/s':>6} "
          f"{'wait r0':>8} {'wait r1':>8}")
    for r in res["big"]:
        print(f"{r['trace']:18} {r['step']:4} {r['bucket']:3} {r['bytes'] / 1e6:7.1f} {r['transfer_us']:8.1f} "
              f"{r['busy_fraction']:5.2f} {r['gbps']:6.1f} {r['wait_us'][0]:8.1f} {r['wait_us'][1]:8.1f}")
    print(f"\nfit over {len(res['big'])} all-reduces >= 1 MB: busy {link['busy_gbps']:.0f} GB/s, idle "
          f"{link['idle_gbps']:.0f} GB/s, {link['latency_total_us']:g} us per all-reduce (rms time error "
          f"{link['time_error']:.3f}); tiny all-reduces: {spread(res['tiny'])} us")
    for k, v in res["variants"].items():
        print(f"  {k:40} " + (f"busy {v['busy_gbps']:.0f}, idle {v['idle_gbps']:.0f}, latency "
                              f"{v['latency_total_us']:g} us, error {v['time_error']:.3f}" if v else "not separable"))
    for k, v in res["slowdown"].items():
        a, c = v["ms_per_ms_transfer"], v["ms_per_ms_wait"]
        print(f"slowdown {k:38} " + (f"a={a:.3f} ms/ms beside a transfer, c={c:.3f} beside a wait " if a is not None
                                     else "no fit ") + f"({v['instances']} kernels, {v['xfer_ms']:.1f} ms beside)")
    head, values = headline_slowdown(res["slowdown"])
    curve = sm_curve(HERE)
    sms = sms_for(head["ms_per_ms_transfer"], curve)
    sms["range"] = [sms_for(min(values), curve)["sms"], sms_for(max(values), curve)["sms"]]
    print("NCCL spinning for the peer, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in res["waits"].items()))
    print(f"slowdown {head['ms_per_ms_transfer']:.3f} ms/ms ({spread(values)}): sms {sms}")
    spec = (f"tr={link['busy_gbps']:.0f},{link['latency_total_us'] / 2:g},{sms['sms']},{link['idle_gbps']:.0f},"
            f"{LINK_SM_GBPS:g}")
    print(f"link: --link {spec}")
    if args.out:
        write_record(args.out, res, head, values, sms, spec)


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def write_record(path: str, res: dict[str, Any], head: dict[str, Any], values: list[float], sms: dict[str, Any],
                 spec: str) -> None:
    link, fits = res["link"], {k: v for k, v in res["variants"].items() if v}
    keep = ("trace", "step", "bucket", "bytes", "ctas", "transfer_us", "busy_us", "busy_us_per_rank", "wait_us",
            "end_skew_us", "busy_fraction", "gbps")
    record = {
        "scenario": "link-calibration-traces",
        "date": "2026-12-04",
        "hardware": {"gpus": 2, "gpu": res["meta"]["gpu"], "sms_per_gpu": res["meta"]["sms"],
                     "note": "of the traces (2 x H200, NVLink, one host); the analysis runs on CPU"},
        "versions": {"torch": "2.11.0+cu130 (the 2026-11-30 record's)", "nccl": res["meta"]["nccl"], "cuda_runtime": res["meta"]["cuda_runtime"]},
        "command": "python benchmarks/calibrate_link.py --out benchmarks/results/link-calibration-traces-2026-12-04.json",
        "sources": {**{k: f"benchmarks/{v}/rank{{0,1}}.pt.trace.json.gz" for k, v in TRACE_SETS.items()},
                    "sm_curve": f"benchmarks/{SM_RECORD}"},
        "method": " ".join(" ".join(__doc__.split("\n\n")[1:3]).split()),
        "rows": rounded([{k: r[k] for k in keep} for r in res["big"]]),
        "fits": rounded({"all": link, **res["variants"]}),
        "slowdown": rounded(res["slowdown"]),
        "summary": rounded({
            "busy_gbps": link["busy_gbps"], "idle_gbps": link["idle_gbps"],
            "busy_gbps_spread": spread([v["busy_gbps"] for v in fits.values()]),
            "idle_gbps_spread": spread([v["idle_gbps"] for v in fits.values()]),
            "transfer_time_error_rms": link["time_error"],
            "latency_us": link["latency_total_us"] / 2, "latency_per_allreduce_us": link["latency_total_us"],
            "latency_per_allreduce_us_spread": spread([v["latency_total_us"] for v in fits.values()]),
            "tiny_allreduce_us": spread(res["tiny"]),
            "slowdown_ms_per_ms": head["ms_per_ms_transfer"], "slowdown_from": head["name"],
            "slowdown_ms_per_ms_spread": spread(values),
            "slowdown_ms_per_ms_wait": head["ms_per_ms_wait"],
            "nccl_wait_ms_per_step": res["waits"],
            "sms": sms["sms"], "sms_spread": sms["range"], "sms_note": sms["note"],
            "sm_gbps": LINK_SM_GBPS, "sm_gbps_from": "kept from the two-regime link; the traces cannot give it",
            "link_spec": spec, "benchmark_flag": f"--link {spec}",
        }),
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
