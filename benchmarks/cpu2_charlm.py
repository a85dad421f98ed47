"""Benchmark ``cpu2-charlm``: the char-level GPT on 2 CPU ranks (Gloo), Lightning ``ddp`` vs ``static_dist``.

Contenders run interleaved (A B A B ...) in one invocation, each as a real 2-process job started the way users
start it (Lightning's subprocess launcher). Figures: median step time over all timed steps of a contender, the ratio
of medians, the median of the per-round ratios, and gradient bytes per step.

    ddp                  Lightning DDPStrategy, eager
    static_dist          StaticDistStrategy, eager (sync.mode hooks)
    ddp_compile          DDPStrategy with the model's forward under torch.compile (inductor): what a Lightning user
                         ends up with, since fit(torch.compile(model)) fails on CharGPT's self.log (lightning 2.6.6,
                         torch 2.13); DDPOptimizer splits the graph at bucket boundaries
    static_dist_compile  StaticDistStrategy, compile.enabled (regional, inductor), sync.mode hooks
    static_dist_graph    StaticDistStrategy, compile.enabled, sync.mode graph (collectives in the compiled backward,
                         inductor_distributed)

static_dist rows also run the OverlapMonitor every 5th step and report the median overlap_ratio,
hidden_comm_fraction and exposed_comm_ms over the run (DDP's reducer cannot be observed the same way; in graph mode
the collectives run inside the compiled graph, where the monitor does not see them: NaN).

    python benchmarks/cpu2_charlm.py                 # 3 rounds x 2 contenders x 60 steps, writes results/
    python benchmarks/cpu2_charlm.py --rounds 1 --steps 20 --no-record   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from _common import ROOT, run_rounds, step_ms, write_record

CONFIG = os.path.join(ROOT, "configs", "charlm_cpu.yaml")
CONTENDERS = ("ddp", "static_dist", "ddp_compile", "static_dist_compile", "static_dist_graph")
#: contender -> (compiled?, sync mode) for the table
SETUP = {
    "ddp": (False, "ddp reducer"),
    "static_dist": (False, "hooks"),
    "ddp_compile": (True, "ddp reducer (DDPOptimizer)"),
    "static_dist_compile": (True, "hooks"),
    "static_dist_graph": (True, "graph"),
}


def worker(contender: str, steps: int, warmup: int, out: str) -> None:
    """One 2-rank training job; rank 0 writes its step times and byte counts to ``out``."""
    sys.path.insert(0, ROOT)
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_static_dist import StaticDistStrategy, load_run_config
    from lightning_static_dist.overlap.intervals import median_of
    from lightning_static_dist.callbacks import RunSummary

    cfg = load_run_config(
        CONFIG,
        [
            f"trainer.max_steps={steps}",
            "trainer.limit_val_batches=0",
            "trainer.enable_checkpointing=false",
            "trainer.enable_model_summary=false",
            "trainer.gradient_clip_val=null",
            "trainer.logger=false",
        ],
    )
    L.seed_everything(cfg.seed)
    model, data = cfg.model.instantiate("model"), cfg.data.instantiate("data")
    import dataclasses

    import torch

    if contender.startswith("ddp"):
        strategy = DDPStrategy()
        if contender == "ddp_compile":
            model.forward = torch.compile(model.forward)
    else:
        strategy_cfg = cfg.strategy
        if contender != "static_dist":
            strategy_cfg.compile = dataclasses.replace(strategy_cfg.compile, enabled=True, backend="inductor")
        if contender == "static_dist_graph":
            strategy_cfg.sync = dataclasses.replace(strategy_cfg.sync, mode="graph")
        strategy = StaticDistStrategy.from_config(strategy_cfg)
    from lightning_static_dist import OverlapMonitor, offer_of

    summary = RunSummary(warmup_steps=warmup)
    monitor = OverlapMonitor(every_n_steps=5)
    callbacks = [summary] + ([monitor] if contender.startswith("static_dist") else [])
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, **cfg.trainer)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        figures = offer.sync_figures() if (offer := offer_of(trainer)) is not None else None
        record = {
            "step_s": summary.step_seconds[warmup:],
            "tokens_per_step": summary.items_per_step * trainer.world_size,
            "final_loss": summary.summary["train_loss_last10"],
            # ddp all-reduces every gradient once per step; static_dist reports what it actually sent
            "bytes_per_step": figures.bytes_per_round if figures is not None else grad_bytes,
            "bytes_source": "measured (synchroniser)" if figures is not None else "gradient bytes (DDP all-reduces all)",
            "overlap": {
                key: median_of([row[f"static_dist/{key}"] for row in monitor.history[1:]])
                for key in ("overlap_ratio", "hidden_comm_fraction", "exposed_comm_ms", "comm_ms", "trigger_delay_ms")
            } if monitor.history else None,
        }
        with open(out, "w") as f:
            json.dump(record, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-record", action="store_true", help="print only; do not write benchmarks/results/")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return

    runs = run_rounds(__file__, CONTENDERS, args.rounds, "--steps", str(args.steps), "--warmup", str(args.warmup))

    rows = []
    for contender in CONTENDERS:
        all_steps = [s for rec in runs[contender] for s in rec["step_s"]]
        median_s = statistics.median(all_steps)
        rows.append({
            "contender": contender,
            "sync_mode": SETUP[contender][1],
            "compile": SETUP[contender][0],
            **step_ms(runs[contender], digits=2),
            "tokens_per_s": round(runs[contender][0]["tokens_per_step"] / median_s),
            "bytes_per_step": runs[contender][-1]["bytes_per_step"],
            "bytes_source": runs[contender][-1]["bytes_source"],
            "final_loss": [round(rec["final_loss"], 4) for rec in runs[contender]],
            "overlap_per_round": [rec.get("overlap") for rec in runs[contender]],
            "timed_steps": len(all_steps),
        })
    by_name = {row["contender"]: row for row in rows}
    per_round = [
        statistics.median(s["step_s"]) / statistics.median(d["step_s"])
        for s, d in zip(runs["static_dist"], runs["ddp"])
    ]
    def ratio(a: str, b: str) -> float:
        return round(by_name[a]["step_ms_median"] / by_name[b]["step_ms_median"], 4)

    summary = {
        "step_time_ratio_static_dist_vs_ddp": ratio("static_dist", "ddp"),
        "step_time_ratio_per_round_median": round(statistics.median(per_round), 4),
        "step_time_ratio_static_dist_compile_vs_ddp_compile": ratio("static_dist_compile", "ddp_compile"),
        "step_time_ratio_static_dist_graph_vs_ddp_compile": ratio("static_dist_graph", "ddp_compile"),
        "step_time_ratio_static_dist_compile_vs_static_dist": ratio("static_dist_compile", "static_dist"),
        "target": "<= 1.0: static_dist no slower than Lightning ddp at the same compile setting",
    }

    print(f"\n{'contender':<20} {'step ms (median)':>17} {'tokens/s':>10} {'bytes/step':>12} {'overlap':>8} "
          f"{'hidden':>7} {'exposed ms':>10}  per-round ms")
    for row in rows:
        ov = row["overlap_per_round"][-1] or {}
        print(f"{row['contender']:<20} {row['step_ms_median']:>17.1f} {row['tokens_per_s']:>10,} "
              f"{row['bytes_per_step']:>12,} {ov.get('overlap_ratio', float('nan')):>8.3f} "
              f"{ov.get('hidden_comm_fraction', float('nan')):>7.3f} {ov.get('exposed_comm_ms', float('nan')):>10.2f}"
              f"  {row['step_ms_per_round']}")
    print()
    for key, value in summary.items():
        print(f"{key}: {value}")

    if args.no_record:
        return
    command = "python benchmarks/cpu2_charlm.py " + " ".join(f"--{k} {getattr(args, k)}" for k in ("rounds", "steps", "warmup"))
    write_record("cpu2-charlm", command, config=os.path.relpath(CONFIG, ROOT), rows=rows, summary=summary)


if __name__ == "__main__":
    main()
