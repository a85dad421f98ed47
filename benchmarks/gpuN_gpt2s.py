"""Benchmark ``gpuN-gpt2s``: GPT-2 small, data parallel on N GPUs (NCCL): the ceiling, plain PyTorch DDP, Lightning
``ddp`` and ``static_dist``, side by side.

Workload per GPU: GPT-2 small in nanoGPT's shape (``benchmarks/_gpt2s.py:NanoGPT``: 124M parameters, tied head, the
12 blocks looped in ``forward``, the loss computed in ``forward``, ``training_step`` only calls the model), 16 x 1024
tokens, bf16 autocast, fused AdamW, synthetic tokens (each rank its own pool). Every contender is a fresh N-rank job
started the way its users start one, run once per round, interleaved (A B C, A B C):

    ceiling               plain PyTorch + torch.compile, each rank training alone (no process group, no
                          communication): what N GPUs could do if gradients were free (torchrun)
    plain_ddp_compile     plain PyTorch DistributedDataParallel + torch.compile (dynamo's DDPOptimizer splits the
                          graph at DDP's 25 MB buckets), a hand-written loop (torchrun)
    ddp_eager             Lightning DDPStrategy (the ``ddp`` defaults)
    ddp_compile           the same, fit(torch.compile(model))
    lightning_compile     Lightning's own strategy choice (``strategy="auto"``: one device on 1 GPU, DDP on more),
                          fit(torch.compile(model)): with ``--one-gpu``, Lightning's loop without a DDP wrapper
    static_dist           StaticDistStrategy with compile enabled and everything else default: the whole
                          training_step as one graph, cut at the gradient buckets (sync.mode hooks)
    static_dist_graph     sync.mode graph: the all-reduces inside the compiled backward graph
    static_dist_blocks    compile.regional true: the blocks compiled one by one (the default before 0.3)
    static_dist_whole     compile.regional false: the whole step, uncut (every gradient ready at the end)
    static_dist_bf16      sync.reduce_dtype bf16
    static_dist_bN        sync.bucket_mb N (25, 50, 100, 200): the bucket sweep (each bucket is a piece of the graph)
    static_dist_cbf16     compression bf16 (the phased compressor path)
    static_dist_powersgd  compression powersgd, rank 4
    static_dist_embed     embedding.shard true (the 50304 x 768 tied table sharded over the ranks)
    static_dist_rs        a 1 x N mesh (mesh.dp_shard -1) with sync.reduce reduce_scatter

Timing: after ``--warmup`` steps, ``--steps`` steps in windows of ``--window`` steps; the GPU is synchronized only
at window boundaries, so within a window the host runs ahead of the GPU as in a user's run and a framework's
host-side work per step costs what it really costs (a per-step synchronize would charge all of it to every step).
Each window's mean step is one figure; tokens/s per GPU = batch * seq / the median window step of rank 0 (the
slowest rank's is recorded beside it). MFU as gpu1-gpt2s; peak memory = the largest ``max_memory_allocated`` over
ranks. After the timed steps, ``--tail`` more steps run with the OverlapMonitor recording every step (static_dist
rows; its CUDA events and aggregation stay out of the timed windows) and the record keeps the median of each
``static_dist/*`` figure over them (graph mode: NaN, its collectives run inside the compiled graph, out of the
recorder's sight). ``exposed_comm_share`` = exposed_comm_ms / median step.

Summary (static_dist = the defaults, at N GPUs): ``vs_ceiling``, ``vs_plain_ddp_compile``,
``vs_lightning_ddp_compile`` (tokens/s ratios) and ``peak_gib_vs_lightning_ddp_compile``; the same ratios for every
contender under ``ratios``. Targets (benchmarks/README.md, at 2 GPUs): vs_ceiling >= 0.95, vs_plain_ddp_compile >= 1.03,
vs_lightning_ddp_compile >= 1.10, peak <= 1.0x. ``compressed_compute_ratio``: each compressed contender's
``static_dist/compute_ms`` over the defaults' at the same GPU count (issue 15: <= 1.03).

``--trace``: after the first round, one more static_dist job with the OverlapMonitor's profiler mode; its per-rank
``static_dist/trace_hidden_comm_fraction`` beside Holistic Trace Analysis's on the same traces (when ``hta`` is
importable), traces kept (gzip) in ``--out-dir``.

The inductor/Triton cache lives in ``--cache-dir`` (default: a fresh temporary one, removed at the end), shared by
the invocation's jobs: a graph compiles cold once, later jobs hit the cache. The record is rewritten after every
job, so a run cut short (``--budget-s``) keeps what it measured, and ``--resume RECORD`` adds rounds to it.

    python benchmarks/gpuN_gpt2s.py --rounds 5                       # every visible GPU, the main contenders
    python benchmarks/gpuN_gpt2s.py --rounds 1 --contenders ddp_compile,static_dist --out-dir "$OUT"
    python benchmarks/gpuN_gpt2s.py --tiny --rounds 1 --no-record    # 2 CPU ranks (Gloo), every code path
    python benchmarks/gpuN_gpt2s.py --contenders '' --one-gpu ceiling,lightning_compile,static_dist  # 1 GPU only

With ``--contenders ''`` only the ``--one-gpu`` jobs run (a machine with one GPU): the loops' own cost, no
communication; the record is ``gpuN-gpt2s-on-1gpu-<date>.json`` and its summary compares the 1-GPU rows.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gzip
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

from _common import ROOT, SAFE_ENV, run_job, worker_env

sys.path.insert(0, ROOT)  # the checkout's package, for the workload

PLAIN = ("ceiling", "ceiling_cudagraphs", "plain_ddp_compile", "plain_ddp_compile_b100")
"""Hand-written PyTorch loops, started with torchrun."""
ALONE = ("ceiling", "ceiling_cudagraphs")
"""Plain loops that train alone (no process group): run once, on one GPU, whatever the world."""
LIGHTNING_DDP = ("ddp_eager", "ddp_compile")
LIGHTNING = LIGHTNING_DDP + ("lightning_compile",)
"""Lightning's own strategies (no StaticDistStrategy)."""
#: contender -> the StaticDistStrategy sections it sets over the default (None: a plain loop or Lightning's DDPStrategy)
CONTENDERS: dict[str, Optional[dict[str, Any]]] = {
    "ceiling": None,
    "ceiling_cudagraphs": None,  # the ceiling with torch.compile(mode="reduce-overhead"): the GPU's own pace
    "plain_ddp_compile": None,
    "plain_ddp_compile_b100": None,  # DDP at our own bucket size (100 MiB: the baseline gets the tuning we got)
    "ddp_eager": None,
    "ddp_compile": None,
    "lightning_compile": None,
    "static_dist": {},
    "static_dist_graph": {"sync": {"mode": "graph"}},
    "static_dist_blocks": {"compile": {"regional": True}},
    "static_dist_whole": {"compile": {"regional": False}},
    "static_dist_bf16": {"sync": {"reduce_dtype": "bf16"}},
    # sync.schedule overlap: every bucket's collective issued as it fills, during backward (the step cut at the
    # buckets); the default before issue 34 (the default now is by_topology: after_backward on one node of GPUs)
    "static_dist_overlap": {"sync": {"schedule": "overlap"}},
    "static_dist_overlap_bf16": {"sync": {"schedule": "overlap", "reduce_dtype": "bf16"}},
    # sync.schedule: every bucket issued once backward ends (the step compiled uncut), and the trial of both
    "static_dist_after": {"sync": {"schedule": "after_backward"}},
    "static_dist_after_bf16": {"sync": {"schedule": "after_backward", "reduce_dtype": "bf16"}},
    "static_dist_auto": {"sync": {"schedule": "auto"}},
    # after_backward with the step taken whole (sync.optimizer_overlap false): every bucket waited for first
    "static_dist_after_noopt": {"sync": {"schedule": "after_backward", "optimizer_overlap": False}},
    "static_dist_sms2_bf16": {"sync": {"comm_sms": 2, "reduce_dtype": "bf16", "schedule": "overlap"}},
    # sync.comm_sms: the SMs a collective may take from backward (NCCL's max_ctas; the emulated link's SMs)
    "static_dist_sms4": {"sync": {"comm_sms": 4, "schedule": "overlap"}},
    "static_dist_sms8": {"sync": {"comm_sms": 8, "schedule": "overlap"}},
    "static_dist_sms2": {"sync": {"comm_sms": 2, "schedule": "overlap"}},
    "static_dist_after_sms4": {"sync": {"schedule": "after_backward", "comm_sms": 4}},
    "static_dist_b25": {"sync": {"bucket_mb": 25.0}},
    "static_dist_b50": {"sync": {"bucket_mb": 50.0}},
    "static_dist_b100": {"sync": {"bucket_mb": 100.0}},
    "static_dist_b200": {"sync": {"bucket_mb": 200.0}},
    # CUDA graphs per piece (inductor's reduce-overhead): the pieces' host cost is what paced the cut graph
    "static_dist_cudagraphs": {"compile": {"mode": "reduce-overhead"}},
    # compile.cudagraphs false: the compiled step launched kernel by kernel (the default before issue 33)
    "static_dist_nocg": {"compile": {"cudagraphs": False}, "sync": {"schedule": "overlap"}},
    # the defaults with the OverlapMonitor recording every step during the timed windows (its cost: monitor-cost)
    "static_dist_monitor": {},
    "static_dist_monitor10": {},  # the same, recording one step in ten (OverlapMonitor(every_n_steps=10))
    "static_dist_cbf16": {"compression": {"name": "bf16"}},
    "static_dist_powersgd": {"compression": {"name": "powersgd", "rank": 4}},
    "static_dist_powersgd_r1": {"compression": {"name": "powersgd", "rank": 1}},
    "static_dist_topk": {"compression": {"name": "topk", "density": 0.01}},
    "static_dist_embed": {"embedding": {"shard": True}},
    "static_dist_rs": {"mesh": {"dp_replicate": 1, "dp_shard": -1}, "sync": {"reduce": "reduce_scatter"}},
}
MAIN = "ceiling,plain_ddp_compile,plain_ddp_compile_b100,ddp_compile,static_dist,static_dist_graph"
SIMULATED = "ceiling,static_dist,static_dist_after,static_dist_bf16,static_dist_after_bf16,plain_ddp_compile"
"""``--simulate``'s default contenders (one GPU each, the world simulated)."""
STATIC_COMPILE = {"enabled": True, "backend": "inductor"}
PROFILE = {"enabled": True, "wait": 5, "warmup": 2, "active": 3}
PROFILE_TINY = {"enabled": True, "wait": 1, "warmup": 1, "active": 2}


def strategy_sections(name: str) -> dict[str, Any]:
    sections = copy.deepcopy(CONTENDERS[name]) or {}
    sections["compile"] = {**STATIC_COMPILE, **sections.get("compile", {})}
    return sections


def simulated_links(args: argparse.Namespace) -> Optional[Any]:
    """The worker's links when it runs in a simulated world (``--simulate``), else ``None``."""
    if not args.simulate_world:
        return None
    from _simulated import WindowLinks, parse_link

    return WindowLinks([parse_link(text) for text in args.link or ["free"]])


def total_steps(args: argparse.Namespace) -> int:
    """The training steps a worker runs: warmup, timed, tail; a persistent worker's come from the driver's plan."""
    if not args.gate:
        return args.warmup + args.steps + args.tail
    from _rounds import WARM_ROUNDS, steps_needed

    return steps_needed(args.warmup, (args.rounds + WARM_ROUNDS) * args.conditions, args.pre, args.window,
                        args.round_windows, args.profile_steps, args.tail)


# ------------------------------------------------------------------------------------------------------ worker
def worker(name: str, args: argparse.Namespace) -> None:
    """One rank of a contender's job: train warmup + steps + tail steps, write this rank's figures to ``<out>.rank<R>``."""
    import torch

    from _gpt2s import FULL, TINY, StepTimer, loader, new_nanogpt

    cfg, total, cuda = (TINY if args.tiny else FULL), total_steps(args), not args.tiny
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # unset in rank 0 of a Lightning job (it launches the rest)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("high")
    model = new_nanogpt(cfg)
    profile = (os.path.join(args.out_dir, f"profile-{name}-{args.gpus}gpu"), args.profile_steps) if args.profile_steps else None
    if profile is not None:
        os.makedirs(args.out_dir, exist_ok=True)
    links = simulated_links(args)
    if args.gate:  # a persistent worker: its rounds come from the driver (benchmarks/_rounds.py)
        from _rounds import Gate, RoundTimer

        timer: Any = RoundTimer(cuda, Gate(args.gate), args.warmup, args.pre, args.window, args.round_windows,
                                args.profile_steps, args.tail, args.trace_prefix,
                                on_window=links.switch if links is not None else None)
    else:
        timer = StepTimer(cuda, window=args.window, warmup=args.warmup, profile=profile,
                          on_window=links.switch if links is not None else None, windows=args.steps // args.window)
    batches = loader(cfg, total, device, seed=1234 + local_rank)
    if links is not None:
        links.prepare(device)
    if name in PLAIN:
        rank, world, extra = _plain_loop(name, model, batches, timer, device, cuda, args)
    else:
        rank, world, extra = _lightning_fit(name, model, batches, timer, args, cuda)
    from torch._dynamo.utils import counters

    record = {
        **(timer.timings() if args.gate else timer.timings(args.warmup, total)),
        "rank": rank,
        "world_size": world,
        # the whole job's: CUDA graphs allocate their pool when each graph is recorded (in the warm-up) and replay
        # in it without the allocator, so a peak taken after the warm-up would leave their activations out
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "n_params": model.num_parameters(),
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "tokens_per_step": cfg["batch"] * cfg["block_size"],
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        **({"window_links": links.window_names(len(timer.marks) - 1)} if links is not None and not args.gate else {}),
        **extra,
    }
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(record, f)


def _plain_loop(name: str, model: Any, batches: Any, timer: Any, device: Any, cuda: bool,
                args: argparse.Namespace) -> tuple[int, int, dict]:
    """The hand-written loop: autocast forward + loss, backward, fused AdamW step, zero_grad(set_to_none)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    model.to(device).train()
    optimizer = model.configure_optimizers()
    net = model
    if name.startswith("plain_ddp_compile"):
        if args.simulate_world:  # one process as rank 0 of the simulated world (DDP's reducer calls its Python backend)
            from lightning_static_dist.simulate import init_simulated_world

            init_simulated_world(args.simulate_world, datetime.timedelta(seconds=600))
            rank, world = 0, args.simulate_world
        else:
            dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None,
                                                        bucket_cap_mb=100 if name.endswith("_b100") else 25)
    from _gpt2s import train_plainly

    compiled = torch.compile(net, mode="reduce-overhead" if name == "ceiling_cudagraphs" else "default")
    train_plainly(compiled, optimizer, batches, timer, device)  # DDP: DDPOptimizer cuts at DDP's buckets
    if dist.is_initialized():
        dist.destroy_process_group()
    return rank, world, {}


def _lightning_fit(name: str, model: Any, batches: Any, timer: Any, args: argparse.Namespace,
                   cuda: bool) -> tuple[int, int, dict]:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_static_dist import OverlapMonitor, StaticDistStrategy, offer_of
    from lightning_static_dist.overlap.intervals import median_of

    tail_start = total_steps(args) - args.tail

    class TailMonitor(OverlapMonitor):
        """Records only after the timed steps: its CUDA events and per-step aggregation stay out of the timing."""

        def _recording(self, trainer: L.Trainer) -> bool:
            return super()._recording(trainer) and trainer.global_step >= tail_start

    if args.gate:
        from _rounds import lightning_timer

        callbacks: list[L.Callback] = [lightning_timer(timer)]
    else:
        callbacks = [timer]
    monitor = None
    if name == "lightning_compile":
        strategy: Any = "auto"
    elif CONTENDERS[name] is None:
        strategy = DDPStrategy()
    else:
        simulate = {"world_size": args.simulate_world} if args.simulate_world else None
        if simulate is not None and args.pin_link:  # the link from setup on: what sync.schedule measured probes
            simulate["link"] = simulated_links(args).links[0].spec
        strategy = StaticDistStrategy(**strategy_sections(name), simulate=simulate)
        profile = (PROFILE_TINY if args.tiny else PROFILE) if args.profile else None
        monitor = OverlapMonitor(profiler=profile) if profile else (
            OverlapMonitor() if name == "static_dist_monitor" else OverlapMonitor(every_n_steps=10)
            if name == "static_dist_monitor10" else TailMonitor())
        callbacks.append(monitor)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=args.gpus, strategy=strategy, precision="bf16-mixed",
        max_steps=total_steps(args), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks,
        # each rank's loader already yields its own batches (its own token pool)
        use_distributed_sampler=False, default_root_dir=args.profile or tempfile.gettempdir(),
    )
    trainer.fit(torch.compile(model) if name in ("ddp_compile", "lightning_compile") else model, train_dataloaders=batches)
    offer = offer_of(trainer)
    figures = offer.sync_figures() if offer is not None else None
    extra: dict[str, Any] = {"bytes_per_step": figures.bytes_per_round if figures is not None else None}
    measured = offer.measured_schedule() if offer is not None else None
    if measured is not None:  # sync.schedule measured: the probe's figures, each candidate's prediction, the choice
        extra["measured"] = measured.as_dict()
    choice = offer.schedule_choice() if offer is not None else None
    if choice is not None:  # sync.schedule: auto: what it chose, and what the trial cost
        extra["schedule_choice"] = {"choice": choice.choice, "trial_steps": choice.trial_steps,
                                    "trial_s": choice.trial_s, "step_s": choice.step_s}
    report = offer.compile_report if offer is not None else None
    if report is not None:
        extra["compile"] = {"graphs": len(report.graphs), "graph_breaks": len(report.graph_breaks),
                            "recompiles": len(report.recompiles), "fallbacks": len(report.fallbacks),
                            "pieces": report.splitter.pieces if report.splitter is not None else None,
                            "compile_s": round(report.compile_s, 1)}
    graph_mode = (CONTENDERS[name] or {}).get("sync", {}).get("mode") == "graph"
    # graph mode: the collectives run inside the compiled backward, where the recorder sees none (it would report
    # 0 ms of communication): its overlap figures are not measured, not zero
    if monitor is not None and trainer.is_global_zero:
        extra["trace"] = monitor.trace_history
        if not graph_mode:
            rows = [row for row in monitor.history if row["step"] >= tail_start]
            keys = sorted({k for row in rows for k in row if k != "step"})
            extra["overlap"] = {k.removeprefix("static_dist/"): median_of([row[k] for row in rows if k in row])
                                for k in keys}
    return trainer.global_rank, trainer.world_size, extra


# ------------------------------------------------------------------------------------------------------ driver
def run_one(name: str, gpus: int, args: argparse.Namespace, cache_dir: str, profile: Optional[str] = None,
            world: int = 0) -> dict:
    """One contender's N-rank job (``world``: a one-GPU job in a simulated world of that size); its ranks' records
    merged, or {"error": why}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--gpus", str(gpus), "--out", out,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--window", str(args.window),
               "--tail", str(args.tail), "--out-dir", args.out_dir, "--profile-steps", str(args.profile_steps)]
        if world:  # one process stands for the simulated world; its links switch window by window
            cmd += ["--simulate-world", str(world)] + [f"--link={text}" for text in args.link or ["free"]]
        elif name in PLAIN:  # a hand-written script is started by torchrun, one process per GPU
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] + cmd[1:]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--profile", profile] if profile else []
        env = worker_env(cache_dir)
        started = time.perf_counter()
        where = f"sim{world}" if world else f"{gpus}gpu"
        log = None if args.no_record else os.path.join(args.out_dir, f"{name}-{where}{'-trace' if profile else ''}.stderr.log")
        error = run_job(f"{name}@{gpus}", cmd, env, args.worker_timeout, log)
        if error is not None:
            return {"error": error, "wall_s": round(time.perf_counter() - started, 1)}
        ranks = []
        for rank in range(gpus):
            with open(f"{out}.rank{rank}") as f:
                ranks.append(json.load(f))
    rank0 = ranks[0]
    return {
        **{k: v for k, v in rank0.items() if k not in ("rank",)},
        "rank_median_step_s": [statistics.median(r["step_s"]) for r in ranks],
        "peak_mem_gib": max((r["peak_mem_gib"] for r in ranks if r["peak_mem_gib"] is not None), default=None),
        "final_loss_per_rank": [r["final_loss"] for r in ranks],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def build_rows(runs: dict[str, list[dict]], tiny: bool) -> list[dict]:
    from _gpt2s import FULL, PEAK_FLOPS, TINY, flops_per_token

    cfg, rows = (TINY if tiny else FULL), []
    for key, recs in runs.items():
        name, gpus = key.rsplit("@", 1)
        failed = [r for r in recs if "error" in r]
        row: dict[str, Any] = {"contender": name, "gpus": int(gpus),
                               "status": f"failed: {failed[0]['error']}" if failed else "ok"}
        ok = [r for r in recs if "error" not in r]
        if ok:
            median_s = statistics.median(s for r in ok for s in r["step_s"])
            tokens, n = ok[0]["tokens_per_step"], ok[0]["n_params"]
            overlap = {k: statistics.median(r["overlap"][k] for r in ok) for k in ok[0].get("overlap") or {}
                       if all(k in (r.get("overlap") or {}) for r in ok)}
            row.update({
                "tokens_per_s_per_gpu": round(tokens / median_s),
                "tokens_per_s_total": round(tokens / median_s * int(gpus)),
                "tokens_per_s_per_gpu_per_round": [round(tokens / statistics.median(r["step_s"])) for r in ok],
                "mfu": None if tiny else round(flops_per_token(cfg, n) * tokens / median_s / PEAK_FLOPS, 4),
                "step_ms_median": round(1e3 * median_s, 2),
                "slowest_rank_step_ms": round(1e3 * statistics.median(max(r["rank_median_step_s"]) for r in ok), 2),
                "peak_mem_gib": max((r["peak_mem_gib"] for r in ok if r["peak_mem_gib"] is not None), default=None),
                "bytes_per_step": ok[-1].get("bytes_per_step"),
                "compile": ok[-1].get("compile"),
                "worker_wall_s": [r["wall_s"] for r in ok],
                "final_loss": [round(r["final_loss"], 4) for r in ok],
                "dynamo_graphs": ok[-1]["dynamo_graphs"],
                "timed_steps": sum(len(r["step_s"]) * (r.get("window") or 1) for r in ok),
                "overlap": {k: (round(v, 4) if v == v else None) for k, v in overlap.items()} or None,
            })
            exposed = overlap.get("exposed_comm_ms")
            row["exposed_comm_share"] = round(exposed / (1e3 * median_s), 4) if exposed is not None and exposed == exposed else None
        rows.append(row)
    return rows


#: summary key -> the contender static_dist's defaults are compared with
REFERENCES = {"vs_ceiling": "ceiling", "vs_plain_ddp_compile": "plain_ddp_compile",
              "vs_lightning_ddp_compile": "ddp_compile"}
TARGETS = {"vs_ceiling": ">= 0.95", "vs_plain_ddp_compile": ">= 1.03", "vs_lightning_ddp_compile": ">= 1.10",
           "peak_gib_vs_lightning_ddp_compile": "<= 1.0", "exposed_comm_share": "<= 0.03",
           "compressed_compute_ratio": "<= 1.03"}
#: contenders with a compressor: their static_dist/compute_ms against the uncompressed defaults' (issue 15)
COMPRESSED = tuple(name for name, sections in CONTENDERS.items() if sections and "compression" in sections)


def build_summary(rows: list[dict]) -> dict:
    by = {(r["contender"], r["gpus"]): r for r in rows if r["status"] == "ok"}
    n = max((g for _, g in by), default=0)
    ratios: dict[str, dict[str, float]] = {key: {} for key in REFERENCES}
    exposed = {}
    for (name, gpus), row in sorted(by.items()):
        for key, reference in REFERENCES.items():
            if (reference, gpus) in by and name != reference:
                ratios[key][f"{name}@{gpus}"] = round(
                    row["tokens_per_s_per_gpu"] / by[(reference, gpus)]["tokens_per_s_per_gpu"], 4)
        if row.get("exposed_comm_share") is not None:
            exposed[f"{name}@{gpus}"] = row["exposed_comm_share"]
    summary: dict[str, Any] = {"gpus": n}
    for key in REFERENCES:
        summary[key] = ratios[key].get(f"static_dist@{n}")
    ours, lightning = by.get(("static_dist", n)), by.get(("ddp_compile", n))
    summary["peak_gib_vs_lightning_ddp_compile"] = (
        round(ours["peak_mem_gib"] / lightning["peak_mem_gib"], 4)
        if ours and lightning and ours.get("peak_mem_gib") and lightning.get("peak_mem_gib") else None)
    compute = {}
    for (name, gpus), row in sorted(by.items()):
        base = by.get(("static_dist", gpus))
        mine_ms = (row.get("overlap") or {}).get("compute_ms")
        base_ms = (base.get("overlap") or {}).get("compute_ms") if base else None
        if name in COMPRESSED and mine_ms and base_ms:
            compute[f"{name}@{gpus}"] = round(mine_ms / base_ms, 4)
    summary.update(ratios=ratios, exposed_comm_share=exposed, compressed_compute_ratio=compute, targets=TARGETS)
    return summary


def trace_check(gpus: int, args: argparse.Namespace, cache_dir: str) -> dict:
    """One profiled static_dist job; our trace figure per rank beside Holistic Trace Analysis's, traces kept."""
    trace_root = tempfile.mkdtemp(prefix="gpuN-trace-")
    rec = run_one("static_dist", gpus, args, cache_dir, profile=trace_root)
    if "error" in rec:
        return {"status": f"failed: {rec['error']}"}
    trace_dir = os.path.join(trace_root, "profiler")
    traces = sorted(os.listdir(trace_dir)) if os.path.isdir(trace_dir) else []
    if len(traces) != gpus:
        return {"status": f"failed: {len(traces)} traces written for {gpus} ranks"}
    result: dict[str, Any] = {"status": "ok", "gpus": gpus, "profiler": PROFILE_TINY if args.tiny else PROFILE,
                              "ours_logged": rec.get("trace")}
    try:
        from hta_check import compare

        result["per_rank"] = compare(trace_dir)
    except ImportError as exc:  # HolisticTraceAnalysis is an optional extra
        result["per_rank"] = None
        result["hta"] = f"not run: {exc}"
    if not args.no_record:
        for path in traces:
            with open(os.path.join(trace_dir, path), "rb") as src, gzip.open(
                    os.path.join(args.out_dir, f"gpuN-trace-{path}.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    shutil.rmtree(trace_root, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="ranks per job (default: every visible GPU; --tiny: 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 40; --tiny: 4)")
    parser.add_argument("--window", type=int, default=None, help="steps per synchronized window (default 10; --tiny: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 12; --tiny: 2)")
    parser.add_argument("--tail", type=int, default=None, help="monitored steps after the timed ones (default 6; --tiny: 2)")
    parser.add_argument("--contenders", default=None, help=f"comma list, run on N GPUs in this order; any of {', '.join(CONTENDERS)}")
    parser.add_argument("--one-gpu", default="", help="comma list also run on 1 GPU (after the N-GPU jobs); empty: none")
    parser.add_argument("--cache-dir", help="inductor/Triton cache shared by the jobs (default: a temporary one)")
    parser.add_argument("--trace", action="store_true", help="profile one static_dist job and check it against HTA")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="diagnosis: torch.profiler over each job's last N warmup steps (untimed), Chrome traces "
                             "profile-<contender>-<N>gpu-rank<R>.json.gz in --out-dir")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized smoke test: tiny model, Gloo ranks, no MFU")
    parser.add_argument("--worker-timeout", type=float, default=300.0, help="seconds before a job counts as failed")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no job that would likely end past this many seconds from the start")
    parser.add_argument("--resume", help="a record of this benchmark to add rounds to")
    parser.add_argument("--simulate", default="",
                        help="comma list of world sizes: every contender a one-GPU job in a simulated world of each size "
                             f"(the ceiling alone); default contenders {SIMULATED}")
    parser.add_argument("--link", action="append",
                        help="with --simulate, repeatable: free or [NAME=]GBPS,LATENCY_US,SMS[,IDLE_GBPS[,SM_GBPS]]; each "
                             "job's timed windows take the links in turn (--steps: a multiple of --window x links)")
    parser.add_argument("--calibrated", help="with --simulate: the --link name the 2-GPU record is compared at")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--no-record", action="store_true", help="print only; write no JSON record")
    parser.add_argument("--pre", type=int, default=3, help="with --simulate: untimed steps at each round's start")
    parser.add_argument("--round-windows", type=int, default=3, help="with --simulate: timed windows per round")
    parser.add_argument("--busy-host", type=int, default=0, metavar="K",
                        help="with --simulate: every round also run with the host loaded: the worker confined to K"
                             " cores, K busy-loop processes pinned there (benchmarks/_rounds.py)")
    parser.add_argument("--keep-logs", metavar="FILE.tar.gz", help="with --simulate: keep each worker's log there")
    parser.add_argument("--gate", help=argparse.SUPPRESS)
    parser.add_argument("--conditions", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--trace-prefix", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=tuple(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--simulate-world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pin-link", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (4 if args.tiny else 40)
    args.window = args.window if args.window is not None else (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 12)
    args.tail = args.tail if args.tail is not None else (2 if args.tiny else 6)
    persistent = bool(args.simulate or args.gate)  # (--profile-steps: its own command there, not warmup steps)
    if args.profile_steps < 0 or (not persistent and args.profile_steps >= args.warmup):
        parser.error(f"--profile-steps {args.profile_steps}: 0 (off) up to --warmup - 1 ({args.warmup - 1})")
    if args.steps % args.window:
        parser.error(f"--steps {args.steps} must be a multiple of --window {args.window}")
    if args.worker:
        worker(args.worker, args)
        return
    if args.simulate:
        simulate_main(args, parser)
        return
    args.contenders = MAIN if args.contenders is None else args.contenders

    def names(value: str, flag: str) -> list[str]:
        chosen = [c.strip() for c in value.split(",") if c.strip()]
        unknown = sorted(set(chosen) - set(CONTENDERS))
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; allowed: {', '.join(CONTENDERS)}")
        return chosen

    at_n, at_one = names(args.contenders, "--contenders"), names(args.one_gpu, "--one-gpu")
    if not at_n and not at_one:
        parser.error("--contenders and --one-gpu are both empty: nothing to run")
    import lightning
    import torch

    if args.gpus is None:
        args.gpus = 2 if args.tiny else torch.cuda.device_count()
    if at_n and (args.gpus < 2 or (not args.tiny and args.gpus > torch.cuda.device_count())):
        parser.error(f"--gpus {args.gpus}: needs 2 or more, at most the {torch.cuda.device_count()} GPUs visible")
    plan = [f"{c}@{args.gpus}" for c in at_n] + [f"{c}@1" for c in at_one]
    runs: dict[str, list[dict]] = {key: [] for key in plan}
    if args.resume:
        with open(args.resume) as f:
            for key, recs in json.load(f)["runs"].items():
                runs.setdefault(key, []).extend(recs)
    today = datetime.date.today().isoformat()
    scenario = (f"gpu{args.gpus}-gpt2s" if at_n else "gpuN-gpt2s-on-1gpu") + ("-tiny" if args.tiny else "")
    path = os.path.join(args.out_dir, f"{scenario}-{today}.json")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="gpuN-cache-")
    started = time.perf_counter()
    record: dict[str, Any] = {
        "scenario": scenario,
        "date": today,
        "hardware": {"cpu" if args.tiny else "gpu": None, "gpus": args.gpus if at_n else 1},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "lightning": lightning.__version__, "cuda": torch.version.cuda,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None},
        "command": "python benchmarks/gpuN_gpt2s.py " + " ".join(map(shlex.quote, sys.argv[1:])),
        "config": {**({"tiny": True} if args.tiny else {}), "steps": args.steps, "window": args.window,
                   "warmup": args.warmup, "monitored_tail_steps": args.tail,
                   **({"profiled_warmup_steps": args.profile_steps} if args.profile_steps else {}), "static_dist_compile": STATIC_COMPILE,
                   "contenders": {c: strategy_sections(c) if CONTENDERS[c] is not None else
                                  ("DDPStrategy()" if c in LIGHTNING_DDP else 'strategy="auto"' if c in LIGHTNING
                                   else "plain loop (torchrun)")
                                  for c in dict.fromkeys(at_one + at_n)},
                   "inductor_cache": "shared by the invocation's jobs (warm after a graph's first compile)",
                   "env": SAFE_ENV},
    }

    def save() -> None:
        rows = build_rows({k: v for k, v in runs.items() if v}, args.tiny)
        first_ok = next((rec for recs in runs.values() for rec in recs if "error" not in rec), {})
        record["hardware"]["cpu" if args.tiny else "gpu"] = first_ok.get("device")
        record.update(rows=rows, summary=build_summary(rows), runs=runs)
        if not args.no_record:  # after every job, so a run cut short still leaves its figures behind
            os.makedirs(args.out_dir, exist_ok=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=2)

    longest = 0.0
    for r in range(args.rounds):
        for key in plan[r % len(plan):] + plan[:r % len(plan)]:  # the order rotated every round
            name, gpus = key.rsplit("@", 1)
            if any("error" in rec for rec in runs[key]):
                continue  # a contender that failed once is not retried every round
            if args.budget_s is not None and time.perf_counter() - started + 1.2 * longest > args.budget_s:
                print(f"budget: {args.budget_s:.0f} s would be passed; {key} and the rest not run", flush=True)
                break
            rec = run_one(name, int(gpus), args, cache_dir)
            longest = max(longest, rec["wall_s"])
            runs[key].append(rec)
            figure = (f"{rec['tokens_per_step'] / statistics.median(rec['step_s']):10,.0f} tokens/s per GPU"
                      if "error" not in rec else f"FAILED: {rec['error']}")
            print(f"round {r + 1}/{args.rounds} {key:<24} {figure}  ({rec['wall_s']:.0f} s)", flush=True)
            save()
        else:
            if r == 0 and args.trace:  # after the first round: a run cut short by the budget still has it
                record["hta_check"] = trace_check(args.gpus, args, cache_dir)
                print(f"trace check: {json.dumps(record['hta_check'].get('per_rank') or record['hta_check'])[:800]}")
                save()
            continue
        break
    save()
    if not args.cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)

    print(f"\n{'contender':<22} {'GPUs':>4} {'tok/s/GPU':>10} {'MFU':>6} {'step ms':>8} {'overlap':>7} "
          f"{'exposed ms':>10} {'exp.share':>9} {'trig ms':>7} {'peak GiB':>8}  status")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for row in record["rows"]:
        if row["status"] != "ok":
            print(f"{row['contender']:<22} {row['gpus']:>4}  {row['status']}")
            continue
        o = row["overlap"] or {}
        print(f"{row['contender']:<22} {row['gpus']:>4} {row['tokens_per_s_per_gpu']:>10,} {fmt(row['mfu'], '.3f'):>6} "
              f"{row['step_ms_median']:>8.1f} {fmt(o.get('overlap_ratio'), '.2f'):>7} "
              f"{fmt(o.get('exposed_comm_ms'), '.2f'):>10} {fmt(row['exposed_comm_share'], '.3f'):>9} "
              f"{fmt(o.get('trigger_delay_ms'), '.2f'):>7} {fmt(row['peak_mem_gib'], '.1f'):>8}  ok")
    summary = record["summary"]
    print("\n" + "  ".join(f"{k}: {summary.get(k)}" for k in (*REFERENCES, "peak_gib_vs_lightning_ddp_compile")))
    if not args.no_record:
        print(f"recorded: {path}")


def simulate_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--simulate N[,M]``: every contender a persistent one-GPU worker in a simulated world (the ceiling alone), its
    rounds interleaved with the others' in an order rotated every round (``benchmarks/_rounds.py``)."""
    import lightning
    import torch

    from _rounds import BusyHost, drive
    from _simulated import parse_link, sim_rows, sim_summary
    from profile_summary import summarise

    worlds = [int(w) for w in args.simulate.split(",") if w.strip()]
    links = [parse_link(text) for text in args.link or ["free"]]
    if any(w < 2 for w in worlds):
        parser.error(f"--simulate {args.simulate}: world sizes >= 2")
    if args.round_windows % len(links):
        parser.error(f"--round-windows {args.round_windows}: a multiple of the {len(links)} links, so every link gets"
                     " the same windows")
    if args.calibrated is not None and args.calibrated not in {link.name for link in links}:
        parser.error(f"--calibrated {args.calibrated}: not a --link name ({', '.join(link.name for link in links)})")
    # a contender runs in every world of --simulate, or only in the one it names: "static_dist_nocg@2"
    # ... and "static_dist~cal" runs every window at the link named cal, set from setup on (sync.schedule measured
    # probes it there): the defaults' choice is made per link, so each link is a worker of its own
    specs = [c.strip() for c in (args.contenders if args.contenders is not None else SIMULATED).split(",") if c.strip()]
    chosen = list(dict.fromkeys(spec.split("@")[0] for spec in specs))
    only = {name: {int(w) for spec in specs if spec.startswith(name + "@") for w in [spec.split("@")[1]]}
            for name in chosen}
    at_one = [c.strip() for c in args.one_gpu.split(",") if c.strip()]
    by_name = {link.name: text for link, text in zip(links, args.link or ["free"])}
    pinned = {name: name.partition("~")[2] for name in chosen if "~" in name}
    strange = sorted(f"{name} (no --link {link!r})" for name, link in pinned.items() if link not in by_name)
    if strange:
        parser.error(f"--contenders: {', '.join(strange)}; links: {', '.join(by_name)}")
    unknown = sorted({c.partition("~")[0] for c in chosen + at_one} - set(CONTENDERS))
    if unknown:
        parser.error(f"--contenders/--one-gpu: unknown {unknown}; allowed: {', '.join(CONTENDERS)}")
    unsimulated = sorted({c.partition("~")[0] for c in chosen + at_one} & set(LIGHTNING))
    if unsimulated:  # Lightning's own strategies start their own (real) process group
        parser.error(f"--contenders {unsimulated}: not run in a simulated world; allowed with --simulate: the plain loops"
                     " and the static_dist contenders")
    plan = ([f"{c}@1" for c in chosen if c in ALONE]
            + [f"{c}@sim{w}" for w in worlds for c in chosen if c not in ALONE and (not only[c] or w in only[c])]
            + [f"{c}@1" for c in at_one if c not in ALONE and c not in PLAIN])
    args.gpus = 1
    args.conditions = 2 if args.busy_host else 1
    today = datetime.date.today().isoformat()
    scenario = "sim-gpt2s" + ("-tiny" if args.tiny else "")
    path = os.path.join(args.out_dir, f"{scenario}-{today}.json")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="gpuN-cache-")
    scratch = tempfile.mkdtemp(prefix="sim-gpt2s-")
    busy = BusyHost(sorted(os.sched_getaffinity(0))[:args.busy_host]) if args.busy_host else None
    record: dict[str, Any] = {
        "scenario": scenario, "date": today,
        "simulated": {"world_size": worlds, "link": [link.describe() for link in links],
                      "note": "simulated on one GPU: one process as rank 0 of N identical ranks; not a multi-GPU figure"},
        "hardware": {"gpus": 1, "gpu": None, "cpus": len(os.sched_getaffinity(0))},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__},
        "command": "python benchmarks/gpuN_gpt2s.py " + " ".join(map(shlex.quote, sys.argv[1:])),
        "config": {"warmup": args.warmup, "rounds": args.rounds, "per_round": f"{args.pre} untimed steps, then"
                   f" {args.round_windows} windows of {args.window} steps", "monitored_tail_steps": args.tail,
                   "order": "rotated every round; every contender one persistent worker (compiled once)",
                   "busy_host": busy.describe() if busy else None,
                   "profiled_steps": args.profile_steps or None,
                   "contenders": {c: strategy_sections(c.partition("~")[0]) if CONTENDERS[c.partition("~")[0]]
                                  is not None else "plain loop" for c in dict.fromkeys(chosen + at_one)}},
    }
    outs = {key: os.path.join(scratch, key.replace("@", "-") + ".json") for key in plan}
    commands = {}
    for key in plan:
        name, where = key.rsplit("@", 1)
        base, _, pin = name.partition("~")
        link_args = [f"--link={by_name[pin]}", "--pin-link"] if pin else [f"--link={text}" for text in args.link or ["free"]]
        commands[key] = [
            sys.executable, os.path.abspath(__file__), "--worker", base, "--gpus", "1", "--out", outs[key],
            "--warmup", str(args.warmup), "--window", str(args.window), "--tail", str(args.tail),
            "--rounds", str(args.rounds), "--conditions", str(args.conditions), "--pre", str(args.pre),
            "--round-windows", str(args.round_windows), "--profile-steps", str(args.profile_steps),
            "--trace-prefix", os.path.join(scratch, f"profile-{key.replace('@', '-')}"), "--out-dir", scratch,
            *(["--simulate-world", where[3:], *link_args] if where.startswith("sim") else []),
            *(["--tiny"] if args.tiny else [])]
    workers: dict[str, dict] = {}

    def save(results: dict[str, Any]) -> None:
        for key, trace in results["traces"].items():  # each profile summarised as soon as it is there
            if key not in record.setdefault("profiles", {}):
                record["profiles"][key] = summarise(trace, args.profile_steps)
        rows = sim_rows(results["runs"], links, workers)
        record["hardware"]["gpu"] = next((w.get("device") for w in workers.values()), None)
        record.update(rows=rows, summary=sim_summary(rows, links, args.calibrated), runs=results["runs"],
                      failed=results["failed"], profiles=record.get("profiles", {}))
        if not args.no_record:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=2)

    results = drive(commands, worker_env(cache_dir), args.rounds, busy, args.profile_steps > 0, args.worker_timeout,
                    scratch, save)
    for key in plan:
        if os.path.exists(f"{outs[key]}.rank0"):
            with open(f"{outs[key]}.rank0") as f:
                workers[key] = json.load(f)
    save(results)
    if args.keep_logs:  # one file: each worker's log
        import tarfile

        with tarfile.open(args.keep_logs, "w:gz") as tar:
            for name in sorted(os.listdir(scratch)):
                if name.endswith(".log"):
                    tar.add(os.path.join(scratch, name), arcname=name)
    shutil.rmtree(scratch, ignore_errors=True)
    if not args.cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"\n{'contender':<22} {'world':>5} {'link':<10} {'host':<5} {'step ms':>8} {'host ms':>8} {'x ceil':>7}"
          f" {'min':>7} {'spread':>7} {'peak GiB':>8}  per round")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for row in record["rows"]:
        print(f"{row['contender']:<22} {row['world']:>5} {str(row['link'] or '-'):<10} {row['host']:<5}"
              f" {row['step_ms_median']:>8.2f} {row['host_ms_median']:>8.2f} {fmt(row['vs_ceiling'], '.4f'):>7}"
              f" {fmt(row['vs_ceiling_min'], '.4f'):>7} {row['spread']:>7.4f} {fmt(row['peak_mem_gib'], '.2f'):>8}"
              f"  {row['step_ms_per_round']}")
    for key, why in results["failed"].items():
        print(f"{key}: FAILED: {why}")
    for key, prof in record["profiles"].items():
        print(f"profile {key}: " + ", ".join(f"{k} {prof.get(k)}" for k in (
            "step_ms", "compute_ms", "idle_ms", "host_lead_ms_median", "host_bound_kernel_share", "kernels_per_step")))
    print("\n" + json.dumps(record["summary"]))
    if not args.no_record:
        print(f"recorded: {path}")


if __name__ == "__main__":
    main()
