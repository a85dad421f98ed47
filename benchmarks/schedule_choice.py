"""Benchmark ``schedule-choice``: does ``sync.schedule: measured`` (the default) pick the best schedule on every link?

Reads the records of several device calls of ``gpuN_gpt2s.py --simulate`` (one GPU, a simulated world) in which the
defaults ran pinned to each link (``static_dist~LINK``: the link set from setup on, so the probe measures it) beside
every fixed schedule over the same links, and writes one record,
``benchmarks/results/sim-gpt2s-choice-<date>.json``. Per call, world and link:

    default_vs_best        the defaults' step over the best fixed fp32 schedule's of the same call: overlap, overlap
                           with comm_sms 8, after_backward with and without the optimizer overlap (bf16 shown beside)
    probe                  what the defaults' probe measured against the link it was given: idle and busy rates
                           (the emulated link's at the defaults' SMs), its seconds, its choice

and over calls ``default_vs_best_min`` (the lowest over links, worlds and calls where every fixed fp32 schedule ran;
``_pinned``: of those, where they were pinned to the link too, ``NAME~LINK``, as the defaults are; ``_any``: also
where some did not run, against those that did), ``probe_s`` (the longest),
``probe_error_idle`` / ``_busy`` (the largest |measured - configured| / configured), ``sim_cal_vs_cg_ceiling`` (the
defaults at the two-regime link, world 2, over the ceiling with CUDA graphs: the median over calls of each call's
median), ``sim_free_vs_cg_ceiling_min`` (free links: the worst round of any call, each round paired with the CUDA-graph
ceiling's same round), ``monitor_cost_10`` / ``monitor_cost_1`` (the OverlapMonitor every 10 steps and every step,
pinned to ``--monitor-link``, over the defaults there, minus 1), and ``calls`` (each call's figures and the spread
between calls). A contender a call did not run is n/a for that call, never a fallback.

Simulated on one GPU: not a multi-GPU figure; world 8 is model output.

    python benchmarks/schedule_choice.py --cal cal RECORD1.json RECORD2.json RECORD3.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from typing import Any, Optional

FIXED_FP32 = ("static_dist_overlap", "static_dist_sms8", "static_dist_after", "static_dist_after_noopt")
"""The fixed fp32 schedules the defaults are compared with."""
BESIDE = ("static_dist_overlap_bf16", "static_dist_after_bf16", "plain_ddp_compile", "plain_ddp_compile_b100")
DEFAULTS = "static_dist"
MONITORS = {"monitor_cost_10": "static_dist_monitor10", "monitor_cost_1": "static_dist_monitor"}


def _rows(record: dict[str, Any]) -> dict[tuple[str, int, Optional[str]], dict[str, Any]]:
    return {(r["contender"], r["world"], r["link"]): r for r in record["rows"]
            if r.get("host", "quiet") == "quiet" and r.get("step_ms_median")}


def _round_medians(record: dict[str, Any], key: str) -> dict[int, float]:
    return {rec["round"]: statistics.median(rec["window_s"]) for rec in record["runs"].get(key, [])}


def _spec(record: dict[str, Any], link: str) -> Optional[dict[str, Any]]:
    return next((spec for spec in record["simulated"]["link"] if spec.get("name") == link), None)


def _configured(spec: dict[str, Any], sms: Optional[int]) -> tuple[float, float]:
    """(busy, idle) GB/s the emulated link runs a collective holding ``sms`` SMs at (``LinkConfig.rates``)."""
    busy, idle = spec["gbps"], spec.get("idle_gbps") or spec["gbps"]
    if spec.get("sm_gbps") is None or sms is None:
        return busy, idle
    scale = min(idle, sms * spec["sm_gbps"]) / min(idle, spec["sms"] * spec["sm_gbps"])
    return busy * scale, idle * scale


def one_call(record: dict[str, Any], cal: str, monitor_link: str) -> dict[str, Any]:
    """This call's figures per (world, link)."""
    rows = _rows(record)
    out: dict[str, Any] = {"record": record.get("command"), "links": {}}
    cg = _round_medians(record, "ceiling_cudagraphs@1")
    for (name, world, link), row in sorted(rows.items(), key=lambda kv: (kv[0][1], str(kv[0][2]), kv[0][0])):
        if name != DEFAULTS or not row.get("pinned"):
            continue
        fixed = {c: rows[(c, world, link)]["step_ms_median"] for c in FIXED_FP32 if (c, world, link) in rows}
        pinned_fixed = all(rows[(c, world, link)].get("pinned") for c in fixed)
        beside = {c: rows[(c, world, link)]["step_ms_median"] for c in BESIDE if (c, world, link) in rows}
        best = min(fixed, key=lambda c: fixed[c]) if fixed else None
        missing = [c for c in FIXED_FP32 if c not in fixed]  # (n/a in this call: the ratio is against the others)
        entry: dict[str, Any] = {
            "default_ms": row["step_ms_median"], "fixed_fp32_ms": fixed, "beside_ms": beside, "best_fixed": best,
            "default_vs_best": round(fixed[best] / row["step_ms_median"], 4) if best else None,
            "fixed_pinned": pinned_fixed,
            "fixed_missing": missing,
        }
        measured = row.get("measured")
        spec = _spec(record, link)
        if measured:
            entry["choice"] = measured["choice"]
            entry["probe_s"] = measured["probe_s"]
            entry["predicted_ms"] = measured["predicted_ms"]
            if spec is not None and spec.get("gbps"):
                errors = {}
                for rates in measured["rates"]:
                    busy, idle = _configured(spec, rates["sms"] or spec["sms"])
                    errors[str(rates["sms"] or "default")] = {
                        "idle_gbps": round(rates["idle_gbps"], 2), "busy_gbps": round(rates["busy_gbps"], 2),
                        "configured": [busy, idle], "slowdown": round(rates["slowdown"], 4),
                        "error_idle": round(abs(rates["idle_gbps"] / idle - 1), 4),
                        "error_busy": round(abs(rates["busy_gbps"] / busy - 1), 4)}
                entry["probe"] = errors
        else:
            entry["choice"] = None  # (resolved without a probe: free links)
        ours = _round_medians(record, f"{DEFAULTS}~{link}@sim{world}")
        paired = [round(cg[r] / s, 4) for r, s in sorted(ours.items()) if r in cg]
        entry["vs_cg_ceiling_per_round"] = paired
        entry["vs_cg_ceiling"] = round(statistics.median(paired), 4) if paired else None
        out["links"][f"{link}@{world}"] = entry
        for key, monitor in MONITORS.items():
            mon = rows.get((monitor, world, link))
            if mon is not None and world == 2 and link == monitor_link:
                out[key] = round(mon["step_ms_median"] / row["step_ms_median"] - 1, 4)
    ceiling = rows.get(("ceiling_cudagraphs", 1, None))
    plain = [rows[(c, 2, cal)] for c in ("plain_ddp_compile", "plain_ddp_compile_b100") if (c, 2, cal) in rows]
    if ceiling and plain:
        better = min(plain, key=lambda r: r["step_ms_median"])
        out["plain_ddp_better_vs_cg_ceiling"] = {"contender": better["contender"],
                                                 "ratio": round(ceiling["step_ms_median"] / better["step_ms_median"], 4)}
    return out


def summarise(calls: list[dict[str, Any]], cal: str, probe_calls: Optional[set[int]] = None) -> dict[str, Any]:
    """Over ``calls``; the probe's keys over ``probe_calls`` only (0-based; ``None``: all), the calls that ran the
    probe's code as it lands, with ``_all_calls`` beside them."""
    entries = [(i, key, e) for i, call in enumerate(calls) for key, e in call["links"].items()]
    ratios = [e["default_vs_best"] for _, _, e in entries if e.get("default_vs_best") is not None]
    probed = [(i, e) for i, _, e in entries if probe_calls is None or i in probe_calls]
    probes = [p for _, e in probed for p in (e.get("probe") or {}).values()]
    every_probe = [p for _, _, e in entries for p in (e.get("probe") or {}).values()]
    free = [r for _, key, e in entries if key.startswith("free@") for r in e["vs_cg_ceiling_per_round"]]
    cal2 = [e["vs_cg_ceiling"] for _, key, e in entries if key == f"{cal}@2" and e.get("vs_cg_ceiling")]
    per_key: dict[str, list[float]] = {}
    for _, key, e in entries:
        if e.get("default_vs_best") is not None:
            per_key.setdefault(key, []).append(e["default_vs_best"])
    complete = [e for _, _, e in entries if e.get("default_vs_best") is not None and not e["fixed_missing"]]
    pinned = [e["default_vs_best"] for e in complete if e["fixed_pinned"]]
    summary: dict[str, Any] = {
        "default_vs_best_min": min((e["default_vs_best"] for e in complete), default=None),
        "default_vs_best_min_any": min(ratios) if ratios else None,
        # (the fixed schedules pinned to the link as the defaults are: a worker that switches links window by window
        # ran the same schedule up to 2 % faster or slower than a pinned one in the same call)
        "default_vs_best_min_pinned": min(pinned) if pinned else None,
        "default_vs_best_by_link": {k: {"median": round(statistics.median(v), 4), "min": min(v), "calls": len(v),
                                        "spread": round(max(v) - min(v), 4)} for k, v in sorted(per_key.items())},
        "probe_s": max((e["probe_s"] for _, e in probed if e.get("probe_s") is not None), default=None),
        "probe_error_idle": max((p["error_idle"] for p in probes), default=None),
        "probe_error_busy": max((p["error_busy"] for p in probes), default=None),
        "probe_calls": sorted(i + 1 for i in {i for i, _ in probed}),
        "probe_s_all_calls": max((e["probe_s"] for _, _, e in entries if e.get("probe_s") is not None), default=None),
        "probe_error_idle_all_calls": max((p["error_idle"] for p in every_probe), default=None),
        "probe_error_busy_all_calls": max((p["error_busy"] for p in every_probe), default=None),
        "sim_cal_vs_cg_ceiling": round(statistics.median(cal2), 4) if cal2 else None,
        "sim_cal_vs_cg_ceiling_spread": round(max(cal2) - min(cal2), 4) if len(cal2) > 1 else None,
        "sim_free_vs_cg_ceiling_min": min(free) if free else None,
    }
    for key in MONITORS:
        costs = [call[key] for call in calls if key in call]
        summary[key] = round(statistics.median(costs), 4) if costs else None
    summary["calls"] = len(calls)
    summary["targets"] = {"default_vs_best_min": ">= 0.99", "probe_s": "<= 0.5", "probe_error_idle": "<= 0.10",
                          "probe_error_busy": "<= 0.10", "sim_cal_vs_cg_ceiling": ">= 0.96",
                          "sim_free_vs_cg_ceiling_min": ">= 0.99", "monitor_cost_10": "<= 0.005",
                          "monitor_cost_1": "<= 0.02", "calls": ">= 3"}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", help="gpuN_gpt2s.py --simulate records, one per device call")
    parser.add_argument("--cal", default="cal", help="the two-regime calibrated link's name in the records")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--monitor-link", default=None, help="the link the monitor's contenders were pinned to"
                        " (default: --cal)")
    parser.add_argument("--note", default="")
    parser.add_argument("--probe-calls", default=None, help="comma list of the records (1-based) whose probe is the"
                        " code as it lands: the probe's keys come from those (default: all)")
    parser.add_argument("--probe-check", default=None, help="a sim_probe_check.py record: its summary is added")
    args = parser.parse_args()
    records = []
    for path in args.records:
        with open(path) as f:
            records.append(json.load(f))
    calls = [one_call(record, args.cal, args.monitor_link or args.cal) for record in records]
    today = datetime.date.today().isoformat()
    record = {
        "scenario": "schedule-choice", "date": today,
        "simulated": {"note": "simulated on one GPU: one process as rank 0 of N identical ranks; not a multi-GPU"
                              " figure; world 8 is model output",
                      "world_size": sorted({w for r in records for w in r["simulated"]["world_size"]}),
                      "link": records[0]["simulated"]["link"]},
        "hardware": records[0].get("hardware"), "versions": records[0].get("versions"),
        "command": "python benchmarks/schedule_choice.py " + " ".join(sys.argv[1:]),
        "call_commands": [r.get("command") for r in records],
        "rows": calls, "note": args.note,
        "summary": summarise(calls, args.cal, {int(i) - 1 for i in args.probe_calls.split(",")}
                             if args.probe_calls else None),
    }
    if args.probe_check:
        with open(args.probe_check) as f:
            check = json.load(f)
        record["summary"]["probe_check"] = {"command": check["command"], **{k: v for k, v in check["summary"].items()
                                                                           if k != "targets"}}
    path = os.path.join(args.out_dir, f"sim-gpt2s-choice-{today}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    for i, call in enumerate(calls):
        print(f"call {i + 1}: {call['record']}")
        print(f"  {'link@world':<14} {'default ms':>10} {'best fixed':<24} {'best ms':>8} {'ratio':>7} {'vs CG':>7}  choice")
        for key, e in call["links"].items():
            best = e.get("best_fixed")
            print(f"  {key:<14} {e['default_ms']:>10.2f} {str(best):<24} "
                  f"{(e['fixed_fp32_ms'].get(best) or float('nan')) if best else float('nan'):>8.2f} "
                  f"{e['default_vs_best'] or float('nan'):>7.4f} {e['vs_cg_ceiling'] or float('nan'):>7.4f}  {e.get('choice')}")
    print(json.dumps(record["summary"], indent=1))
    print(f"recorded: {path}")


if __name__ == "__main__":
    main()
