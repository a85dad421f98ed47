"""Check the profiler mode's trace-derived ``hidden_comm_fraction`` against Holistic Trace Analysis on the same traces.

Needs CUDA and the optional ``hta`` extra (``pip install HolisticTraceAnalysis``). Two sources of traces:

- ``--trainer`` (the check of issue 9): the char-level GPT trained by ``static_dist`` on every
  visible GPU (NCCL) with ``OverlapMonitor(profiler=...)``; one trace per rank. On one GPU there is no gradient
  communication, so both figures are NaN — the run then only shows that HTA loads the traces and their ranks.
- ``--synthetic`` (default; one process, one GPU): matrix multiplications on the default stream while
  ``all_reduce`` runs on a one-rank NCCL group from a side stream, so the trace holds NCCL kernels that partly
  overlap compute kernels. Checks the interval math and kernel classification, not a training run.

Prints, per rank, ``trace_metrics(...)["hidden_comm_fraction"]`` next to HTA's ``comp_comm_overlap_pctg / 100``;
target: they agree within 0.05.

    python benchmarks/hta_check.py --out-dir "$OUT"
    python benchmarks/hta_check.py --trainer --steps 30 --out-dir "$OUT"
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def synthetic(trace_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    a = torch.randn(4096, 4096, device="cuda")
    grads = [torch.randn(8 << 20, device="cuda") for _ in range(4)]
    side = torch.cuda.Stream()
    os.makedirs(trace_dir, exist_ok=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3),
        on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(trace_dir, "rank0.pt.trace.json")),
    ) as prof:
        for _ in range(5):
            for g in grads:
                a = torch.tanh(a @ a)  # compute
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    dist.all_reduce(g)  # communication, overlapping the next matmul
            torch.cuda.synchronize()
            prof.step()
    dist.destroy_process_group()


def trainer(trace_dir: str, steps: int) -> None:
    import lightning as L

    from lightning_static_dist.examples.charlm import CharDataModule, CharGPT
    from lightning_static_dist import OverlapMonitor, StaticDistStrategy

    L.seed_everything(1234)
    model = CharGPT(block_size=128, n_layer=6, n_head=6, n_embd=384, warmup_steps=10)
    monitor = OverlapMonitor(every_n_steps=1, profiler={"enabled": True, "wait": 5, "warmup": 2, "active": 3})
    trainer = L.Trainer(accelerator="gpu", devices=-1, strategy=StaticDistStrategy(), precision="bf16-mixed",
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=0, callbacks=[monitor], default_root_dir=os.path.dirname(trace_dir))
    trainer.fit(model, datamodule=CharDataModule(block_size=128, batch_size=64, max_bytes=2_000_000))


def compare(trace_dir: str) -> list[dict]:
    from hta.trace_analysis import TraceAnalysis

    from lightning_static_dist.overlap.trace import classify, load_trace, trace_metrics

    hta = TraceAnalysis(trace_dir=trace_dir).get_comm_comp_overlap(visualize=False)
    rows = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.pt.trace.json"))):
        trace = load_trace(path)
        rank = trace.get("distributedInfo", {}).get("rank", 0)
        steps, compute, comm, kind = classify(trace)
        ours = trace_metrics(trace)["hidden_comm_fraction"]
        theirs = hta.loc[hta["rank"] == rank, "comp_comm_overlap_pctg"]
        theirs = float(theirs.iloc[0]) / 100 if len(theirs) else float("nan")
        rows.append({"rank": rank, "kind": kind, "steps": len(steps), "compute_intervals": len(compute),
                     "comm_intervals": len(comm), "ours": ours, "hta": theirs,
                     "agree_within_0.05": abs(ours - theirs) <= 0.05 if ours == ours and theirs == theirs else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", action="store_true", help="profile a static_dist training run on every GPU")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    trace_dir = os.path.join(args.out_dir, "hta_traces", "profiler")
    if args.trainer:
        trainer(trace_dir, args.steps)
    else:
        synthetic(trace_dir)
    rows = compare(trace_dir)
    for row in rows:
        print(row)
    with open(os.path.join(args.out_dir, "hta-check.json"), "w") as f:
        json.dump({"source": "trainer" if args.trainer else "synthetic", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
