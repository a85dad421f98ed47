"""Benchmark ``gpu1-gpt2s``: GPT-2 small on one GPU, plain PyTorch vs Lightning vs ``static_dist`` (world size 1).

Workload: ``lightning_static_dist.examples.charlm.CharGPT`` at GPT-2 small size (vocab 50304, block 1024, 12 layers, 12 heads, d=768,
bias, dropout 0), batch 16 x 1024 tokens, bf16 autocast, fused AdamW (lr 6e-4, wd 0.1, the model's two param
groups), a fixed pool of random tokens generated on the GPU from a seeded generator (the loss stays near
ln(50304) ~ 10.8: the figures are about speed, not learning). Contenders, each in a fresh process per round and
interleaved (round 1: A B C D E, round 2: A B C D E ...):

    plain_eager        hand-written loop: autocast forward + loss, backward, fused AdamW step, zero_grad(set_to_none)
    plain_compile      the same, with forward + loss under torch.compile (Lightning compiles training_step,
                       which holds the loss too, so this is its like-for-like)
    lightning_eager    lightning.Trainer(devices=1, precision="bf16-mixed").fit(model)
    lightning_compile  the same Trainer, fit(torch.compile(model))
    static_dist        the same Trainer, strategy=StaticDistStrategy(compile={...}) (--static-dist-compile); with the
                       default regional "auto" at world size 1 it compiles the whole training_step in one graph
    static_dist_regional  the same with compile.regional=true: the 12 blocks compiled one by one, head + loss eager
                       (what a multi-rank run compiles; its compile seconds against static_dist's are the target)
    static_dist_monitor  static_dist with the OverlapMonitor recording every step (monitor-cost scenario)

Every contender's training_step skips self.log: Lightning's fit(torch.compile(model)) compiles training_step and
dynamo fails on self.log there (lightning 2.6.6 with torch 2.13), so all contenders run the same step body.

Figures: a step is timed from a CUDA synchronize to a CUDA synchronize (Lightning: on_train_batch_start to
on_train_batch_end, which holds zero_grad, training_step, backward and the optimizer step). After ``--warmup``
steps, ``--steps`` are timed; tokens/s = batch * seq / median step. ``tokens_per_s_loop`` divides by the wall time
of the whole timed window instead, so it also charges what a framework does between steps. MFU = (6 N + 12 L d T)
* tokens/s / 989e12 (nanoGPT's estimate, H100/H200 bf16 dense peak), N = every unique parameter: position
embedding included, the tied head counted once. ``first_step_overhead_s`` = first step minus the median step
(tracing + compilation); ``warmup_overhead_s`` sums that excess over all warmup steps, so recompiles count too.
``worker_wall_s`` (the whole process) also catches compile work done before the first step. Each worker gets a
fresh inductor/Triton cache (cold compile) unless ``--warm-cache``. Peak memory: torch.cuda.max_memory_allocated().
``dynamo_graphs``: graphs dynamo compiled (0: nothing was compiled, whatever was asked). The record is rewritten
after every round, so a run cut short keeps what it measured. Target: static_dist >= 1.05x lightning_compile.

    python benchmarks/gpu1_gpt2s.py                                   # 3 rounds, all seven, writes results/
    python benchmarks/gpu1_gpt2s.py --rounds 1 --contenders lightning_compile,static_dist --out-dir "$OUT"
    python benchmarks/gpu1_gpt2s.py --tiny --rounds 1 --no-record     # CPU smoke test of every code path
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

from _common import ROOT, run_job, worker_env

sys.path.insert(0, ROOT)  # the checkout's package, for the workload
from _gpt2s import FULL, PEAK_FLOPS, TINY, StepTimer, flops_per_token, loader, new_model, train_plainly  # noqa: E402

CONTENDERS = ("plain_eager", "plain_compile", "lightning_eager", "lightning_compile", "static_dist", "static_dist_regional",
              "static_dist_monitor")
ANCHOR = {"tokens_per_s": 499_000, "mfu": 0.434, "contender": "lightning_compile"}
DEFAULT_STATIC_COMPILE = {"enabled": True, "backend": "inductor", "regional": "auto"}


def worker(name: str, args: argparse.Namespace) -> None:
    """Train one contender for warmup + steps steps and write its timings to ``args.out``."""
    import torch

    cfg, total = (TINY if args.tiny else FULL), args.warmup + args.steps
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_float32_matmul_precision("high")
    model = new_model(cfg)  # the same initial weights for every contender
    batches = loader(cfg, total, device, seed=1234)
    timer = StepTimer(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    if name.startswith("plain"):
        model.to(device).train()
        optimizer = model.configure_optimizers()

        def loss_fn(x, y):
            return model.loss(model(x), y)

        train_plainly(torch.compile(loss_fn) if name == "plain_compile" else loss_fn, optimizer, batches, timer, device)
    else:
        import lightning as L

        strategy = "auto"
        if name.startswith("static_dist"):
            from lightning_static_dist import StaticDistStrategy

            compile_cfg = json.loads(args.static_dist_compile)
            if name == "static_dist_regional":
                compile_cfg["regional"] = True  # blocks one by one, as at world size > 1: the compile-time row
            strategy = StaticDistStrategy(compile=compile_cfg)
        callbacks = [timer]
        if name == "static_dist_monitor":
            from lightning_static_dist import OverlapMonitor

            # the monitor-cost scenario: the recorder on every step (CUDA events, one sync per recorded step)
            callbacks.append(OverlapMonitor(every_n_steps=1))
        trainer = L.Trainer(
            accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision="bf16-mixed",
            max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
            # the loader yields ready batches; at world size 1 a DistributedSampler would only get in the way
            use_distributed_sampler=False,
        )
        trainer.fit(torch.compile(model) if name == "lightning_compile" else model, train_dataloaders=batches)

    from torch._dynamo.utils import counters

    record = {
        **timer.timings(args.warmup, total),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "n_params": model.num_parameters(),
        # 0 means nothing was compiled, whatever the contender asked for
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "tokens_per_step": cfg["batch"] * cfg["block_size"],
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "device_count": torch.cuda.device_count() if cuda else 0,
    }
    with open(args.out, "w") as f:
        json.dump(record, f)


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One contender in a fresh process; on failure, print its stderr tail and return {"error": last line}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--out", out, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--static-dist-compile", args.static_dist_compile]
        cmd += ["--tiny"] if args.tiny else []
        env = worker_env(None if args.warm_cache else tmp)  # a fresh cache: cold compile, as a user's first run sees it
        started = time.perf_counter()
        error = run_job(name, cmd, env, args.worker_timeout)
        if error is not None:
            return {"error": error}
        with open(out) as f:
            record = json.load(f)
        record["wall_s"] = time.perf_counter() - started
        return record


def build_rows(runs: dict[str, list[dict]], tiny: bool) -> list[dict]:
    rows = []
    for name, recs in runs.items():
        failed = [r for r in recs if "error" in r]
        row: dict = {"contender": name, "status": f"failed: {failed[0]['error']}" if failed else "ok"}
        ok = [r for r in recs if "error" not in r]
        if ok:
            median_s = statistics.median(s for r in ok for s in r["step_s"])
            tokens, n = ok[0]["tokens_per_step"], ok[0]["n_params"]
            cfg = TINY if tiny else FULL
            peaks = [r["peak_mem_gib"] for r in ok if r["peak_mem_gib"] is not None]
            row.update({
                "tokens_per_s": round(tokens / median_s),
                "tokens_per_s_per_round": [round(tokens / statistics.median(r["step_s"])) for r in ok],
                "tokens_per_s_loop": round(statistics.median(tokens * len(r["step_s"]) / r["loop_s"] for r in ok)),
                "mfu": None if tiny else round(flops_per_token(cfg, n) * tokens / median_s / PEAK_FLOPS, 4),
                "step_ms_median": round(1e3 * median_s, 2),
                "first_step_overhead_s": round(statistics.median(r["first_step_overhead_s"] for r in ok), 2),
                "warmup_overhead_s": round(statistics.median(r["warmup_overhead_s"] for r in ok), 2),
                "worker_wall_s": [round(r["wall_s"], 1) for r in ok],
                "peak_mem_gib": round(max(peaks), 2) if peaks else None,
                "final_loss": [round(r["final_loss"], 4) for r in ok],
                "n_params": n,
                "dynamo_graphs": ok[-1]["dynamo_graphs"],
                "timed_steps": sum(len(r["step_s"]) for r in ok),
            })
        rows.append(row)
    return rows


def build_summary(rows: list[dict], static_compile: dict, tiny: bool) -> dict:
    by = {r["contender"]: r for r in rows if r["status"] == "ok"}

    def ratio(a: str, b: str, key: str = "tokens_per_s"):
        return round(by[a][key] / by[b][key], 4) if a in by and b in by and by[b][key] else None

    summary = {
        "static_dist_vs_lightning_compile": ratio("static_dist", "lightning_compile"),
        "lightning_compile_vs_plain_compile": ratio("lightning_compile", "plain_compile"),
        "target": "static_dist_vs_lightning_compile >= 1.05",
        "anchor": {**ANCHOR, "note": "the benchmark's anchor for Lightning+compile on this workload; "
                                     "absolute figures compare only on the same GPU, ratios travel"},
    }
    if not tiny and "lightning_compile" in by:
        summary["lightning_compile_vs_anchor"] = round(
            by["lightning_compile"]["tokens_per_s"] / ANCHOR["tokens_per_s"], 4)
    if "static_dist_monitor" in by and "static_dist" in by:
        # monitor-cost (benchmarks/README.md): target <= 0.01
        summary["monitor_slowdown"] = round(1 - by["static_dist_monitor"]["tokens_per_s"] / by["static_dist"]["tokens_per_s"], 4)
    if static_compile.get("regional", "auto") in ("auto", False):
        # static_dist compiles the whole step at world size 1 (auto) or when told (false); both cold unless --warm-cache
        summary["compile_s_regional_vs_whole"] = ratio("static_dist_regional", "static_dist", "first_step_overhead_s")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 40; --tiny: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 15; --tiny: 2)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list, run in this order")
    parser.add_argument("--static-dist-compile", default=json.dumps(DEFAULT_STATIC_COMPILE),
                        help="JSON for StaticDistStrategy(compile=...)")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized smoke test: tiny model, no MFU")
    parser.add_argument("--warm-cache", action="store_true", help="share the inductor/Triton cache between workers")
    parser.add_argument("--worker-timeout", type=float, default=900.0, help="seconds before a worker counts as failed")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--no-record", action="store_true", help="print only; write no JSON record")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (3 if args.tiny else 40)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 15)
    static_compile = json.loads(args.static_dist_compile)  # fail here, not in every worker, on bad JSON
    if args.worker:
        worker(args.worker, args)
        return
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown or not names:
        parser.error(f"--contenders: unknown {unknown}; allowed: {', '.join(CONTENDERS)}")

    import lightning
    import torch

    today = datetime.date.today().isoformat()
    scenario = "gpu1-gpt2s-tiny" if args.tiny else "gpu1-gpt2s"
    path = os.path.join(args.out_dir, f"{scenario}-{today}.json")
    runs: dict[str, list[dict]] = {c: [] for c in names}
    for r in range(args.rounds):
        for name in names:  # interleaved: A B C D E, A B C D E ...
            if any("error" in rec for rec in runs[name]):
                continue  # a contender that failed once is not retried every round
            rec = run_one(name, args)
            runs[name].append(rec)
            figure = (f"{rec['tokens_per_step'] / statistics.median(rec['step_s']):12,.0f} tokens/s, first step "
                      f"+{rec['first_step_overhead_s']:.1f} s" if "error" not in rec else f"FAILED: {rec['error']}")
            print(f"round {r + 1}/{args.rounds} {name:<18} {figure}", flush=True)

        rows = build_rows(runs, args.tiny)
        summary = build_summary(rows, static_compile, args.tiny)
        first_ok = next((rec for recs in runs.values() for rec in recs if "error" not in rec), {})
        record = {
            "scenario": scenario,
            "date": today,
            "hardware": {"cpu" if args.tiny else "gpu": first_ok.get("device"), "count": first_ok.get("device_count")},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "lightning": lightning.__version__, "cuda": torch.version.cuda},
            "command": "python benchmarks/gpu1_gpt2s.py " + " ".join(map(shlex.quote, sys.argv[1:])),
            "config": {**(TINY if args.tiny else FULL), "steps": args.steps, "warmup": args.warmup,
                       "rounds_done": r + 1, "static_dist_compile": static_compile,
                       "inductor_cache": "shared" if args.warm_cache else "fresh per worker (cold compile)"},
            "rows": rows,
            "summary": summary,
        }
        if not args.no_record:  # after every round, so a run cut short still leaves its figures behind
            os.makedirs(args.out_dir, exist_ok=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=2)

    print(f"\n{'contender':<18} {'tokens/s':>10} {'loop tok/s':>10} {'MFU':>6} {'step ms':>8} {'1st step +s':>11} "
          f"{'warmup +s':>9} {'peak GiB':>8} {'loss':>7} {'graphs':>6}  status")
    for row in rows:
        if row["status"] != "ok":
            print(f"{row['contender']:<18} {'-':>10} {'-':>10} {'-':>6} {'-':>8} {'-':>11} {'-':>9} {'-':>8} "
                  f"{'-':>7} {'-':>6}  {row['status']}")
            continue
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{row['contender']:<18} {row['tokens_per_s']:>10,} {row['tokens_per_s_loop']:>10,} "
              f"{fmt(row['mfu'], '.3f'):>6} {row['step_ms_median']:>8.1f} {row['first_step_overhead_s']:>11.1f} "
              f"{row['warmup_overhead_s']:>9.1f} {fmt(row['peak_mem_gib'], '.1f'):>8} {row['final_loss'][-1]:>7.3f} "
              f"{row['dynamo_graphs']:>6}  ok")
    print(f"\nstatic_dist / lightning_compile tokens/s: {summary['static_dist_vs_lightning_compile']} "
          f"(target >= 1.05); lightning_compile / plain_compile: {summary['lightning_compile_vs_plain_compile']}; "
          f"anchor {ANCHOR['tokens_per_s']:,} tokens/s, MFU {ANCHOR['mfu']}")
    if not args.no_record:
        print(f"recorded: {path}")


if __name__ == "__main__":
    main()
