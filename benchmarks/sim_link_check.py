"""The emulated link's own pace, against the raw 2-GPU point it is calibrated on (``strategy.simulate.link``).

On 2 x H200 over NVLink a raw NCCL all-reduce of 496 MB fp32 took 1.61 ms (308 GB/s bus bandwidth, NCCL's default
CTAs; DESIGN.md). This times the same all-reduce over the simulated group of world 2, for each ``--link``:

- ``idle``: issued and waited for at once, the GPU otherwise idle (the link's idle regime);
- ``beside_gemm``: issued, then a chain of bf16 GEMMs queued on the compute stream before the wait (the busy
  regime while they run), with the GEMMs' own time alone and beside it (what the held SMs cost them).

    python benchmarks/sim_link_check.py --link nv2=70,5,16,308,65 --out benchmarks/results/sim-link-check-<date>.json

A record of the emulation, simulated on one GPU: not a multi-GPU figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the package, from a checkout)
from _simulated import parse_link  # noqa: E402

RAW_BYTES = 496_000_000
RAW_MS_2GPU = 1.61  # the raw NCCL all-reduce on 2 x H200 (DESIGN.md)


def _time(fn: object, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()  # type: ignore[operator]
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def check(link_text: str, repeats: int) -> dict:
    from lightning_static_dist.simulate.group import set_link

    link = parse_link(link_text)
    set_link(link.config())
    flat = torch.ones(RAW_BYTES // 4, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def idle() -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True).wait()

    def gemms() -> None:
        for _ in range(10):
            torch.mm(a, a)

    def beside_gemm() -> None:
        work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True)
        gemms()
        work.wait()

    for fn in (idle, gemms, beside_gemm):
        _time(fn, 2)
    idle_ms = statistics.median(_time(idle, repeats))
    gemm_ms = statistics.median(_time(gemms, repeats))
    beside_ms = statistics.median(_time(beside_gemm, repeats))
    config = link.config()
    busy_gbps, idle_gbps = config.rates(config.sms) if config is not None else (None, None)
    return {"link": link.describe(), "idle_ms": round(idle_ms, 3), "idle_vs_2gpu_raw": round(idle_ms / RAW_MS_2GPU, 4),
            "idle_error": round(abs(idle_ms - RAW_MS_2GPU) / RAW_MS_2GPU, 4),
            "gemms_alone_ms": round(gemm_ms, 3), "gemms_beside_allreduce_ms": round(beside_ms, 3),
            "predicted_idle_ms": round(RAW_BYTES / (idle_gbps * 1e6), 3) if idle_gbps else None,
            "predicted_busy_ms": round(RAW_BYTES / (busy_gbps * 1e6), 3) if busy_gbps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", action="append", required=True, help="as gpuN_gpt2s.py --link")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from lightning_static_dist.simulate import init_simulated_world

    init_simulated_world(2, timedelta(seconds=60))
    rows = [check(text, args.repeats) for text in args.link]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        record = {"scenario": "sim-link-check", "date": datetime.date.today().isoformat(),
                  "hardware": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__},
                  "command": "python " + " ".join(sys.argv), "simulated": {"world_size": 2, "link": args.link,
                  "note": "simulated on one GPU: the emulation's own pace, not a multi-GPU figure"},
                  "recorded_2gpu": {"raw_allreduce_496MB_ms": RAW_MS_2GPU}, "rows": rows}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
