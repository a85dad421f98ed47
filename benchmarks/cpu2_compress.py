"""Benchmark ``cpu2-compress``: the char-level GPT on 2 CPU ranks (Gloo), each gradient compressor side by side.

Every contender trains the main job's model (``configs/charlm_cpu.yaml``: 4 layers, d=128, 16 x 128 bytes per
rank) for ``--steps`` steps from the same seed on the same data, with ``static_dist`` and
``strategy.compression`` set as below. The ``_guard`` rows also run the CompressionGuard (defaults: check every 50
steps, patience 2) and report its switches; the others measure the compressor alone. Contenders run one after the
other in fresh 2-process jobs (Lightning's subprocess launcher, as ``lsd-train`` starts them).

    none                  exact fp32 all-reduce (the reference)
    bf16                  bf16 all-reduce
    powersgd_r1 / _r4     PowerSGD rank 1 / 4, error feedback, warm start
    powersgd_r4_start100  the same, exact for the first 100 steps (start_step)
    qsgd                  QSGD, 127 levels, 512-value chunks
    topk_1pct             TopK 1 % with error feedback
    powersgd_r1_guard, topk_1pct_guard   with the CompressionGuard

Figures: payload bytes per step (the synchroniser's count of what this rank handed to its collectives, averaged
over the compressed steps; under the guard the level changes, so the mean over the run is shown too),
compression_ratio = uncompressed bytes / bytes sent, final training loss (mean of the last 10 steps), validation
loss at the end (10 batches), median step time, guard events. Targets (benchmarks/README.md): powersgd r4 >= 50x fewer
bytes at <= 1.03x final loss; topk 1 % >= 20x at <= 1.05x; bf16 2x at <= 1.01x.

    python benchmarks/cpu2_compress.py                  # 300 steps each, writes results/
    python benchmarks/cpu2_compress.py --steps 40 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from _common import ROOT, run_worker, write_record

CONFIG = os.path.join(ROOT, "configs", "charlm_cpu.yaml")
CONTENDERS = {  # name: strategy.compression overrides (+ "guard": run the CompressionGuard)
    "none": {"name": "none"},
    "bf16": {"name": "bf16"},
    "powersgd_r1": {"name": "powersgd", "rank": 1},
    "powersgd_r4": {"name": "powersgd", "rank": 4},
    "powersgd_r4_start100": {"name": "powersgd", "rank": 4, "start_step": 100},
    "qsgd": {"name": "qsgd", "levels": 127},
    "topk_1pct": {"name": "topk", "density": 0.01},
    "powersgd_r1_guard": {"name": "powersgd", "rank": 1, "guard": True},
    "topk_1pct_guard": {"name": "topk", "density": 0.01, "guard": True},
}
TARGETS = {  # contender: (minimum compression ratio, maximum final-loss ratio)
    "bf16": (2.0, 1.01),
    "powersgd_r4": (50.0, 1.03),
    "topk_1pct": (20.0, 1.05),
}


def worker(contender: str, steps: int, out: str) -> None:
    """One 2-rank training job; rank 0 writes its figures to ``out``."""
    sys.path.insert(0, ROOT)
    import lightning as L

    from lightning_static_dist import CompressionGuard, RunSummary, StaticDistStrategy, load_run_config

    overrides = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "trainer.enable_checkpointing=false",
                 "trainer.enable_model_summary=false", "trainer.logger=false"]
    options = dict(CONTENDERS[contender])
    use_guard = options.pop("guard", False)
    overrides += [f"strategy.compression.{key}={value}" for key, value in options.items()]
    cfg = load_run_config(CONFIG, overrides)
    L.seed_everything(cfg.seed)
    model, data = cfg.model.instantiate("model"), cfg.data.instantiate("data")
    summary, guard = RunSummary(warmup_steps=5), CompressionGuard()
    callbacks = [summary] + ([guard] if use_guard else [])
    trainer = L.Trainer(strategy=StaticDistStrategy.from_config(cfg.strategy), callbacks=callbacks, **cfg.trainer)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        figures = trainer.strategy.offer.sync_figures()
        record = {
            "step_s": summary.step_seconds[5:],
            "bytes_per_step": figures.bytes_per_round,
            "mean_bytes_per_step": figures.bytes_sent / figures.rounds,
            "uncompressed_bytes_per_step": figures.dense_bytes_per_round,
            "final_train_loss": summary.summary["train_loss_last10"],
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "guard_events": guard.events,
            "nonfinite_buckets": getattr(trainer.strategy.offer.compressing_reducer, "nonfinite_buckets", 0),
        }
        with open(out, "w") as f:
            json.dump(record, f)


def run_one(contender: str, steps: int) -> dict:
    return run_worker(__file__, contender, "--steps", str(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--no-record", action="store_true", help="print only; do not write benchmarks/results/")
    parser.add_argument("--worker", choices=tuple(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or "none" not in names:
        sys.exit(f"--contenders={args.contenders!r}: allowed: {', '.join(CONTENDERS)} (must include 'none')")

    rows = []
    for name in names:
        rec = run_one(name, args.steps)
        rows.append({
            "contender": name,
            "compression": CONTENDERS[name],
            "bytes_per_step": rec["bytes_per_step"],
            "compression_ratio": round(rec["uncompressed_bytes_per_step"] / rec["bytes_per_step"], 2),
            "mean_bytes_per_step": round(rec["mean_bytes_per_step"]),
            "mean_compression_ratio": round(rec["uncompressed_bytes_per_step"] / rec["mean_bytes_per_step"], 2),
            "final_train_loss": round(rec["final_train_loss"], 4),
            "val_loss": round(rec["val_loss"], 4),
            "step_ms_median": round(1e3 * statistics.median(rec["step_s"]), 1),
            "guard_events": rec["guard_events"],
            "nonfinite_buckets": rec["nonfinite_buckets"],
            "wall_s": rec["wall_s"],
        })
        print(f"{name:<21} done in {rec['wall_s']:.0f} s", flush=True)
    base = next(r for r in rows if r["contender"] == "none")
    for row in rows:
        row["final_loss_ratio"] = round(row["final_train_loss"] / base["final_train_loss"], 4)
        row["val_loss_ratio"] = round(row["val_loss"] / base["val_loss"], 4)
        target = TARGETS.get(row["contender"])
        if target is not None:
            row["target"] = f"ratio >= {target[0]}x, final loss <= {target[1]}x"
            row["target_met"] = row["compression_ratio"] >= target[0] and row["final_loss_ratio"] <= target[1]

    print(f"\n{'contender':<21} {'bytes/step':>11} {'ratio':>7} {'run mean':>8} {'train loss':>10} {'x none':>7} "
          f"{'val loss':>9} {'x none':>7} {'step ms':>8} {'guard':>6}  target")
    for r in rows:
        print(f"{r['contender']:<21} {r['bytes_per_step']:>11,} {r['compression_ratio']:>6.1f}x "
              f"{r['mean_compression_ratio']:>7.1f}x {r['final_train_loss']:>10.4f} "
              f"{r['final_loss_ratio']:>7.3f} {r['val_loss']:>9.4f} {r['val_loss_ratio']:>7.3f} {r['step_ms_median']:>8.1f} "
              f"{len(r['guard_events']):>6}  {r.get('target', '')} {'' if 'target_met' not in r else ('met' if r['target_met'] else 'NOT met')}")
    if args.no_record:
        return
    write_record("cpu2-compress", f"python benchmarks/cpu2_compress.py --steps {args.steps}",
                 config=os.path.relpath(CONFIG, ROOT), rows=rows)


if __name__ == "__main__":
    main()
