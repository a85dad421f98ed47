"""Ring-length sensitivity and the communication cost model (issue 15, item 3).

Two parts, one record (``benchmarks/results/cost-model-<date>.json``) and one plot beside it:

``measure``: per-collective latency against world size and payload on this machine's process groups: Gloo on
2 / 4 / 8 CPU ranks (oversubscribed beyond 2 cores: the figures include the scheduler), NCCL on every visible GPU with
``--backend nccl``. All-reduce and all-gather, payloads 4 KiB .. 64 MiB, median of ``--reps`` after 2 warm-ups.
The α-β model (``lightning_static_dist/overlap/cost_model.py``) is fitted to all of them at once; the record keeps
each sample beside its prediction (the fit's relative error) and the fit per world size.

``predict``: GPT-2 small (124M, tied head, the gpuN-gpt2s model's parameters, bucketed as the strategy plans them:
1 MiB first, then ``--bucket-mb``) on ``p`` = 2 .. 64 GPUs and on links these machines do not have: step time and
exposed communication per compressor, and the critical bandwidth below which each compressor beats exact fp32 (and
``sync.reduce_dtype: bf16``) by at least 1 % of the step. The compute timeline is an assumption, stated in the record: ``--compute-ms`` per step
(default: the measured 2 x H200 compute of static_dist, results/gpu2-gpt2s-nanogpt-2026-12-01.json), backward the
last two thirds of it, each bucket ready when backward has produced its share of the gradient bytes (backward order),
the tied embedding at the end. Compressors' encode cost per step: ``--encode-ms name=ms`` (not measured on GPUs yet;
0 by default, which makes every critical bandwidth an upper bound: a compressor is free here).

    python benchmarks/cost_model.py measure --worlds 2 4 8
    python benchmarks/cost_model.py predict --out benchmarks/results/cost-model-<date>.json
    python benchmarks/cost_model.py predict --label predict_phased_reducer --encode-ms bf16=7.3 powersgd_r4=13.3 ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

from _common import ROOT, spawn_ranks  # noqa: E402  (this script's folder is on sys.path)

sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_static_dist.compat import all_gather_single as _all_gather_single  # noqa: E402  (torch 2.11 .. 2.13)
from lightning_static_dist.overlap.cost_model import (  # noqa: E402
    Link,
    Sample,
    bucket_wire,
    critical_bandwidth,
    fit_link,
    predict_step,
)

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
KINDS = ("all_reduce", "all_gather")
#: links these machines do not have; α assumed (typical ring-step latencies), β as named
LINKS = {
    "nvlink_h200": Link(latency_s=5e-6, bandwidth_Bps=308e9),  # β: 496 MB all-reduced in 1.61 ms on 2 x H200
    "400Gb/s": Link(latency_s=8e-6, bandwidth_Bps=50e9),
    "100Gb/s": Link(latency_s=10e-6, bandwidth_Bps=12.5e9),
    "25Gb/s": Link(latency_s=20e-6, bandwidth_Bps=3.125e9),
}
COMPRESSORS = {
    "fp32": None,
    "bf16_reduce": "reduce_dtype",  # sync.reduce_dtype: bf16 (not a compressor: the exact path at 2 bytes)
    "bf16": {"name": "bf16"},
    "powersgd_r4": {"name": "powersgd", "rank": 4},
    "powersgd_r1": {"name": "powersgd", "rank": 1},
    "topk_1pct": {"name": "topk", "density": 0.01},
    "qsgd_8bit": {"name": "qsgd", "levels": 127},
}


# ------------------------------------------------------------------------------------------------- measure


def _time_collectives(rank: int, world: int, port: int, backend: str, reps: int, sizes: list[int],
                      kinds: tuple[str, ...], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    out = []
    for kind in kinds:
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, device=device)
            gathered = torch.empty(world * x.numel(), device=device) if kind == "all_gather" else None
            times = []
            for i in range(reps + 2):
                dist.barrier()
                if backend == "nccl":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(x)
                else:
                    _all_gather_single(gathered, x)
                if backend == "nccl":
                    torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - start)
            # the slowest rank's median: a collective ends when its last rank is done
            t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append((kind, nbytes, world, t.item()))
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def measure(worlds: list[int], backend: str, reps: int, sizes: list[int] = SIZES,
            kinds: tuple[str, ...] = KINDS) -> list[Sample]:
    samples = []
    for world in worlds:
        rows = spawn_ranks(_time_collectives, world, backend, reps, sizes, kinds)
        samples += [Sample(*row) for row in rows]
        print(f"world {world}: " + ", ".join(f"{k} {n >> 10} KiB {t * 1e3:.2f} ms" for k, n, _, t in rows), flush=True)
    return samples


def fit_report(samples: list[Sample]) -> dict[str, Any]:
    link, error = fit_link(samples)
    def own_fit(subset: list[Sample]) -> dict[str, float]:
        own, own_error = fit_link(subset)
        return {"latency_us": round(own.latency_s * 1e6, 2), "bandwidth_GBps": round(own.bandwidth_Bps / 1e9, 3),
                "max_rel_error": round(own_error, 3)}

    per_world = {str(w): own_fit([s for s in samples if s.world == w]) for w in sorted({s.world for s in samples})}
    per_kind = {k: own_fit([s for s in samples if s.kind == k]) for k in sorted({s.kind for s in samples})}
    return {
        "latency_us": round(link.latency_s * 1e6, 2),
        "bandwidth_GBps": round(link.bandwidth_Bps / 1e9, 3),
        "max_rel_error": round(error, 3),
        "median_rel_error": round(statistics.median(
            abs(link.seconds(s.kind, s.nbytes, s.world) / s.seconds - 1) for s in samples), 3),
        "per_world": per_world,
        "per_kind": per_kind,
        "samples": [{"kind": s.kind, "bytes": s.nbytes, "world": s.world, "ms": round(s.seconds * 1e3, 4),
                     "model_ms": round(link.seconds(s.kind, s.nbytes, s.world) * 1e3, 4)} for s in samples],
    }


# ------------------------------------------------------------------------------------------------- predict


def gpt2s_buckets(bucket_mb: float) -> list[list[torch.Size]]:
    """GPT-2 small's gradient shapes, bucketed as the strategy plans them without an observed order (reverse
    registration order; the tied embedding is registered first, so it is in the last bucket)."""
    from benchmarks._gpt2s import FULL, new_nanogpt
    from lightning_static_dist.sync.plan import ParamSpec, plan_buckets

    with torch.device("meta"):
        model = new_nanogpt(FULL)
    params = list(dict.fromkeys(model.parameters()))  # tied: once
    specs = [ParamSpec(i, p.numel(), torch.float32, torch.device("cpu")) for i, p in enumerate(params)]
    plan = plan_buckets(specs, 1 << 20, int(bucket_mb * (1 << 20)))
    return [[params[i].shape for i in b.param_indices] for b in plan.buckets]


def ready_times(buckets: list[list[torch.Size]], compute_s: float) -> tuple[list[float], float]:
    """The assumed timeline: backward the last two thirds of the compute, each bucket ready when backward has
    produced its share of the gradient bytes."""
    sizes = [sum(math.prod(s) for s in b) for b in buckets]
    backward_start, backward_s = compute_s / 3, 2 * compute_s / 3
    ready, done = [], 0
    for n in sizes:
        done += n
        ready.append(backward_start + backward_s * done / sum(sizes))
    return ready, compute_s


def predict(buckets: list[list[torch.Size]], compute_s: float, encode_s: dict[str, float], worlds: list[int],
            links: dict[str, Link]) -> dict[str, Any]:
    from lightning_static_dist.compression import build_compressor
    from lightning_static_dist import CompressionConfig

    ready, backward_end = ready_times(buckets, compute_s)
    wires: dict[str, dict[int, list[Any]]] = {}
    for name, spec in COMPRESSORS.items():
        wires[name] = {}
        for world in worlds:  # an all-gather's payload per rank does not depend on the world; its total does
            if spec is None or spec == "reduce_dtype":
                per_bucket = [bucket_wire(None, b, world, exact_bytes_per_element=2 if spec else 4) for b in buckets]
            else:
                compressor = build_compressor(CompressionConfig(**spec))
                per_bucket = [bucket_wire(compressor, b, world) for b in buckets]
            share = encode_s.get(name, 0.0) / len(buckets)
            wires[name][world] = [type(w)(w.phases, share) for w in per_bucket]

    def step(name: str, world: int, link: Link) -> float:
        return predict_step(ready, wires[name][world], backward_end, compute_s, link, world).step_s

    table = []
    for link_name, link in links.items():
        for world in worlds:
            for name in COMPRESSORS:
                p = predict_step(ready, wires[name][world], backward_end, compute_s, link, world)
                table.append({"link": link_name, "world": world, "contender": name,
                              "bytes_per_step": sum(w.nbytes for w in wires[name][world]),
                              "step_ms": round(p.step_s * 1e3, 3), "comm_ms": round(p.comm_s * 1e3, 3),
                              "exposed_ms": round(p.exposed_s * 1e3, 3)})
    critical = []
    for world in worlds:
        for name in COMPRESSORS:
            if name == "fp32":
                continue
            row = {"world": world, "contender": name}
            for reference in ("fp32", "bf16_reduce"):
                if name == reference:
                    continue
                latency = LINKS["400Gb/s"].latency_s
                bw = critical_bandwidth(lambda b, name=name, world=world, latency=latency: step(name, world, Link(latency, b)),
                                        lambda b, ref=reference, world=world, latency=latency: step(ref, world, Link(latency, b)))
                verdict = "always" if math.isinf(bw) else "never" if bw == 0 else None  # within 1 MB/s .. 10 TB/s
                row[f"vs_{reference}_GBps"] = verdict or round(bw / 1e9, 3)
                row[f"vs_{reference}_Gbps"] = verdict or round(8 * bw / 1e9, 1)
            critical.append(row)
    return {"table": table, "critical_bandwidth": critical}


def plot(prediction: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = prediction["critical_bandwidth"]
    names = sorted({r["contender"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        pts = [(r["world"], r["vs_fp32_Gbps"]) for r in rows
               if r["contender"] == name and isinstance(r.get("vs_fp32_Gbps"), float)]
        encode = prediction["assumptions"]["encode_ms"]
        free = name != "bf16_reduce" and not (isinstance(encode, dict) and name in encode)
        if pts:  # a compressor whose encoding is free here: an upper bound, dashed
            ax.plot(*zip(*pts), marker="o", ls="--" if free else "-", label=name + (" (encode free)" if free else ""))
    for label, link in LINKS.items():
        ax.axhline(8 * link.bandwidth_Bps / 1e9, color="0.6", lw=0.8, ls="--")
        ax.text(2, 8 * link.bandwidth_Bps / 1e9 * 1.05, label, fontsize=7, color="0.4")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("critical bandwidth vs fp32 (Gb/s per link)")
    ax.set_title("GPT-2 small: below its line, a compressor beats exact fp32 (model)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    m.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    m.add_argument("--reps", type=int, default=10)
    m.add_argument("--out", default=None, help="record path (default benchmarks/results/cost-model-<date>.json)")
    p = sub.add_parser("predict")
    p.add_argument("--fit", help="a measure record: adds a 'measured' link with its fitted α and β")
    p.add_argument("--bucket-mb", type=float, default=100.0)
    p.add_argument("--compute-ms", type=float, default=35.63)
    p.add_argument("--encode-ms", nargs="*", default=[], help="NAME=MS: a compressor's encode cost per step")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 16, 32, 64])
    p.add_argument("--label", default="predict", help="the record key (and the plot's name) of this prediction")
    p.add_argument("--out", default=None)
    args = parser.parse_args()
    import datetime

    today = datetime.date.today().isoformat()
    out = args.out or (args.fit if args.cmd == "predict" and args.fit else
                       os.path.join(ROOT, "benchmarks", "results", f"cost-model-{today}.json"))
    record: dict[str, Any] = json.load(open(out)) if os.path.exists(out) else {"scenario": "cost-model", "date": today}
    record.setdefault("versions", {})["torch"] = torch.__version__
    if args.cmd == "measure":
        samples = measure(args.worlds, args.backend, args.reps)
        record[f"measure_{args.backend}"] = {"cores": os.cpu_count(), "reps": args.reps, **fit_report(samples)}
    else:
        links = dict(LINKS)
        fitted = record.get("measure_gloo") if args.fit else None
        if fitted:
            links["measured_gloo_cpu"] = Link(fitted["latency_us"] * 1e-6, fitted["bandwidth_GBps"] * 1e9)
        encode = {k: float(v) / 1e3 for k, v in (item.split("=") for item in args.encode_ms)}
        record[args.label] = {
            "assumptions": {"compute_ms": args.compute_ms, "bucket_mb": args.bucket_mb, "first_bucket_mb": 1,
                            "backward": "the last 2/3 of the compute; bucket ready in proportion to gradient bytes",
                            "encode_ms": {k: v * 1e3 for k, v in encode.items()} or "not measured: 0 (upper bounds)",
                            "links": {k: {"latency_us": v.latency_s * 1e6, "bandwidth_GBps": v.bandwidth_Bps / 1e9}
                                      for k, v in links.items()},
                            "critical_bandwidth_latency_us": LINKS["400Gb/s"].latency_s * 1e6},
            **predict(gpt2s_buckets(args.bucket_mb), args.compute_ms / 1e3, encode, args.worlds, links),
        }
        plot(record[args.label], out.replace(".json", f"-{args.label}.png"))
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"recorded: {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
