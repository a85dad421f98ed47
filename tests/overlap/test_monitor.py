"""OverlapMonitor on 2 real Gloo ranks: every metric in the CSV, an uncut whole-step compile told apart from the
default (cut at the buckets), timeline pictures, and lsd-report on the finished run."""

from __future__ import annotations

import csv
import glob
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from _dist import RankPool
from lightning.pytorch.loggers import CSVLogger
from lightning_static_dist import OverlapMonitor, StaticDistStrategy
from lightning_static_dist.cli import report
from lightning_static_dist.overlap.intervals import median_of
from lightning_static_dist.callbacks.monitor import METRICS
from lightning_static_dist.overlap.trace import TRACE_METRICS, classify, load_trace

pytestmark = pytest.mark.multiprocess
MONITOR_BUCKETS = {"first_bucket_mb": 0.6, "bucket_mb": 1.2}


class Stack(L.LightningModule):
    """Eight 384-wide Linear+GELU blocks: enough backward compute for 1.1 MiB buckets to overlap it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(384, 384), nn.GELU()) for _ in range(8)])
        self.data = torch.randn(64 * 32, 384, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch[0]).square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.data), batch_size=256)  # backward compute well above bucket packing


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """2 Gloo ranks for the module's fits that hand nothing back through Lightning's launcher: one start-up."""
    with RankPool(2) as pool:
        yield pool


def _fit_on_this_rank(rank: int, world: int, tmp: str, strategy_kwargs: dict[str, Any], steps: int,
                      callbacks: list[Any]) -> bool:
    """A 2-rank fit of :class:`Stack` on a pool's rank (the Trainer joins the ranks' group) logging to ``tmp``'s
    ``metrics.csv``; whether the Trainer had an :class:`OverlapMonitor` among its callbacks."""
    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
    torch._dynamo.reset()  # (compiled as in a fresh process: nothing cached by an earlier fit on these ranks)
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=StaticDistStrategy(**strategy_kwargs),
                        max_steps=steps, log_every_n_steps=1, logger=CSVLogger(tmp), callbacks=callbacks,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Stack())
    return any(isinstance(c, OverlapMonitor) for c in trainer.callbacks)


def fit_in(ranks: RankPool, tmp_path: Any, steps: int, callbacks: list[Any], **strategy_kwargs: Any) -> bool:
    return ranks.run(_fit_on_this_rank, args=(str(tmp_path), strategy_kwargs, steps, callbacks), timeout=300)[0]


def fit(tmp_path: Any, compile_cfg: Any, steps: int = 12, checkpoint: Any = None, ranks: Optional[RankPool] = None,
        **monitor: Any) -> list[dict[str, float]]:
    """Fit on 2 ranks (spawn, or with ``ranks`` on theirs); return the rows of metrics.csv. ``checkpoint``: a
    ``ModelCheckpoint`` to add (spawn hands its best path back)."""
    if ranks is not None:
        fit_in(ranks, tmp_path, steps, [OverlapMonitor(**monitor)], compile=compile_cfg, sync=MONITOR_BUCKETS)
        return metrics_rows(tmp_path)
    L.seed_everything(0)
    strategy = StaticDistStrategy(start_method="spawn", compile=compile_cfg, sync=MONITOR_BUCKETS)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, log_every_n_steps=1,
        logger=CSVLogger(str(tmp_path)), callbacks=[OverlapMonitor(**monitor), *([checkpoint] if checkpoint else [])],
        enable_checkpointing=checkpoint is not None, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Stack())
    return metrics_rows(tmp_path)


def metrics_rows(tmp_path: Any) -> list[dict[str, str]]:
    """The rows of the one run's CSVLogger ``metrics.csv`` under ``tmp_path``."""
    (path,) = glob.glob(os.path.join(str(tmp_path), "lightning_logs", "version_*", "metrics.csv"))
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def series(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def test_plain_static_dist_logs_no_metric_of_its_own(ranks: RankPool, tmp_path: Any) -> None:
    # plain strategy="static_dist" logs no static_dist/* figure: the monitor is a callback the user adds (the README's
    # first snippet does); it stays opt-in because it costs 1-7 % of a CUDA-graphed step (benchmarks/README.md)
    monitored = fit_in(ranks, tmp_path, 4, [])
    logged = sorted({k for row in metrics_rows(tmp_path) for k, v in row.items() if k.startswith("static_dist/") and v})
    assert logged == [] and not monitored


def test_every_metric_is_logged_with_finite_values_and_a_timeline_is_drawn_and_a_checkpoint_callback_can_monitor_one(
        tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    # every static_dist/* figure a logger gets is also in trainer.callback_metrics, where Lightning's callbacks look
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="static_dist/hidden_comm_fraction",
                                 mode="max", every_n_train_steps=2)
    rows = fit(tmp_path, None, steps=6, checkpoint=checkpoint, timeline_every_n_steps=5)
    saved = sorted(os.listdir(str(tmp_path / "ckpt")))
    # (last.ckpt: the end of fit saves its last step when the top-k kept none of it, issue 37)
    assert saved and all("step=" in name for name in saved if name != "last.ckpt"), saved
    assert os.path.basename(checkpoint.best_model_path) in saved  # (spawn hands the best path back, not its score)
    for name in METRICS:
        for key in (f"static_dist/{name}", f"static_dist/{name}_max"):
            if key == "static_dist/trigger_delay_worst_bucket_ms_max" or "embed_gather" in key:
                continue  # embed_gather_*: logged only with sharded embeddings
            values = series(rows, key)
            assert len(values) == 6, key
            assert all(math.isfinite(v) for v in values), (key, values)
    assert all(v > 0 for v in series(rows, "static_dist/comm_ms"))
    assert all(0 <= v <= 1 for v in series(rows, "static_dist/hidden_comm_fraction"))
    # 8 blocks x (384x384 + 384) floats + 16 usage flags in 5 buckets (0.6 MiB, then 1.2 MiB: blocks 1 + 2 + 2 +
    # 2 + 1): the buckets the synchroniser put on the wire each step (the 16-byte step check is not a bucket)
    assert series(rows, "static_dist/bytes_sent")[-1] == 8 * (384 * 384 + 384) * 4 + 16 * 4
    pictures = glob.glob(os.path.join(str(tmp_path), "lightning_logs", "version_*", "timeline", "step_*.png"))
    assert [os.path.basename(p) for p in sorted(pictures)] == ["step_0.png", "step_5.png"]
    assert all(os.path.getsize(p) > 10_000 for p in pictures)
    # lsd-report on the finished run: medians of the overlap metrics
    text = report(str(tmp_path), plot=True)
    assert "static_dist/overlap_ratio" in text and "static_dist/exposed_comm_ms" in text


def test_every_n_steps_is_respected_and_the_last_recorded_step_is_logged_under_its_own_step(ranks: RankPool,
                                                                                          tmp_path: Any) -> None:
    # 7 optimizer steps (0..6), one in three recorded: steps 0, 3 and 6, the fit's last step included (a step is read
    # once every rank has completed it: on CPU when it ends, on CUDA a step or more later, the last at the epoch's end)
    rows = fit(tmp_path, None, steps=7, ranks=ranks, every_n_steps=3, prog_bar=True)
    for name in METRICS:
        for key in (f"static_dist/{name}", f"static_dist/{name}_max"):
            if key == "static_dist/trigger_delay_worst_bucket_ms_max" or "embed_gather" in key:
                continue
            assert [int(r["step"]) for r in rows if r.get(key)] == [0, 3, 6], key
    # Lightning's own rows (Stack's `self.log`, every step) share the steps: the figures sit where the loss of the
    # step they measured does
    assert {0, 3, 6} <= {int(r["step"]) for r in rows if r.get("train_loss")}
    assert series(rows, "static_dist/bytes_sent") == [8 * (384 * 384 + 384) * 4 + 16 * 4] * 3


@dataclass
class _InFlight:
    """A reduction in flight, as the synchroniser hands it to the recorder: its collective's work."""

    work: Any


class _HoldBack(L.Callback):
    """Rank 1 adds to steps 3 and 9 a collective of its own (32 bytes) that rank 0 joins only at the end of the epoch:
    until then rank 1 cannot have completed those steps, as a GPU that has not run them yet."""

    def __init__(self, monitor: OverlapMonitor) -> None:
        self.monitor = monitor
        self.owed = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.group = dist.new_group([0, 1])

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:  # (before the monitor's: listed first)
        if trainer.global_step - 1 not in (3, 9):
            return
        if trainer.global_rank == 1:
            work = dist.all_reduce(torch.ones(8), group=self.group, async_op=True)
            self.monitor._recorder.bucket_issued(99, 32, _InFlight(work))  # (the step is still open: recorded)
        else:
            self.owed += 1

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for _ in range(self.owed):
            dist.all_reduce(torch.ones(8), group=self.group)
        self.owed = 0


def test_a_step_a_rank_has_not_completed_is_logged_later_under_its_own_step_and_none_is_lost(ranks: RankPool,
                                                                                           tmp_path: Any) -> None:
    # 11 steps, 8 batches an epoch, one step in three recorded (0, 3, 6, 9); steps 3 and 9 are complete on rank 1
    # only at the end of their epoch: 3 is read with 6 at the first epoch's end, 9 at the fit's end (the last one)
    monitor = OverlapMonitor(every_n_steps=3)
    fit_in(ranks, tmp_path, 11, [_HoldBack(monitor), monitor], sync=MONITOR_BUCKETS)
    rows = metrics_rows(tmp_path)
    assert [int(r["step"]) for r in rows if r.get("static_dist/comm_ms")] == [0, 3, 6, 9]
    sent = 8 * (384 * 384 + 384) * 4 + 16 * 4  # every bucket, each step
    # each rank's own bytes, combined under the step they were sent at: rank 1's 32 extra at steps 3 and 9
    assert series(rows, "static_dist/bytes_sent") == [sent, sent + 16, sent, sent + 16]
    assert series(rows, "static_dist/bytes_sent_max") == [sent, sent + 32, sent, sent + 32]


@pytest.mark.slow  # three 20-step fits (every metric is checked in the default run by the test above)
def test_the_monitor_tells_an_uncut_whole_step_from_the_default_cut_one(tmp_path: Any) -> None:
    start, hidden = {}, {}
    for name, compile_cfg in [
        ("eager", None),
        ("cut", {"enabled": True, "backend": "aot_eager"}),  # the default: the whole step, cut at the buckets
        ("whole", {"enabled": True, "backend": "aot_eager", "regional": False}),
    ]:
        rows = fit(tmp_path / name, compile_cfg, steps=20)  # median of 18 steps: robust to a busy machine
        start[name] = median_of(series(rows, "static_dist/comm_start_frac")[2:])
        hidden[name] = median_of(series(rows, "static_dist/hidden_comm_fraction")[2:])
    # an uncut whole step: every gradient becomes ready at the end of backward, so the first collective goes out
    # after most of backward (0.84 measured: the hooks' bucket packing is the rest); eager and the cut step send
    # the first bucket after the last 1-2 of 8 blocks (0.14-0.34, the top with a CPU hog beside the test).
    # This is structural (a ratio of one rank's own times); the hidden fraction's levels move with the load
    # of 2 ranks + 2 Gloo threads on 2 cores (whole 0.20-0.62, eager 0.69-0.77 on CI), so only its order is
    # asserted. The start fraction too is compared, not thresholded, for whole: 0.84-0.94 usually, 0.69 once in a
    # full-suite run (eager 0.22, blocks 0.12 in that run).
    assert start["whole"] > max(start["eager"], start["cut"]) + 0.3, (start, hidden)
    assert start["eager"] < 0.5 and start["cut"] < 0.5, (start, hidden)
    assert hidden["whole"] < min(hidden["eager"], hidden["cut"]), (start, hidden)


def _aggregate(rank: int, world: int) -> list[float]:
    from lightning_static_dist.callbacks.monitor import RankAggregate

    aggregate = RankAggregate(3)
    values = torch.tensor([1.0 + rank, math.nan if rank == 0 else 5.0, 2.0 * rank], dtype=torch.float64)
    return aggregate(values).tolist()


def test_rank_aggregate_means_and_maxima_ignore_nan() -> None:
    from _dist import run_ranks

    for result in run_ranks(_aggregate, 2):
        # means over ranks [1.5, 5 (rank 0 had nothing), 1], then maxima [2, 5, 2]
        assert result == [1.5, 5.0, 1.0, 2.0, 5.0, 2.0]


def test_profiler_mode_writes_one_hta_loadable_trace_per_rank_and_logs_trace_metrics(ranks: RankPool,
                                                                                      tmp_path: Any) -> None:
    rows = fit(tmp_path, None, steps=6, ranks=ranks, profiler={"enabled": True, "wait": 1, "warmup": 1, "active": 2})
    (log_dir,) = glob.glob(os.path.join(str(tmp_path), "lightning_logs", "version_*"))
    for rank in range(2):
        trace = load_trace(os.path.join(log_dir, "profiler", f"rank{rank}.pt.trace.json"))
        # what Holistic Trace Analysis reads to tell the ranks apart
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        steps, compute, comm, kind = classify(trace)
        assert kind == "cpu" and len(steps) == 2 and compute and comm
    for name in TRACE_METRICS:
        values = series(rows, f"static_dist/trace_{name}")
        assert len(values) == 1 and math.isfinite(values[0]), (name, values)
    assert series(rows, "static_dist/trace_comm_ms")[0] > 0
    # the trace and the recorder measure the same steps (2 and 3) independently: they must tell the same story
    # (measured here: compute 25.7 vs 25.8 ms per step). They are compared on compute time: on 2 shared CPU cores
    # the hidden fraction of a sub-millisecond Gloo collective follows the scheduler (trace 0.70 vs recorder 0.72
    # on a quiet machine, 0.53 vs 0.84 on a loaded one), so of that fraction only its range is checked
    def recorded(name: str) -> list[float]:
        return [float(r[f"static_dist/{name}"]) for r in rows if r.get(f"static_dist/{name}") and int(r["step"]) in (2, 3)]

    compute = recorded("compute_ms")
    assert len(compute) == 2
    traced_compute = series(rows, "static_dist/trace_compute_ms")[0]
    assert abs(traced_compute - sum(compute) / 2) < 0.25 * sum(compute) / 2, (traced_compute, compute)
    fractions = recorded("hidden_comm_fraction") + series(rows, "static_dist/trace_hidden_comm_fraction")
    assert len(fractions) == 3 and all(0.0 <= f <= 1.0 for f in fractions), fractions


class _RecompileOnRankOne(L.Callback):
    """Adds 100 made-up recompiles to rank 1's compile report at step 2 (before GraphReport reads it)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            trainer.strategy.offer.compile_report.recompiles.extend(["made up by the test, on rank 1 only"] * 100)


def test_graph_report_logs_each_rank_s_worst_compile_figures_without_lightning_s_log(ranks: RankPool,
                                                                                     tmp_path: Any) -> None:
    fit_in(ranks, tmp_path, 4, [_RecompileOnRankOne()], compile={"enabled": True, "backend": "aot_eager"})
    rows = metrics_rows(tmp_path)
    # the strategy added the GraphReport; its figures are the maximum over ranks (taken over the host group): rank 0
    # logs rank 1's made-up recompiles from step 2 on (Stack's `self.log` stays in the graph: nothing else recompiles)
    recompiles = series(rows, "static_dist/recompiles")
    assert recompiles == [0, 100, 100, 100], recompiles
    assert len(set(series(rows, "static_dist/graph_breaks"))) == 1
    assert all(v > 0 for v in series(rows, "static_dist/compile_s"))
    # in Lightning's rows: a training step's `self.log` figures are logged at the optimizer steps taken before it
    assert [int(r["step"]) for r in rows if r.get("static_dist/recompiles")] == [0, 1, 2, 3]


def test_graph_report_logs_once_per_optimizer_step_where_lightning_logs(tmp_path: Any) -> None:
    # one rank, in this process: 4 optimizer steps of 2 accumulated micro-batches, a row every 2 optimizer steps
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=StaticDistStrategy(compile={"enabled": True, "backend": "aot_eager"}),
        max_steps=4, accumulate_grad_batches=2, log_every_n_steps=2, logger=CSVLogger(str(tmp_path)),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    try:
        trainer.fit(Stack())
    finally:  # the one-rank group of this process: its store holds MASTER_PORT until destroyed
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    rows = metrics_rows(tmp_path)
    ours = [int(r["step"]) for r in rows if r.get("static_dist/compile_s")]
    theirs = sorted({int(r["step"]) for r in rows if r.get("train_loss")})  # Stack's own self.log, every step
    assert ours == [1, 3] and set(ours) <= set(theirs), (ours, theirs)
    assert "static_dist/recompiles" in trainer.logged_metrics and "static_dist/recompiles" in trainer.callback_metrics
