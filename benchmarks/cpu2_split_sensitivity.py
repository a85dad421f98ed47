"""Benchmark ``cpu2-split-sensitivity``: where the buckets and the compiled graph's pieces end, measured against the
α-β cost model (issue 15, item 3: the split-boundary half; the ring-length half is ``cost_model.py measure``).

Workload: the main job (``configs/charlm_cpu.yaml``: the char-level GPT, 842K parameters, 2 Gloo ranks x 16 x 128
tokens) with ``strategy.compile`` on (one graph for the whole ``training_step``, cut where the buckets end: one
autograd node and one bucket per piece, ``lightning_static_dist/compile/split.py``) and ``sync.mode: hooks``. Each
setting of ``sync.first_bucket_mb`` / ``sync.bucket_mb`` (``SETTINGS``, one bucket to many) is a fresh 2-rank job;
the settings are interleaved over ``--rounds`` rounds, each round starting with a quick calibration (``cost_model.py``'s
``measure``: all-reduces of the buckets' sizes on 2 ranks, alone) that the model's α and β are fitted to. Other
sessions share this machine's 2 cores: before each job the driver waits (at most ``--quiet-wait-s``) for them to
leave the cores idle, records how much CPU they took during the job, and repeats the main figures over the *quiet*
rounds alone (other processes at most ``QUIET_SHARE`` of the cores).

Measured per setting: the step time (``RunSummary``), the ``OverlapMonitor``'s ``static_dist/*`` metrics (recording
every step after ``--warmup``), and per bucket, from both ranks' recorded timelines (one monotonic clock for the
machine): its *sync latency*, from the moment the later rank had it ready to its completion (:func:`bucket_steps`).
The model is given the measured timeline — each bucket ready when the later rank had it, backward's end — and
predicts each bucket's all-reduce (``Link.seconds``) and the exposed communication (``predict_step``); the record keeps
both beside the measured figures, with the relative errors, and the calibration's own time at each bucket's size
(what the job adds to an all-reduce alone).

    python benchmarks/cpu2_split_sensitivity.py                  # 3 rounds x 6 settings, writes results/
    python benchmarks/cpu2_split_sensitivity.py --rounds 1 --steps 10 --no-record
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from _common import ROOT, run_worker, write_record

sys.path.insert(0, ROOT)

from lightning_static_dist.overlap.cost_model import Link, Sample, Wire, fit_link, predict_step  # noqa: E402
from lightning_static_dist.overlap.timeline import StepTimeline  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "charlm_cpu.yaml")
#: setting -> (sync.first_bucket_mb, sync.bucket_mb); the model's gradients are 3.2 MiB, its largest matrix 0.25 MiB
SETTINGS = {
    "one_bucket": (4.0, 4.0),
    "default_1_25": (1.0, 25.0),  # configs/charlm_cpu.yaml's own
    "1_1": (1.0, 1.0),
    "0.5_0.5": (0.5, 0.5),
    "0.25_0.25": (0.25, 0.25),  # smaller buckets change nothing: a bucket holds at least one whole matrix
    "0.25_4": (0.25, 4.0),  # a small first bucket, then all the rest
}
#: the calibration's all-reduce payloads: the range of the buckets' sizes (128 KiB .. 4 MiB)
CALIBRATION_SIZES = [128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20]
#: a job is quiet when other processes used at most this share of the cores during it
QUIET_SHARE = 0.2
#: the figures a row repeats for its quiet rounds alone
QUIET_KEYS = ("step_ms_median", "recorded_steps", "sync_ms_sum", "isolated_ms_sum", "model_ms_sum", "sum_rel_error",
              "bucket_rel_error_median_abs", "exposed_ms", "model_exposed_ms", "exposed_rel_error")
#: a bucket's figures per recorded step (:func:`bucket_steps`)
BUCKET_KEYS = ("nbytes", "sync_ms", "after_issue_ms", "issue_to_done_ms", "skew_ms")
#: the OverlapMonitor metrics kept per setting (means over the ranks, medians over the recorded steps)
MONITOR_KEYS = ("comm_ms", "exposed_comm_ms", "hidden_comm_fraction", "compute_ms", "trigger_delay_ms",
                "trigger_delay_worst_bucket_ms", "comm_start_frac")


NOTES = [
    "The model is fitted to isolated all-reduces (calibration: the machine otherwise idle, one compute thread per "
    "rank); in the job each bucket's all-reduce shares the 2 cores with both ranks' backward (one compute thread and "
    "Gloo's threads per rank), which the alpha-beta model does not know.",
    "Sync latency per bucket: the later rank's ready mark to the earliest completion either rank observed; it includes "
    "that rank packing and issuing the bucket (a copy of its bytes), which the calibration's collectives do not.",
    "The model serialises a step's buckets (one collective at a time, in plan order); Gloo runs a group's collectives "
    "on more than one thread, so two buckets' all-reduces can overlap.",
    "Exposed: the monitor's (comm time outside forward, backward and optimizer; mean over ranks); the model's: its "
    "all-reduces past backward's end, fed the measured ready times and backward end.",
    "isolated_ms: the calibration's median all-reduce at the bucket's size (linear between the sizes measured): "
    "sync_ms over isolated_ms is what the job adds, the model's error against isolated_ms what the alpha-beta line "
    "misses alone.",
    "other_cpu_s: CPU seconds the machine was busy during a job beyond the job's ranks' own up to the end of "
    "training (so the ranks' teardown and the driver count as other): other sessions share these 2 cores. A round "
    "is quiet when other_cpu_s <= QUIET_SHARE x cores x the job's wall time; 'quiet' repeats the figures over those.",
]


# ------------------------------------------------------------------------------------------- the bookkeeping


def bucket_steps(ranks: Sequence[Sequence[tuple[float, StepTimeline]]]) -> list[dict[str, Any]]:
    """Per recorded step seen by every rank, each bucket's bytes and timings, and per rank when each bucket was ready
    on *every* rank and when backward ended, in that rank's own frame.

    A bucket's *sync latency* runs from the moment the later rank had it ready to the earliest completion any rank
    observed: the collective cannot start before, and each rank's completion time is an upper bound (the recorder's
    earlier of its completion callback and its wait). It includes the later rank's packing and issuing of the bucket:
    on 2 busy cores the call that issues an all-reduce can return after the collective is done, so its mark (used by
    ``after_issue_ms``, the later rank's issue mark to completion, clamped at 0) is a lower bound of the wire time.
    ``issue_to_done_ms`` is rank 0's own, what the monitor's ``comm_ms`` adds up; ``skew_ms`` how far apart the
    ranks had the bucket ready.

    ``ranks[r]`` holds ``(origin, timeline)`` per recorded step of rank ``r``: ``origin`` the step's start on a clock
    every rank shares (``time.perf_counter``: the machine's monotonic clock), the timeline's times relative to it.
    """
    by_step = [{t.step: (origin, t) for origin, t in rank} for rank in ranks]
    out = []
    for step in sorted(set.intersection(*(set(s) for s in by_step))):
        views = [s[step] for s in by_step]
        comms = [{c.bucket: c for c in t.comm} for _, t in views]
        buckets = sorted(set.intersection(*(set(c) for c in comms)))

        # each rank's marks of each bucket on the shared clock
        ready, issued, done = ({b: [origin + getattr(c[b], mark) for (origin, _), c in zip(views, comms)]
                                for b in buckets} for mark in ("ready_s", "issued_s", "done_s"))
        all_ready = {b: max(ready[b]) for b in buckets}
        rank0 = comms[0]
        out.append({
            "step": step,
            "buckets": [{"bucket": b, "nbytes": rank0[b].nbytes,
                         "sync_ms": 1e3 * max(min(done[b]) - all_ready[b], 0.0),
                         "after_issue_ms": 1e3 * max(min(done[b]) - max(issued[b]), 0.0),
                         "issue_to_done_ms": 1e3 * (rank0[b].done_s - rank0[b].issued_s),
                         "skew_ms": 1e3 * (all_ready[b] - min(ready[b]))} for b in buckets],
            "ranks": [{"all_ready_s": [all_ready[b] - origin for b in buckets],
                       "backward_end_s": max((e for phase, _, e in t.compute if phase == "backward"), default=0.0)}
                      for origin, t in views],
        })
    return out


def compare(steps: Sequence[Mapping[str, Any]], monitor_rows: Sequence[Mapping[str, float]], link: Link,
            calibration: Sequence[Sample] = (), world: int = 2) -> dict[str, Any]:
    """One setting's measured figures beside the model's, from :func:`bucket_steps`' rows (every job's, pooled)
    and the monitor's rows (``static_dist/<key>``, pooled likewise), medians over the recorded steps. Per bucket:
    its median sync latency against ``link``'s all-reduce of its bytes. Per step: the exposed communication the
    monitor measured against the model's (:func:`predict_step` fed each step's measured ready times and backward
    end, a mean over the ranks like the monitor's). Relative errors are model / measured - 1. With a
    ``calibration``, each bucket's isolated all-reduce time too (:func:`isolated_ms`): what the job adds to it.

    Example::

        row = compare(bucket_steps(ranks), monitor.history, Link(latency_s=2e-4, bandwidth_Bps=1e9))
        row["sync_ms_sum"], row["model_ms_sum"], row["sum_rel_error"]
    """
    per_bucket: dict[int, dict[str, list[float]]] = {}
    for row in steps:
        for b in row["buckets"]:
            slot = per_bucket.setdefault(b["bucket"], {key: [] for key in BUCKET_KEYS})
            for key in BUCKET_KEYS:
                slot[key].append(b[key])
    buckets = []
    for index, slot in sorted(per_bucket.items()):
        measured = {key: statistics.median(values) for key, values in slot.items()}
        model = 1e3 * link.seconds("all_reduce", measured["nbytes"], world)
        isolated = isolated_ms(calibration, measured["nbytes"]) if calibration else float("nan")
        buckets.append({"bucket": index, **{k: round(v, 3) for k, v in measured.items()},
                        "nbytes": int(measured["nbytes"]), "isolated_ms": round(isolated, 3),
                        "model_ms": round(model, 3), "rel_error": _rel(model, measured["sync_ms"])})
    wires = {b["bucket"]: Wire((("all_reduce", b["nbytes"]),)) for b in buckets}
    exposed_model = []
    for row in steps:
        on_wire = [wires[b["bucket"]] for b in row["buckets"]]
        per_rank = [predict_step(r["all_ready_s"], on_wire, r["backward_end_s"], 0.0, link, world).exposed_s
                    for r in row["ranks"]]
        exposed_model.append(1e3 * statistics.mean(per_rank))
    monitor = {key: _median([r[f"static_dist/{key}"] for r in monitor_rows]) for key in MONITOR_KEYS}
    sums = {key: sum(b[key] for b in buckets) for key in ("sync_ms", "after_issue_ms", "isolated_ms", "model_ms")}
    return {
        "buckets": len(buckets),
        "bucket_bytes": [b["nbytes"] for b in buckets],
        "recorded_steps": len(steps),
        "sync_ms_median_bucket": round(_median([b["sync_ms"] for b in buckets]), 3),
        "model_ms_median_bucket": round(_median([b["model_ms"] for b in buckets]), 3),
        "bucket_rel_error_median_abs": round(_median([abs(b["rel_error"]) for b in buckets]), 3),
        "sync_ms_sum": round(sums["sync_ms"], 3),
        "after_issue_ms_sum": round(sums["after_issue_ms"], 3),
        "isolated_ms_sum": round(sums["isolated_ms"], 3),
        "model_ms_sum": round(sums["model_ms"], 3),
        "sum_rel_error": _rel(sums["model_ms"], sums["sync_ms"]),
        "exposed_ms": round(monitor["exposed_comm_ms"], 3),
        "model_exposed_ms": round(_median(exposed_model), 3),
        "exposed_rel_error": _rel(_median(exposed_model), monitor["exposed_comm_ms"]),
        "monitor": {k: round(v, 4) for k, v in monitor.items()},
        "per_bucket": buckets,
    }


def isolated_ms(calibration: Sequence[Sample], nbytes: float) -> float:
    """The calibration's all-reduce time at ``nbytes`` (ms): the median per size measured, linear in between,
    the nearest size's outside their range.

    Example::

        >>> isolated_ms([Sample("all_reduce", 1000, 2, 1e-3), Sample("all_reduce", 3000, 2, 3e-3)], 1500)
        1.5
    """
    by_size: dict[int, list[float]] = {}
    for sample in calibration:
        by_size.setdefault(sample.nbytes, []).append(1e3 * sample.seconds)
    sizes = sorted(by_size)
    ms = [statistics.median(by_size[n]) for n in sizes]
    above = bisect.bisect_right(sizes, nbytes)
    if above == 0 or above == len(sizes):
        return ms[min(above, len(sizes) - 1)]
    lo, hi = sizes[above - 1], sizes[above]
    return ms[above - 1] + (ms[above] - ms[above - 1]) * (nbytes - lo) / (hi - lo)


def fit_summary(rows: Sequence[Mapping[str, Any]], tolerance: float = 0.15) -> dict[str, Any]:
    """How well the model did over every setting: the medians of the absolute relative errors (per bucket, per
    step's sum of the buckets, exposed), and whether the per-step sums are within ``tolerance`` (issue 15's 15 %).

    Example::

        >>> rows = [{"bucket_rel_error_median_abs": 0.5, "sum_rel_error": -0.1, "exposed_rel_error": 0.3}]
        >>> fit_summary(rows)["sum_rel_error_median_abs"], fit_summary(rows)["sum_within_15pct"]
        (0.1, True)
    """
    sums = _median([abs(row["sum_rel_error"]) for row in rows])
    return {
        "bucket_rel_error_median_abs": round(_median([row["bucket_rel_error_median_abs"] for row in rows]), 3),
        "sum_rel_error_median_abs": round(sums, 3),
        "exposed_rel_error_median_abs": round(_median([abs(row["exposed_rel_error"]) for row in rows]), 3),
        f"sum_within_{round(100 * tolerance)}pct": sums <= tolerance,
    }


def verdict(summary: Mapping[str, Any], calibration: Mapping[str, Any]) -> str:
    """One sentence for the record: whether the model fits, from :func:`fit_summary`'s figures (``summary``'s
    ``all_rounds`` and ``quiet_rounds``), and where the misfit comes from."""
    every, quiet = summary["all_rounds"], summary["quiet_rounds"] or summary["all_rounds"]
    fits = every["sum_within_15pct"] and quiet["sum_within_15pct"]
    return (f"The alpha-beta model {'fits' if fits else 'does not fit'} the buckets' sync latency in this job: each "
            f"step's sum off by a median {every['sum_rel_error_median_abs']:.0%} over every round "
            f"({quiet['sum_rel_error_median_abs']:.0%} over the quiet ones; 15 % wanted), single buckets by "
            f"{every['bucket_rel_error_median_abs']:.0%}, the exposed communication by "
            f"{every['exposed_rel_error_median_abs']:.0%}. Alone, the same all-reduces are off the fitted line by a "
            f"median {calibration['median_rel_error']:.0%}; in the job a step's buckets took a median "
            f"{summary['in_job_over_isolated_median']:.2f} x their isolated time.")


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


def _rel(model: float, measured: float) -> float:
    return round(model / measured - 1, 3) if measured > 0 else float("nan")


# ------------------------------------------------------------------------------------------------- the job


def worker(setting: str, steps: int, warmup: int, backend: str, out: str) -> None:
    """One 2-rank training job; rank 0 writes the step times, monitor rows and both ranks' bucket timings."""
    import resource

    import lightning as L
    import torch

    from lightning_static_dist import OverlapMonitor, StaticDistStrategy, load_run_config
    from lightning_static_dist.callbacks import RunSummary

    first_mb, bucket_mb = SETTINGS[setting]
    cfg = load_run_config(CONFIG, [
        f"trainer.max_steps={warmup + steps}", "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false",
        "trainer.enable_model_summary=false", "trainer.logger=false",
        f"strategy.sync.first_bucket_mb={first_mb}", f"strategy.sync.bucket_mb={bucket_mb}",
        "strategy.compile.enabled=true", f"strategy.compile.backend={backend}",
    ])

    class BucketMonitor(OverlapMonitor):
        """The overlap monitor, also keeping each recorded step's timeline (which it reduces to aggregates) with
        the step's start on the shared clock: its origin is marked in ``begin_step`` just before this one."""

        def __init__(self) -> None:
            super().__init__(every_n_steps=1)
            self.kept: list[tuple[float, StepTimeline]] = []
            self.plan = ""
            self.ranks: list[Any] = []
            """Per rank: (its kept timelines, its CPU seconds up to the end of training); filled at the end."""
            self._origin = 0.0

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            super().on_train_batch_start(trainer, *args)
            self._origin = time.perf_counter()

        def _publish(self, trainer: L.Trainer, pl_module: Any, timeline: StepTimeline) -> None:
            super()._publish(trainer, pl_module, timeline)
            if timeline.step >= warmup:
                self.kept.append((self._origin, timeline))

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            super().on_train_end(trainer, pl_module)
            # while fitting: the synchroniser and the process group are gone after fit()
            self.plan = trainer.strategy.offer.sync_figures().bucket_plan
            used = resource.getrusage(resource.RUSAGE_SELF)
            self.ranks = [None] * trainer.world_size
            torch.distributed.all_gather_object(self.ranks, (self.kept, used.ru_utime + used.ru_stime))

    L.seed_everything(cfg.seed)
    model, data = cfg.model.instantiate("model"), cfg.data.instantiate("data")
    summary = RunSummary(warmup_steps=warmup)
    monitor = BucketMonitor()
    trainer = L.Trainer(strategy=StaticDistStrategy.from_config(cfg.strategy), callbacks=[summary, monitor],
                        **cfg.trainer)
    trainer.fit(model, datamodule=data)
    if not trainer.is_global_zero:
        return
    report = trainer.strategy.offer.compile_report
    with open(out, "w") as f:
        json.dump({
            "step_s": summary.step_seconds[warmup:],
            "monitor": [row for row in monitor.history if row["step"] >= warmup],
            "steps": bucket_steps([kept for kept, _ in monitor.ranks]),
            "job_cpu_s": sum(cpu for _, cpu in monitor.ranks),
            "plan": monitor.plan,
            "pieces": report.splitter.pieces if report is not None and report.splitter is not None else None,
            "uncut": report.splitter.uncut if report is not None and report.splitter is not None else None,
            "graph_breaks": len(report.graph_breaks) if report is not None else None,
            "final_loss": summary.summary.get("train_loss_last10"),
        }, f)


def calibrate(reps: int) -> list[Sample]:
    """All-reduces of the buckets' sizes on 2 fresh Gloo ranks (``cost_model.py measure``), the machine otherwise
    idle."""
    from cost_model import measure

    return measure([2], "gloo", reps, sizes=CALIBRATION_SIZES, kinds=("all_reduce",))


def wait_for_quiet(max_wait_s: float, busy_below: float = 0.25, window_s: float = 2.0) -> float:
    """Wait until the cores were less than ``busy_below`` busy over a ``window_s`` window, at most ``max_wait_s``
    (other sessions run their tests on the same 2 cores); return the seconds waited."""
    started = time.perf_counter()
    while True:
        before = _busy_cpu_seconds()
        time.sleep(window_s)
        busy = (_busy_cpu_seconds() - before) / (window_s * (os.cpu_count() or 1))
        waited = time.perf_counter() - started
        if busy < busy_below or waited >= max_wait_s:
            return waited


def _busy_cpu_seconds() -> float:
    """CPU seconds this machine has been busy (all cores, all processes) since it booted."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _head_commit() -> Optional[str]:
    import subprocess

    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _archived_link() -> Optional[Link]:
    """The α-β fit to the world-2 all-reduces of the cost-model record of 2026-12-01 (None where it is absent)."""
    path = os.path.join(ROOT, "benchmarks", "results", "cost-model-2026-12-01.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        measured = json.load(f).get("measure_gloo", {}).get("samples", [])
    samples = [Sample(s["kind"], s["bytes"], s["world"], s["ms"] / 1e3) for s in measured
               if s["world"] == 2 and s["kind"] == "all_reduce"]
    return fit_link(samples)[0] if len(samples) >= 2 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed (and recorded) steps per job")
    parser.add_argument("--warmup", type=int, default=8, help="steps first, untimed (compilation included)")
    parser.add_argument("--backend", default="aot_eager", help="strategy.compile.backend")
    parser.add_argument("--reps", type=int, default=10, help="calibration: timed all-reduces per size")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--quiet-wait-s", type=float, default=120.0,
                        help="before each job, wait at most this long for the other processes to leave the cores idle")
    parser.add_argument("--commit", default=None,
                        help="the commit of the code measured (default: this checkout's HEAD), for the record")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", choices=list(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.backend, args.out)
        return

    started = time.perf_counter()
    samples: list[Sample] = []
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.settings}
    for r in range(args.rounds):
        wait_for_quiet(args.quiet_wait_s)
        samples += calibrate(args.reps)
        for setting in args.settings:
            waited = wait_for_quiet(args.quiet_wait_s)
            before = _busy_cpu_seconds()
            rec = run_worker(__file__, setting, "--steps", str(args.steps), "--warmup", str(args.warmup),
                             "--backend", args.backend)
            rec["other_cpu_s"] = round(_busy_cpu_seconds() - before - rec["job_cpu_s"], 1)
            rec["waited_for_quiet_s"] = round(waited, 1)
            runs[setting].append(rec)
            print(f"round {r + 1}/{args.rounds} {setting:<12} {rec['plan']}, {rec['pieces']} pieces, median step "
                  f"{1e3 * statistics.median(rec['step_s']):.1f} ms, {rec['other_cpu_s']} CPU s of other processes in "
                  f"{rec['wall_s']} s", flush=True)
    link, fit_error = fit_link(samples)
    archived = _archived_link()

    def measured(recs: list[dict[str, Any]], against: Link) -> dict[str, Any]:
        return {
            "step_ms_median": round(1e3 * statistics.median(s for rec in recs for s in rec["step_s"]), 2),
            **compare([row for rec in recs for row in rec["steps"]], [row for rec in recs for row in rec["monitor"]],
                      against, samples),
        }

    rows = []
    for setting in args.settings:
        recs = runs[setting]
        quiet = [i for i, rec in enumerate(recs) if rec["other_cpu_s"] <= QUIET_SHARE * rec["wall_s"] * os.cpu_count()]
        first_mb, bucket_mb = SETTINGS[setting]
        row = {
            "setting": setting, "first_bucket_mb": first_mb, "bucket_mb": bucket_mb,
            "plan": recs[-1]["plan"], "pieces": [rec["pieces"] for rec in recs],
            "graph_breaks": [rec["graph_breaks"] for rec in recs], "uncut": recs[-1]["uncut"],
            "step_ms_per_round": [round(1e3 * statistics.median(rec["step_s"]), 2) for rec in recs],
            "other_cpu_s_per_round": [rec["other_cpu_s"] for rec in recs],
            "waited_for_quiet_s_per_round": [rec["waited_for_quiet_s"] for rec in recs],
            "job_wall_s_per_round": [rec["wall_s"] for rec in recs],
            "final_loss": [rec["final_loss"] for rec in recs],
            **measured(recs, link),
            "quiet_rounds": quiet,
            "quiet": {k: v for k, v in measured([recs[i] for i in quiet], link).items() if k in QUIET_KEYS}
            if quiet else None,
        }
        if archived is not None:
            row["archived_fit"] = {k: v for k, v in measured(recs, archived).items()
                                   if k.startswith("model_") or "error" in k}
        rows.append(row)
        print(f"{setting:<12} {row['buckets']:>2} buckets  sync/bucket {row['sync_ms_median_bucket']:.2f} ms "
              f"(model {row['model_ms_median_bucket']:.2f})  sum {row['sync_ms_sum']:.2f} (isolated "
              f"{row['isolated_ms_sum']:.2f}, model {row['model_ms_sum']:.2f})  exposed {row['exposed_ms']:.2f} (model "
              f"{row['model_exposed_ms']:.2f})  step {row['step_ms_median']:.1f} ms, quiet rounds {quiet}", flush=True)
    calibration = {
        "sizes": CALIBRATION_SIZES, "latency_us": round(link.latency_s * 1e6, 2),
        "bandwidth_GBps": round(link.bandwidth_Bps / 1e9, 3), "max_rel_error": round(fit_error, 3),
        "median_rel_error": round(statistics.median(abs(link.seconds(s.kind, s.nbytes, s.world) / s.seconds - 1)
                                                    for s in samples), 3),
        "samples": [{"bytes": s.nbytes, "ms": round(s.seconds * 1e3, 4),
                     "model_ms": round(link.seconds(s.kind, s.nbytes, s.world) * 1e3, 4)} for s in samples],
    }
    quiet_rows = [row["quiet"] for row in rows if row["quiet"] is not None]
    summary = {
        "all_rounds": fit_summary(rows),
        "quiet_rounds": fit_summary(quiet_rows) if quiet_rows else None,
        "archived_fit": fit_summary([row["archived_fit"] for row in rows]) if archived is not None else None,
        # what the job adds to the same all-reduces alone: sharing the cores with backward, the later rank's packing
        "in_job_over_isolated_median": round(_median([row["sync_ms_sum"] / row["isolated_ms_sum"] for row in rows]), 3),
        "fastest_setting": min(rows, key=lambda row: row["step_ms_median"])["setting"],
        "fastest_setting_quiet_rounds": min((row for row in rows if row["quiet"]),
                                            key=lambda row: row["quiet"]["step_ms_median"])["setting"]
        if quiet_rows else None,
    }
    summary["verdict"] = verdict(summary, calibration)
    print(summary)
    wall = round(time.perf_counter() - started)
    print(f"fit: α {calibration['latency_us']} µs, β {calibration['bandwidth_GBps']} GB/s; {wall} s in all")
    if args.no_record:
        return
    command = (f"python benchmarks/cpu2_split_sensitivity.py --rounds {args.rounds} --steps {args.steps} "
               f"--warmup {args.warmup} --backend {args.backend} --reps {args.reps} "
               f"--quiet-wait-s {args.quiet_wait_s:g}" + (f" --commit {args.commit}" if args.commit else ""))
    write_record("cpu2-split-sensitivity", command, config={
        "model": "configs/charlm_cpu.yaml", "compile_backend": args.backend, "sync_mode": "hooks",
        "settings": {k: {"first_bucket_mb": v[0], "bucket_mb": v[1]} for k, v in SETTINGS.items()
                     if k in args.settings},
        "monitor": "OverlapMonitor(every_n_steps=1), steps >= warmup", "quiet_share": QUIET_SHARE, "wall_s": wall,
        "commit": args.commit or _head_commit(),
    }, calibration=calibration, archived_link=None if archived is None else {
        "source": "benchmarks/results/cost-model-2026-12-01.json, measure_gloo, world 2, all_reduce samples",
        "latency_us": round(archived.latency_s * 1e6, 2), "bandwidth_GBps": round(archived.bandwidth_Bps / 1e9, 3),
    }, summary=summary, rows=rows, notes=NOTES)


if __name__ == "__main__":
    main()
