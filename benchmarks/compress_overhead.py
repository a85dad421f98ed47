"""What the compressed path costs besides its collectives: operators per step and where they come from (issue 15).

On a GPU every operator is at least one kernel launch and some host time; the phased reducer's own work — packing,
scaling, casting, checking, polling — is what made bf16 and PowerSGD slower than exact on NVLink. This counts it,
device-independently: 2 Gloo CPU ranks, a GPT-2-shaped model (d=768, ``--layers`` blocks, 256-symbol vocabulary),
the synchroniser with each compressor (buckets 1 MiB + 100 MiB, as the strategy plans them). Per step, on rank 0:

- ``aten_ops``: operators dispatched during ``loss.backward()`` (the round finishes inside it), counted with a
  ``TorchDispatchMode``, and ``compute_ops``: those that launch work (views, slices, transposes and detaches
  left out: metadata only); ``reducer_ops`` / ``reducer_compute_ops`` = minus the exact fp32 run's (backward itself
  is the same);
- ``completion_checks``: ``Work.is_completed()`` calls (the phased reducer's polling), counted by wrapping the
  method for the run;
- ``backward_ms``: median host time of ``loss.backward()`` (2 CPU cores: indicative only).

    python benchmarks/compress_overhead.py --label after           # writes results/compress-overhead-<date>.json
    python benchmarks/compress_overhead.py --label before --src <checkout of an earlier commit>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

from _common import ROOT, spawn_ranks  # (this script's folder is on sys.path)

#: operators that only make a new view of existing memory: no kernel
VIEWS = {"aten.view", "aten.slice", "aten.t", "aten.detach", "aten.permute", "aten.as_strided", "aten.expand",
         "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.transpose", "aten.alias", "aten._reshape_alias",
         "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.reshape", "aten._unsafe_view"}
CONTENDERS = {
    "fp32": None,
    "bf16": {"name": "bf16"},
    "powersgd_r4": {"name": "powersgd", "rank": 4},
    "topk_1pct": {"name": "topk", "density": 0.01},
    "qsgd_8bit": {"name": "qsgd", "levels": 127},
}


def _rank(rank: int, world: int, port: int, src: str, layers: int, steps: int, queue: Any) -> None:
    sys.path.insert(0, src)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_static_dist.compression import CompressingReducer, build_compressor
    from lightning_static_dist import CompressionConfig
    from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    checks = Counter()
    is_completed = dist.Work.is_completed

    def counted(work: Any) -> bool:
        checks["n"] += 1
        return is_completed(work)

    results = {}
    for name, spec in CONTENDERS.items():
        torch.manual_seed(0)
        d = 768
        blocks = [torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d), torch.nn.Linear(3 * d, d),
                                      torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                      torch.nn.Linear(4 * d, d)) for _ in range(layers)]
        model = torch.nn.Sequential(torch.nn.Embedding(256, d), *blocks, torch.nn.Linear(d, 256))
        sync = GradientSynchronizer(model.named_parameters(), capacity=BucketCapacity.from_mib(1, 100))
        if spec is not None:
            sync.reducer = CompressingReducer(build_compressor(CompressionConfig(**spec)), [p.shape for p in sync.parameters])
        sync.attach()
        dist.Work.is_completed = counted
        ops, compute, times, polls = [], [], [], []
        for _ in range(steps):
            x = torch.randint(0, 256, (4, 64))
            loss = model(x).float().logsumexp(-1).mean()
            checks.clear()
            with Count() as count:
                start = time.perf_counter()
                loss.backward()
                times.append(time.perf_counter() - start)
            ops.append(sum(count.ops.values()))
            compute.append(sum(n for op, n in count.ops.items() if op not in VIEWS))
            polls.append(checks["n"])
            for p in model.parameters():
                p.grad = None
        dist.Work.is_completed = is_completed
        sync.detach()
        results[name] = {"aten_ops": ops[-1], "compute_ops": compute[-1], "completion_checks": polls[-1],
                         "backward_ms": round(1e3 * statistics.median(times[1:]), 1),
                         "buckets": len(sync.plan.buckets) if getattr(sync, "plan", None) else None,
                         "top_ops": dict(Counter({k: v for k, v in count.ops.items() if k not in VIEWS}).most_common(8))}
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the record key: before / after ...")
    parser.add_argument("--src", default=ROOT, help="the checkout whose lightning_static_dist is measured")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = spawn_ranks(_rank, 2, args.src, args.layers, args.steps)
    for name, row in results.items():
        row["reducer_ops"] = row["aten_ops"] - results["fp32"]["aten_ops"]
        row["reducer_compute_ops"] = row["compute_ops"] - results["fp32"]["compute_ops"]
        print(f"{args.label:8} {name:12} ops {row['aten_ops']:6} reducer_ops {row['reducer_ops']:6} "
              f"reducer_compute_ops {row['reducer_compute_ops']:6} "
              f"checks {row['completion_checks']:5} backward {row['backward_ms']} ms", flush=True)
    import datetime

    import subprocess

    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"compress-overhead-{datetime.date.today()}.json")
    record = json.load(open(out)) if os.path.exists(out) else {"scenario": "compress-overhead", "layers": args.layers}
    commit = subprocess.run(["git", "-C", args.src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    record[args.label] = {"commit": commit.stdout.strip(), "layers": args.layers, "src_has_changes": bool(subprocess.run(
        ["git", "-C", args.src, "status", "--porcelain", "lightning_static_dist"], capture_output=True,
        text=True).stdout.strip()), "results": results}
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"recorded: {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
