"""How much the emulated link's kernel slows GPT-2 small's backward, per millisecond it holds ``s`` SMs (one GPU).

``benchmarks/calibrate_link.py`` reads from the real 2-GPU traces how much compute NCCL slows (added compute ms per
ms of NCCL beside it); this measures the same figure for the emulation (``lightning_static_dist.simulate.link``'s
``hold_sms``, which holds SMs but moves no bytes), so that the link's ``sms`` can be chosen to reproduce the real one.

Each iteration runs the nanoGPT-shaped GPT-2 small of ``gpuN_gpt2s.py`` (compiled, bf16 autocast, batch 16 x 1024)
forward, then its backward timed by CUDA events, with the link's kernel started on a side stream at the backward's
start and spinning for twice the backward's time, so that it holds its SMs for the whole backward. The SM counts
take turns iteration by iteration (drift falls on all alike). The figure per ``s``: (backward_s - backward_0) /
backward_s, the added ms per ms held.

    python benchmarks/sm_hold_slowdown.py --out "$OUT/sm-hold.json"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", default="0,4,8,16,24,32,48,66")
    parser.add_argument("--iters", type=int, default=24)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch

    from _gpt2s import FULL, new_nanogpt
    from lightning_static_dist.simulate.link import hold_sms

    torch.set_float32_matmul_precision("high")
    device = torch.device("cuda", 0)
    model = new_nanogpt(FULL).to(device)
    step = torch.compile(model)
    x = torch.randint(0, FULL["vocab_size"], (FULL["batch"], FULL["block_size"]), device=device)
    y = torch.randint(0, FULL["vocab_size"], (FULL["batch"], FULL["block_size"]), device=device)
    side = torch.cuda.Stream(device)
    counts = [int(s) for s in args.sms.split(",")]

    def backward_ms(sms: int, hold_s: float) -> float:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = step(x, y)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if sms:
            side.wait_event(start)
            hold_sms(side, sms, hold_s, 0.0, (1.0, 1.0), None)
        loss.backward()
        end.record()
        torch.cuda.synchronize()  # (the side stream too: the next iteration starts on a quiet GPU)
        return start.elapsed_time(end)

    for _ in range(8):
        base = backward_ms(0, 0.0)
    hold_s = 2 * base / 1e3
    times: dict[int, list[float]] = {s: [] for s in counts}
    for i in range(args.iters):
        for s in counts[i % len(counts):] + counts[:i % len(counts)]:
            times[s].append(backward_ms(s, hold_s))
    b0 = statistics.median(times[0]) if 0 in times else base
    rows = []
    for s in counts:
        med = statistics.median(times[s])
        q = statistics.quantiles(times[s], n=4)
        rows.append({"sms": s, "backward_ms_median": round(med, 3), "backward_ms_q1": round(q[0], 3),
                     "backward_ms_q3": round(q[2], 3), "added_ms_per_ms_held": round((med - b0) / med, 4)})
        print(f"sms {s:3}: backward {med:7.3f} ms (q1 {q[0]:.3f}, q3 {q[2]:.3f}); "
              f"added {(med - b0) / med:.3f} ms per ms held")
    if args.out:
        record = {
            "scenario": "sm-hold-slowdown", "date": "2026-12-04",
            "hardware": {"gpus": 1, "gpu": torch.cuda.get_device_name(0),
                         "sms": torch.cuda.get_device_properties(0).multi_processor_count},
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "command": "python benchmarks/sm_hold_slowdown.py --sms " + args.sms + f" --iters {args.iters}",
            "method": __doc__.split("\n\n")[1] if __doc__ else None,
            "rows": rows,
            "summary": {"backward_ms": round(b0, 3), "hold_ms": round(hold_s * 1e3, 3),
                        "added_ms_per_ms_held": {str(r["sms"]): r["added_ms_per_ms_held"] for r in rows}},
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
