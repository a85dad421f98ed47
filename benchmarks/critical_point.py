"""Benchmark ``critical-point``: how aggressive each gradient compressor can be before training falls behind exact.

Every setting trains the main job's model (``configs/charlm_cpu.yaml``: CharGPT on the standard library's sources)
from the same seed on the same batches, with ``static_dist`` and ``strategy.compression`` as below, in a fresh
2-rank job (Lightning's subprocess launcher, as ``lsd-train`` starts them; with ``--shared-gpu`` two one-device
"nodes" on one GPU over Gloo, for a machine with one GPU). Compression starts after a warm-up of ``--start-step``
exact steps, as PowerSGD and Deep Gradient Compression recommend.

    exact                          fp32 all-reduce, no compression (the reference)
    qsgd_8bit .. qsgd_2bit         QSGD, sign + 7/3/2/1 magnitude bits: levels 127/7/3/1 (int8 on the wire)
    topk_10pct .. topk_0.1pct      TopK 10 / 1 / 0.1 % with error feedback
    powersgd_r16 .. powersgd_r1    PowerSGD rank 16/8/4/2/1, error feedback, warm start
    torch_powersgd_r4              not ours: PyTorch's own PowerSGD hook at rank 4 under Lightning's ddp (a reference)

Figures per setting: payload bytes per compressed step (the synchroniser's count, median over the steps after the
warm-up, the guard's check steps left out) and compression_ratio = uncompressed / that; the final loss ratio to
exact (mean training loss of the last 10 % of steps) and the validation loss ratio at the end; the first step at
which the smoothed loss is more than 3 % and 10 % above exact's, or the step it diverged; the relative gradient
error |g_hat - g| / |g| that the CompressionGuard watches, measured by the guard itself every ``--check-every``
steps (thresholds set so that it never switches). The bookkeeping is
``lightning_static_dist/compression/critical.py``. Output: a table, ``results/<scenario>-<date>.json`` and a plot
beside it (final loss ratio against compression ratio, one curve per family, the critical point ringed).

    python benchmarks/critical_point.py                                  # the CPU sweep, 15-25 min on 2 cores
    python benchmarks/critical_point.py --steps 20 --settings exact,powersgd_r4 --no-record
    python benchmarks/critical_point.py --device cuda --width gpt2 --steps 2000   # GPT-2 width, inductor
    python benchmarks/critical_point.py --device cuda --shared-gpu --width gpt2 --keep-dir runs/cp  # one GPU, resumable
    lsd-report benchmarks/results/cpu2-critical-point-2026-12-01.json                 # a recorded sweep again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from _common import ROOT, SAFE_ENV, free_port, run_worker, write_record

from lightning_static_dist.compression.compressors import QSGDCompressor
from lightning_static_dist.compression.critical import critical_points, sweep_row
from lightning_static_dist.offer import offer_of
from lightning_static_dist.sweep_report import format_table, plot_sweep, sweep_title

CONFIG = os.path.join(ROOT, "configs", "charlm_cpu.yaml")


class TwoBitQSGD(QSGDCompressor):
    """QSGD with one magnitude level (sign + 1 bit: -1, 0, +1 times the chunk norm). ``strategy.compression.levels``
    must be >= 2, so the sweep names this class by its path instead."""

    def __init__(self) -> None:
        super().__init__(levels=1)


#: setting: (family, level from mildest = 0, strategy.compression options)
SETTINGS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "exact": ("exact", 0, {"name": "none"}),
    "qsgd_8bit": ("qsgd", 0, {"name": "qsgd", "levels": 127}),
    "qsgd_4bit": ("qsgd", 1, {"name": "qsgd", "levels": 7}),
    "qsgd_3bit": ("qsgd", 2, {"name": "qsgd", "levels": 3}),
    "qsgd_2bit": ("qsgd", 3, {"name": "critical_point.TwoBitQSGD"}),
    "topk_10pct": ("topk", 0, {"name": "topk", "density": 0.1}),
    "topk_1pct": ("topk", 1, {"name": "topk", "density": 0.01}),
    "topk_0.1pct": ("topk", 2, {"name": "topk", "density": 0.001}),
    "powersgd_r16": ("powersgd", 0, {"name": "powersgd", "rank": 16}),
    "powersgd_r8": ("powersgd", 1, {"name": "powersgd", "rank": 8}),
    "powersgd_r4": ("powersgd", 2, {"name": "powersgd", "rank": 4}),
    "powersgd_r2": ("powersgd", 3, {"name": "powersgd", "rank": 2}),
    "powersgd_r1": ("powersgd", 4, {"name": "powersgd", "rank": 1}),
    # not ours: PyTorch's own PowerSGD (DDP's powerSGD_hook, error feedback and warm start on, its defaults
    # otherwise) at rank 4 under Lightning's `ddp`, compressing from the same step: tells an implementation fault of
    # ours from what the algorithm does to this model
    "torch_powersgd_r4": ("torch_reference", 0, {"name": "none"}),
}
#: the families whose critical point is sought (the reference row is beside them, not one of them)
FAMILIES = ("qsgd", "topk", "powersgd")
#: the reference settings: rank of torch's PowerSGD hook
TORCH_POWERSGD = {"torch_powersgd_r4": 4}
QSGD_BITS = {"qsgd_8bit": 8, "qsgd_4bit": 4, "qsgd_3bit": 3, "qsgd_2bit": 2}
#: the main job as configured, or the same model family at GPT-2 small's shape (d = 768, 12 layers, 12 heads,
#: 1024 bytes of context) with GPT-2's learning rate
WIDTHS = {
    "main": [],
    "gpt2": ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
             "data.block_size=1024", "model.lr=6e-4", "data.max_bytes=20000000"],
}
DEVICES = {
    "cpu": [],
    "cuda": ["trainer.accelerator=gpu", "trainer.precision=bf16-mixed"],
}
NOTES = [
    "QSGD sends one int8 per value at every level (levels 127/7/3/1 = 8/4/3/2 bits with the sign), so its measured"
    " bytes do not shrink with the bits; packed_compression_ratio_estimate is what bit-packing would send.",
    "qsgd_2bit is levels=1 (-1, 0, +1 x the chunk norm), built by class path (critical_point.TwoBitQSGD): the config"
    " accepts levels >= 2 only.",
    "rel_error: |g_hat - g| / |g| of one step, as the CompressionGuard measures it (the exact average of the same"
    " gradients beside the compressed one, every check_every steps after the warm-up). With error feedback (TopK,"
    " PowerSGD) g_hat carries earlier steps' residuals, so it can exceed 1 while training is fine; QSGD's error is"
    " unbiased noise that averages out over steps.",
    "bytes_per_step: the median over compressed steps, the check steps (which also send the exact copy) left out;"
    " run_compression_ratio counts the whole run, the warm-up's exact steps too (the check steps left out).",
]
TARGETS = {  # at GPT-2 width (benchmarks/README.md): setting -> (minimum compression ratio, maximum final loss ratio)
    "powersgd_r4": (50.0, 1.03),
    "topk_1pct": (20.0, 1.05),
}


def job_overrides(args: argparse.Namespace, compression: dict[str, Any]) -> list[str]:
    """The ``dotted.key=value`` overrides of one setting's job, on top of ``configs/charlm_cpu.yaml``."""
    overrides = [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
                 "trainer.enable_checkpointing=false", "trainer.enable_model_summary=false", "trainer.logger=false",
                 f"trainer.devices={args.devices}", *DEVICES[args.device], *WIDTHS[args.width]]
    if args.compile != "off":
        overrides += ["strategy.compile.enabled=true", f"strategy.compile.backend={args.compile}"]
    overrides += [f"strategy.compression.{key}={value}" for key, value in compression.items()]
    if compression["name"] != "none":
        overrides.append(f"strategy.compression.start_step={args.start_step}")
    return overrides + list(args.set)


def worker(setting: str, args: argparse.Namespace, out: str) -> None:
    """One 2-rank training job; rank 0 writes its per-step losses, bytes and gradient errors to ``out``."""
    sys.path.insert(0, ROOT)
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_static_dist import CompressionGuard, RunSummary, StaticDistStrategy, load_run_config

    class StepLog(Callback):
        """Per optimizer step: the training loss (a tensor until the end: no host read per step), the bytes the
        synchroniser sent, and on the guard's check steps after the warm-up the error the guard measured."""

        def __init__(self, guard: Optional[CompressionGuard]) -> None:
            self.guard = guard
            self.losses: list[Any] = []
            self.step_bytes: list[int] = []
            self.rel_errors: list[tuple[int, float]] = []
            self._sent = 0

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.losses.append(loss.detach().float())
            if setting in TORCH_POWERSGD:  # DDP's hook counts nothing
                return
            sent = trainer.strategy.offer.sync_figures().bytes_sent
            self.step_bytes.append(sent - self._sent)
            self._sent = sent
            step = trainer.global_step - 1  # the step that just ran (the guard measured it if it was a check step)
            guard = self.guard
            if (guard is not None and step >= max(1, args.start_step) and step % guard.check_every_n_steps == 0
                    and guard.last_rel_error is not None):
                self.rel_errors.append((step, guard.last_rel_error))

    family, _, compression = SETTINGS[setting]
    overrides = job_overrides(args, compression)
    peer = None
    if args.shared_gpu:
        peer = start_as_two_nodes(args)
        overrides += ["trainer.num_nodes=2", "trainer.devices=1"]
        watch_the_other_rank(peer)
    cfg = load_run_config(CONFIG, overrides)
    L.seed_everything(cfg.seed)
    model, data = cfg.model.instantiate("model"), cfg.data.instantiate("data")
    # the guard's own measurement, with thresholds it can never reach: it reads the error and never switches
    guard = None if family in ("exact", "torch_reference") else CompressionGuard(
        check_every_n_steps=args.check_every, max_rel_error=math.inf, loss_spike=math.inf, patience=2**31)
    summary, log = RunSummary(warmup_steps=5), StepLog(guard)
    callbacks = [summary, *([guard] if guard is not None else []), log]  # the log reads the guard after it ran
    backend = {"process_group_backend": "gloo"} if args.shared_gpu else {}
    if setting in TORCH_POWERSGD:
        strategy = torch_powersgd_strategy(TORCH_POWERSGD[setting], args.start_step, cfg.strategy.timeout_s, backend)
    else:
        strategy = StaticDistStrategy.from_config(cfg.strategy, **backend)
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, **cfg.trainer)
    try:
        trainer.fit(model, datamodule=data)
    except BaseException:
        if peer is not None:
            peer.kill()  # it would wait for this rank until the process group's timeout
        raise
    if trainer.is_global_zero:
        hook_state = getattr(trainer.strategy, "powersgd_state", None)
        offer = offer_of(trainer)
        figures = offer.sync_figures() if offer is not None else None
        reducer = offer.compressing_reducer if offer is not None else None
        # (white-box: the parameters the compressor takes, from the synchroniser the offer summarises)
        sync = trainer.strategy._parts.gradients.synchronizer if reducer is not None else None
        taken = 0 if reducer is None else sum(p.numel() for p in sync.parameters if reducer.compressor.takes(p.shape))
        record = {
            "losses": [float(x) for x in log.losses],
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "step_bytes": log.step_bytes,
            "dense_bytes_per_step": None if figures is None else figures.dense_bytes_per_round,
            "rel_errors": log.rel_errors,
            "compressed_numel": taken,
            "step_s": summary.step_seconds[5:],
            "nonfinite_buckets": 0 if reducer is None else reducer.nonfinite_buckets,
            "parameters": sum(p.numel() for p in model.parameters()),
            "model": {key: getattr(model.hparams, key) for key in ("n_layer", "n_head", "n_embd", "block_size", "lr")},
            "batch_size": cfg.data.init_args.get("batch_size"),
            "seed": cfg.seed,
            "args": job_identity(setting, args),
            # PyTorch's hook counts its iterations: past start_powerSGD_iter means it compressed
            **({"hook_iterations": hook_state.iter, "hook_start": hook_state.start_powerSGD_iter}
               if hook_state else {}),
        }
        with open(out, "w") as f:
            json.dump(record, f)
    if peer is not None and peer.wait() != 0:
        sys.exit(f"rank 1 exited with {peer.returncode}")


def torch_powersgd_strategy(rank: int, start_step: int, timeout_s: float, backend: dict[str, str]) -> Any:
    """Lightning's ``ddp`` with PyTorch's PowerSGD communication hook at ``rank``, compressing from ``start_step``,
    eager (``strategy.compile`` is ours; on CPU, where the recorded comparison ran, it is off for both)."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from typing_extensions import override

    class HookedDDP(DDPStrategy):
        """Lightning registers a DDP communication hook on CUDA devices only (and drops it silently elsewhere): the
        hook is registered here on any device (DDP's hooks run on Gloo too)."""

        powersgd_state: Optional[powerSGD_hook.PowerSGDState] = None

        @override
        def configure_ddp(self) -> None:
            super().configure_ddp()
            self.powersgd_state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=max(2, start_step))
            self.model.register_comm_hook(self.powersgd_state, powerSGD_hook.powerSGD_hook)

    return HookedDDP(timeout=timedelta(seconds=timeout_s), **backend)


def start_as_two_nodes(args: argparse.Namespace) -> Optional[subprocess.Popen]:
    """``--shared-gpu``: this job's two ranks as two one-device "nodes" of this machine, both on GPU 0, over Gloo
    (NCCL refuses two ranks on one GPU; Gloo reduces CUDA tensors through host memory). The first call (rank 0)
    starts rank 1 as a copy of this process and returns it; Lightning reads the launch from the environment
    (``LOCAL_RANK`` set: started externally; ``NODE_RANK``: the global rank). Rank 1 returns ``None``."""
    if "LOCAL_RANK" in os.environ:
        return None
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    peer = subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, **launch, "NODE_RANK": "1"})
    os.environ.update(launch, NODE_RANK="0")
    return peer


def watch_the_other_rank(peer: Optional[subprocess.Popen]) -> None:
    """``--shared-gpu``: end this rank at once when the other one is gone, instead of waiting in a collective until
    the process group's timeout. Rank 0 watches rank 1's exit status; rank 1 (``peer`` None) watches for its parent,
    rank 0, to disappear."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if peer is not None and peer.poll() is not None:
                if peer.returncode == 0:
                    return
                print(f"critical_point: rank 1 exited with {peer.returncode}", file=sys.stderr, flush=True)
                os._exit(1)
            if peer is None and os.getppid() != parent:
                print("critical_point: rank 0 is gone", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="critical-point-peer-watch", daemon=True).start()


def job_identity(setting: str, args: argparse.Namespace) -> list[str]:
    """What a kept record was run with (``--keep-dir`` reuses it only for the same): the worker's options, less the
    warm-up for the exact run, which does not depend on it."""
    identity = worker_args(args)
    if SETTINGS[setting][0] == "exact":
        at = identity.index("--start-step")
        del identity[at:at + 2]
    return identity


def worker_args(args: argparse.Namespace) -> list[str]:
    """The options every setting's job gets (the parent's, minus what only the parent reads)."""
    return ["--steps", str(args.steps), "--start-step", str(args.start_step), "--check-every", str(args.check_every),
            "--device", args.device, "--devices", str(args.devices), "--width", args.width, "--compile", args.compile,
            *(["--shared-gpu"] if args.shared_gpu else []),
            *(["--set", *args.set] if args.set else [])]


def _measured(step: int, args: argparse.Namespace, compressed: bool) -> bool:
    """A guard check step: its round also sends the exact average of the compressed gradients, for comparison."""
    return compressed and step >= max(1, args.start_step) and step % args.check_every == 0


def steady_bytes(rec: dict[str, Any], args: argparse.Namespace, compressed: bool) -> int:
    """Median payload of the compressed steps (after the warm-up, the guard's check steps left out)."""
    steps = range(args.start_step if compressed else 0, len(rec["step_bytes"]))
    plain = [rec["step_bytes"][s] for s in steps if not _measured(s, args, compressed)]
    return round(statistics.median(plain or rec["step_bytes"]))


def run_ratio(rec: dict[str, Any], args: argparse.Namespace, compressed: bool) -> float:
    """Uncompressed over sent bytes for the whole run, the warm-up's exact steps included (the check steps not)."""
    kept = [b for s, b in enumerate(rec["step_bytes"]) if not _measured(s, args, compressed)]
    return round(rec["dense_bytes_per_step"] * len(kept) / sum(kept), 2)


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The sweep table: one row per setting that ran (``critical.ROW_KEYS`` plus bytes, ratios and timings)."""
    ref = results["exact"]
    rows = []
    for setting, rec in results.items():
        family, level, compression = SETTINGS[setting]
        if "failed" in rec:
            rows.append({"setting": setting, "family": family, "level": level, "failed": rec["failed"]})
            continue
        compressed = family != "exact"
        row = sweep_row(setting, family, level, rec["losses"], ref["losses"], val_loss=rec["val_loss"],
                        reference_val_loss=ref["val_loss"],
                        rel_errors=[e for _, e in rec["rel_errors"]] if compressed else [0.0],
                        start=args.start_step if compressed else 0, window=args.window)
        counted = setting not in TORCH_POWERSGD  # DDP's hook counts no bytes
        nbytes = steady_bytes(rec, args, compressed) if counted else None
        dense = rec["dense_bytes_per_step"]
        row.update(
            compression=compression if counted else {"torch_powersgd_hook_rank": TORCH_POWERSGD[setting]},
            bytes_per_step=nbytes,
            compression_ratio=round(dense / nbytes, 2) if counted else None,
            run_compression_ratio=run_ratio(rec, args, compressed) if counted else None,
            rel_errors=[[s, round(e, 4)] for s, e in rec["rel_errors"]],
            step_ms_median=round(1e3 * statistics.median(rec["step_s"]), 1) if rec["step_s"] else None,
            nonfinite_buckets=rec["nonfinite_buckets"],
            wall_s=rec["wall_s"],
        )
        if not counted:  # how many iterations PyTorch's hook saw, and from which one it compressed
            row.update(hook_iterations=rec.get("hook_iterations"), hook_start=rec.get("hook_start"))
        if setting in QSGD_BITS:
            # every level travels as one int8 per value; what bit-packing those values would send (estimate: the
            # per-bucket padding to whole 512-value chunks is ignored)
            packed = nbytes - rec["compressed_numel"] * (1 - QSGD_BITS[setting] / 8)
            row["bits"] = QSGD_BITS[setting]
            row["packed_compression_ratio_estimate"] = round(dense / packed, 2)
        if setting in TARGETS:
            ratio, loss = TARGETS[setting]
            row["target_at_gpt2_width"] = f"ratio >= {ratio}x, final loss <= {loss}x"
            row["target_met_here"] = (row["compression_ratio"] >= ratio and row["final_loss_ratio"] is not None
                                      and row["final_loss_ratio"] <= loss)
        rows.append(row)
    return rows


def guard_evidence(rows: list[dict[str, Any]], points: dict[str, Optional[str]]) -> dict[str, Any]:
    """Per family: the measured gradient error at its critical setting and at the first setting past it — the
    range a ``max_rel_error`` that separates them must fall in."""
    evidence = {}
    for family, point in points.items():
        members = sorted((r for r in rows if r["family"] == family and "failed" not in r), key=lambda r: r["level"])
        at = next((r for r in members if r["setting"] == point), None)
        past = next((r for r in members if at is None or r["level"] > at["level"]), None)
        evidence[family] = {
            "critical": point,
            "rel_error_median_at_critical": at and at["rel_error_median"],
            "rel_error_max_at_critical": at and at["rel_error_max"],
            "first_past_critical": past and past["setting"],
            "rel_error_median_past_critical": past and past["rel_error_median"],
        }
    return evidence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--start-step", type=int, default=None,
                        help="exact steps before compression starts (default: 10 %% of --steps)")
    parser.add_argument("--check-every", type=int, default=10, help="steps between the guard's error measurements")
    parser.add_argument("--window", type=int, default=20, help="steps in the trailing mean of the loss curves")
    parser.add_argument("--tolerance", type=float, default=1.03, help="final loss ratio a critical point may reach")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--device", choices=tuple(DEVICES), default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="ranks (CPU processes or GPUs)")
    parser.add_argument("--width", choices=tuple(WIDTHS), default="main")
    parser.add_argument("--compile", choices=("off", "aot_eager", "inductor"), default=None,
                        help="strategy.compile backend (default: inductor on cuda; off on cpu, where compiling does not"
                             " change the step time (cpu2-charlm) and costs 10 s (aot_eager) to 45 s (inductor) per job)."
                             " The compressors run in the synchroniser's hooks, outside the compiled graph, either way")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="run the two ranks on one GPU over Gloo (a 1-GPU machine); quality figures only, the"
                             " step times are not those of two GPUs")
    parser.add_argument("--keep-dir", help="keep each setting's record in this folder and reuse the ones already there"
                                           " (a sweep split over several calls)")
    parser.add_argument("--tag", help="appended to the scenario's name (a partial sweep beside the full one)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--no-record", action="store_true", help="print only; do not write benchmarks/results/")
    parser.add_argument("--rows-json", help="also write the table, critical points and curves to this file")
    parser.add_argument("--worker", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.start_step is None:
        args.start_step = args.steps // 10
    if args.compile is None:
        args.compile = "off" if args.device == "cpu" else "inductor"
    if args.shared_gpu and (args.device != "cuda" or args.devices != 2):
        sys.exit("--shared-gpu: allowed with --device cuda and --devices 2 only")
    if args.worker:
        worker(args.worker, args, args.out)
        return
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or names[0] != "exact":
        sys.exit(f"--settings={args.settings!r}: allowed: {', '.join(SETTINGS)} (the first must be 'exact')")
    if args.device == "cuda":
        os.environ.update(SAFE_ENV)

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        kept = args.keep_dir and os.path.join(args.keep_dir, f"{name}.json")
        if kept and os.path.exists(kept):
            with open(kept) as f:
                results[name] = json.load(f)
            if results[name].get("args") != job_identity(name, args):
                sys.exit(f"--keep-dir: {kept} was run with {results[name].get('args')}, not with"
                         f" {job_identity(name, args)}: remove it or use another folder")
            print(f"{name:<14} reused {kept}", flush=True)
            continue
        try:
            results[name] = run_worker(__file__, name, *worker_args(args))
        except SystemExit as failure:  # run_worker exits with the job's stderr tail; the sweep goes on without it
            if name == "exact":
                raise
            print(failure, file=sys.stderr)
            results[name] = {"failed": str(failure).splitlines()[0]}
        print(f"{name:<14} done in {results[name].get('wall_s', 0):.0f} s", flush=True)
        if kept and "failed" not in results[name]:
            os.makedirs(args.keep_dir, exist_ok=True)
            with open(kept, "w") as f:
                json.dump(results[name], f)
    rows = table(results, args)
    points = critical_points([r for r in rows if "failed" not in r and r["family"] in FAMILIES], args.tolerance)
    print(format_table(rows, points))
    print(f"critical points (final loss <= {args.tolerance}x exact): {points}")
    ref = results["exact"]
    # two ranks on one GPU (--shared-gpu) are a gpu1 record
    scenario = f"{'cpu' if args.device == 'cpu' else 'gpu'}{1 if args.shared_gpu else args.devices}-critical-point"
    scenario += f"-{args.tag}" if args.tag else ""
    settings = {"steps": args.steps, "start_step": args.start_step, "check_every": args.check_every,
                "window": args.window, "tolerance": args.tolerance, "device": args.device, "devices": args.devices,
                "width": args.width, "compile": args.compile, "shared_gpu": args.shared_gpu, "overrides": args.set,
                "seed": ref["seed"], "compressor_seed": 0, "model": ref["model"], "parameters": ref["parameters"],
                "batch_size_per_rank": ref["batch_size"]}
    by_name = {r["setting"]: r for r in rows}
    r4 = by_name.get("powersgd_r4", {})
    summary = {
        "critical_points": points,
        "tolerance": args.tolerance,
        "compression_ratio": {r["setting"]: r.get("compression_ratio") for r in rows},
        "final_loss_ratio": {r["setting"]: r.get("final_loss_ratio") for r in rows},
        "powersgd_r4_bytes_ratio": r4.get("compression_ratio"),
        "powersgd_r4_loss_ratio": r4.get("final_loss_ratio"),
        "guard_evidence": guard_evidence(rows, points),
    }
    curves = {name: [round(x, 4) for x in rec["losses"]] for name, rec in results.items() if "failed" not in rec}
    if args.rows_json:
        with open(args.rows_json, "w") as f:
            json.dump({"settings": settings, "rows": rows, "summary": summary, "curves": curves}, f, indent=1)
    if args.no_record:
        return
    command = "python benchmarks/critical_point.py " + " ".join(sys.argv[1:])
    hardware = None if args.device == "cpu" else {
        "gpus": 1 if args.shared_gpu else args.devices, "ranks": args.devices,
        "backend": "gloo (both ranks on GPU 0)" if args.shared_gpu else "nccl", "cores": os.cpu_count()}
    notes = NOTES + ([] if args.compile != "off" else [
        "compile off: the compressors run in the synchroniser's hooks outside any compiled graph, so compiling does"
        " not change what is measured here, and on these CPUs it does not change the step time (cpu2-charlm) while"
        " costing 10-45 s per job; the GPU sweep compiles (inductor)."])
    if args.shared_gpu:
        notes.append("Both ranks share one GPU over Gloo (--shared-gpu): the losses, bytes and gradient errors are"
                     " those of a 2-rank run; the step times are not those of two GPUs.")
    if any(name in TORCH_POWERSGD for name in results) and args.compile != "off":
        notes.append("The torch_powersgd rows run eager (PyTorch's hook under Lightning's ddp), ours compiled.")
    path = write_record(scenario, command.strip(), **({"hardware": hardware} if hardware else {}),
                        config=os.path.relpath(CONFIG, ROOT), settings=settings, notes=notes, rows=rows,
                        summary=summary, curves=curves)
    title = sweep_title(scenario, settings)
    plotted = plot_sweep(rows, points, args.tolerance, path[: -len(".json")] + ".png", title)
    print(f"plotted: {os.path.relpath(plotted, ROOT)}")


if __name__ == "__main__":
    main()
