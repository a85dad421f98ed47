"""``OverlapMonitor``: log how much gradient communication was hidden behind compute, in every Trainer logger.

Every ``every_n_steps`` optimizer steps each rank records its step (``recorder.py``). Once the step's events have
completed on every rank (on CUDA a step or more later: the host never waits for them), each rank computes
:func:`~lightning_static_dist.overlap.intervals.step_metrics` and the ranks combine them on the host
(``readout.py``): the mean as ``static_dist/<name>``, the maximum as ``static_dist/<name>_max``, logged under the
step they belong to. Steps not recorded cost nothing. Profiler mode computes the same metrics from one Chrome trace
per rank (``trace.py``, with the rank metadata Holistic Trace Analysis needs) and logs them as
``static_dist/trace_<name>``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torchmetrics import Metric
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_static_dist.config.check import check_fields, fail, section_from_dict
from lightning_static_dist.offer import offer_of
from lightning_static_dist.overlap.readout import StepReadout, gather_on_host, row_of
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.overlap.timeline import StepTimeline
from lightning_static_dist.overlap.trace import TRACE_METRICS, load_trace, trace_metrics


@dataclass
class ProfilerConfig:
    """``callbacks.overlap_monitor.profiler``: ``torch.profiler`` over a few steps, one Chrome trace per rank.

    Example::

        OverlapMonitor(profiler={"enabled": True, "wait": 1, "warmup": 1, "active": 3})
    """

    KEY = "callbacks.overlap_monitor.profiler"

    enabled: bool = False
    """Profile, and log the trace-derived metrics (``static_dist/trace_<name>``)."""
    wait: int = 1
    """Optimizer steps skipped before the profiler starts."""
    warmup: int = 1
    """Steps profiled but not recorded (the profiler's own start-up)."""
    active: int = 3
    """Steps recorded into the trace."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name, least in (("wait", 0), ("warmup", 0), ("active", 1)):
            if getattr(self, name) < least:
                fail(f"{self.KEY}.{name}", getattr(self, name), f"must be an integer >= {least}")


#: The metrics this monitor logs, in the order of the aggregation vector.
METRICS = (
    "overlap_ratio",
    "hidden_comm_fraction",
    "comm_ms",
    "compute_ms",
    "exposed_comm_ms",
    "trigger_delay_ms",
    "trigger_delay_worst_bucket_ms",
    "bytes_sent",
    "comm_start_frac",
    "compression_ratio",
    "embed_gather_ms",
    "embed_gather_exposed_ms",
)


class RankAggregate(Metric):
    """Mean and max over ranks of a vector of per-rank figures, ignoring NaN (a rank with nothing to measure), on the
    device (Fabric's figures; the Trainer's monitor combines them on the host, ``readout.py``, with the same
    arithmetic), kept in one state tensor (rows: sum, count, max; why: docs/internals.md, "callbacks/monitor.py").

    Example::

        aggregate = RankAggregate(size=3)
        mean_and_max = aggregate(torch.tensor([0.5, float("nan"), 2.0]))   # synced over ranks on every call
    """

    full_state_update = False

    def __init__(self, size: int) -> None:
        super().__init__(dist_sync_on_step=True)
        default = torch.zeros(3, size, dtype=torch.float64)
        default[2] = -math.inf
        # no reduce function: the gathered per-rank states arrive stacked and compute() reduces each row its way
        self.add_state("stats", default=default, dist_reduce_fx=None)

    def update(self, values: torch.Tensor) -> None:
        values = values.to(self.stats)
        finite = ~torch.isnan(values)
        self.stats[0] += torch.where(finite, values, 0.0)
        self.stats[1] += finite.to(self.stats)
        self.stats[2] = torch.maximum(self.stats[2], torch.where(finite, values, -math.inf))

    def compute(self) -> torch.Tensor:
        stats = self.stats if self.stats.dim() == 3 else self.stats.unsqueeze(0)  # (ranks, 3, size)
        total, count, maximum = stats[:, 0].sum(0), stats[:, 1].sum(0), stats[:, 2].amax(0)
        mean = torch.where(count > 0, total / count.clamp(min=1), math.nan)
        maximum = torch.where(torch.isinf(maximum), math.nan, maximum)
        return torch.cat([mean, maximum])


class OverlapMonitor(Callback):
    """Logs ``static_dist/overlap_ratio``, ``hidden_comm_fraction``, ``comm_ms``, ``compute_ms``,
    ``exposed_comm_ms``, ``trigger_delay_ms`` and ``bytes_sent`` (plus ``_max`` over ranks) every
    ``every_n_steps`` steps, and draws a timeline every ``timeline_every_n_steps`` steps (0: never).

    The figures of a recorded step are logged under that step once its events have completed on every rank: on CPU
    at the step's end, on CUDA typically one or two steps later (the host never waits for the GPU), and at the
    latest at the end of the epoch, which waits for what is left.

    Args:
        every_n_steps: record and log every this many optimizer steps (unrecorded steps cost nothing).
        prog_bar: show the overlap ratio in the progress bar.
        timeline_every_n_steps: write ``<log_dir>/timeline/step_<N>.png`` every this many steps; 0 disables.
        profiler: ``{"enabled", "wait", "warmup", "active"}``: profile ``active`` steps after skipping ``wait`` and
            warming up ``warmup``; one Chrome trace per rank under ``<log_dir>/profiler/``.

    Example::

        trainer = L.Trainer(strategy="static_dist", callbacks=[OverlapMonitor(every_n_steps=10, prog_bar=True)])
    """

    @dataclass
    class Config:
        """``callbacks.overlap_monitor``: the options of :class:`OverlapMonitor` (its keyword arguments), validated."""

        KEY = "callbacks.overlap_monitor"

        every_n_steps: int = 1
        """Record and log every this many optimizer steps (unrecorded steps cost nothing)."""
        prog_bar: bool = False
        """Show the overlap ratio in the progress bar."""
        timeline_every_n_steps: int = 0
        """Write ``<log_dir>/timeline/step_<N>.png`` every this many steps; 0: never."""
        profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
        """Profiler mode: a mapping of :class:`ProfilerConfig`'s fields (``null``: its defaults)."""

        def __post_init__(self) -> None:
            self.profiler = section_from_dict(ProfilerConfig, self.profiler, show_value=True)
            check_fields(self)
            if self.every_n_steps < 1:
                fail(f"{self.KEY}.every_n_steps", self.every_n_steps, "must be an integer >= 1")
            if self.timeline_every_n_steps < 0:
                fail(f"{self.KEY}.timeline_every_n_steps", self.timeline_every_n_steps,
                     "must be an integer >= 0 (0: never)")

    def __init__(self, every_n_steps: int = 1, prog_bar: bool = False, timeline_every_n_steps: int = 0,
                 profiler: Optional[Mapping[str, Any]] = None) -> None:
        self.config = self.Config(every_n_steps=every_n_steps, prog_bar=prog_bar,
                                  timeline_every_n_steps=timeline_every_n_steps, profiler=profiler)
        self.every_n_steps = self.config.every_n_steps
        self.prog_bar = self.config.prog_bar
        self.timeline_every_n_steps = self.config.timeline_every_n_steps
        self.profiler = self.config.profiler
        self.trace_paths: list[str] = []
        """This rank's Chrome trace (profiler mode), once written."""
        self.trace_history: list[dict[str, float]] = []
        """The trace-derived metrics (aggregated over ranks), one row per profiled window."""
        self._profile: Optional[torch.profiler.profile] = None
        self._trace_dir: Optional[str] = None
        self.history: list[dict[str, float]] = []
        """The aggregated metrics of every logged step (every rank holds the same values)."""
        self.timeline_paths: list[str] = []
        self._recorder: Optional[StepRecorder] = None
        self._readout: Optional[StepReadout] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.history, self.timeline_paths = [], []
        offer = offer_of(trainer)
        if offer is None:
            rank_zero_warn(f"OverlapMonitor measures the static_dist strategy only; with"
                           f" {type(trainer.strategy).__name__} it does nothing.")
            return
        self._recorder = StepRecorder(offer.root_device)
        offer.attach_recorder(self._recorder)
        # the per-step maximum of the trigger delay has its own name
        self._readout = StepReadout(METRICS, offer.host_max, trainer.global_rank, trainer.world_size,
                                    no_max=("trigger_delay_worst_bucket_ms",))
        self.trace_paths, self.trace_history = [], []

    # -------------------------------------------------------------------------------------------- profiler

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.profiler.enabled or self._recorder is None:
            return
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective: every rank asks
        self._trace_dir = os.path.join(log_dir, "profiler")
        os.makedirs(self._trace_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        options = self.profiler
        self._profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=options.wait, warmup=options.warmup, active=options.active,
                                             repeat=1),
            on_trace_ready=lambda prof: self._export(prof, trainer.global_rank),
        )
        self._profile.start()

    def _export(self, prof: torch.profiler.profile, rank: int) -> None:
        assert self._trace_dir is not None
        path = os.path.join(self._trace_dir, f"rank{rank}.pt.trace.json")
        prof.export_chrome_trace(path)  # distributedInfo (rank, world size, backend) is added by torch.profiler
        self.trace_paths.append(path)

    def _profiler_step(self, trainer: pl.Trainer) -> None:
        if self._profile is None:
            return
        written = len(self.trace_paths)
        self._profile.step()
        if len(self.trace_paths) > written:  # the active window just ended on every rank: same step everywhere
            self._profile.stop()
            self._profile = None
            self._publish_trace(trainer)

    def _publish_trace(self, trainer: pl.Trainer) -> None:
        per_rank = trace_metrics(load_trace(self.trace_paths[-1]))
        offer = offer_of(trainer)
        assert offer is not None  # (profiling starts only with a recorder, which needs the offer)
        _, (table,) = gather_on_host(offer.host_max, trainer.global_rank, trainer.world_size,
                                     [[per_rank[name] for name in TRACE_METRICS]], slots=1, width=len(TRACE_METRICS))
        row = row_of(TRACE_METRICS, table, prefix="trace_")
        log_straight(trainer, row, trainer.global_step)
        self.trace_history.append({"step": float(trainer.global_step), **row})

    def _recording(self, trainer: pl.Trainer) -> bool:
        return self._recorder is not None and trainer.global_step % self.every_n_steps == 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._recorder is None:
            return
        self._recorder.active = self._recording(trainer)
        self._recorder.begin_step(trainer.global_step, trainer.global_rank)  # (not recorded: returns at once)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder, readout = self._recorder, self._readout
        if recorder is None or readout is None:
            return
        if not (recorder.active or readout.pending or self._profile is not None):
            return  # a step not recorded, nothing waiting to be read: nothing to do
        stepped = _stepped(trainer, batch_idx)
        if self._profile is not None and stepped:
            self._profiler_step(trainer)
        if recorder.active:
            # an accumulation micro-batch synchronised nothing: not kept
            closed = recorder.close_step(keep=stepped)
            recorder.active = False
            if closed is not None:
                readout.add(closed)
        if stepped and readout.pending:  # (every rank is here at the same steps: the readout is a collective)
            self._publish(trainer, pl_module, readout.read())

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read_what_is_left(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._readout is not None:  # no collective after a failure
            self._readout.clear()
        if self._profile is not None:  # a profiler left running would refuse to start in the next fit
            self._profile.stop()
            self._profile = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profile is not None:  # training ended inside the profiled window: what was recorded is written
            rank_zero_warn("OverlapMonitor: training ended before the profiler's active steps were done;"
                           " the trace holds the steps profiled so far")
            self._profile.stop()
            self._profile = None
        self._read_what_is_left(trainer)  # (the epoch's end read them already, unless the fit stopped inside it)

    def _read_what_is_left(self, trainer: pl.Trainer) -> None:
        """The recorded steps not read yet, waited for (once): the last recorded step of an epoch is not lost."""
        if self._readout is not None and self._readout.pending:
            self._publish(trainer, None, self._readout.read(wait=True))

    def _publish(self, trainer: pl.Trainer, pl_module: Optional[pl.LightningModule],
                 read: list[tuple[StepTimeline, dict[str, float]]]) -> None:
        for timeline, row in read:
            log_straight(trainer, row, timeline.step)  # under the step it belongs to, whenever it is read
            self.history.append({"step": float(timeline.step), **row})
            if self.timeline_every_n_steps and timeline.step % self.timeline_every_n_steps == 0:
                self._draw(trainer, timeline, timeline.step)
        if self.prog_bar and pl_module is not None and read:  # (not at an epoch's end: `log` refuses on_step there)
            # a host tensor: `log` keeps a tensor where it is, where it would copy a float to the device
            pl_module.log("static_dist/overlap_ratio", torch.tensor(self.history[-1]["static_dist/overlap_ratio"]),
                          prog_bar=True, logger=False)

    def _draw(self, trainer: pl.Trainer, timeline: StepTimeline, step: int) -> None:
        from lightning_static_dist.overlap.picture import render_timeline

        timelines: list[Optional[StepTimeline]] = [None] * trainer.world_size
        if trainer.world_size > 1:
            torch.distributed.all_gather_object(timelines, timeline)
        else:
            timelines = [timeline]
        log_dir = trainer.log_dir  # a collective: every rank asks
        if not trainer.is_global_zero or log_dir is None:
            return
        path = render_timeline(
            [t for t in timelines if t is not None],
            os.path.join(log_dir, "timeline", f"step_{step}.png"),
            title=f"step {step}: compute and gradient collectives per rank",
        )
        self.timeline_paths.append(path)
        _add_to_tensorboard(trainer, path, step)


def aggregate_over_ranks(aggregate: RankAggregate, names: tuple[str, ...], per_rank: Mapping[str, float], prefix: str,
                         world_size: int, no_max: tuple[str, ...] = ()) -> dict[str, float]:
    """This rank's figures aggregated over ranks: ``static_dist/<prefix><name>`` the mean, ``..._max`` the maximum
    (not for ``no_max``, nor on one rank). Collective at world size > 1: every rank calls it. NaN where no rank
    measured anything.

    Example::

        row = aggregate_over_ranks(RankAggregate(len(METRICS)), METRICS, step_metrics(timeline), "", world_size=2)
    """
    values = [per_rank[k] for k in names]
    if world_size > 1:
        values = aggregate(torch.tensor(values, dtype=torch.float64)).tolist()
        aggregate.reset()
    else:  # one rank: the mean and the max are the value itself, and nothing needs synchronising
        values = values + values
    row = {f"static_dist/{prefix}{k}": values[i] for i, k in enumerate(names)}
    if world_size > 1:
        row.update({f"static_dist/{prefix}{k}_max": values[len(names) + i] for i, k in enumerate(names) if k not in no_max})
    return row


def log_straight(trainer: pl.Trainer, row: Mapping[str, float], step: int) -> None:
    """Log figures already aggregated over ranks to every logger and to ``trainer.callback_metrics``, without
    ``LightningModule.log`` (NaN left out).

    Example::

        log_straight(trainer, {"static_dist/recompiles": 0.0}, trainer.global_step)
    """
    # straight to the loggers (rank zero only, values already aggregated), not through LightningModule.log (why:
    # docs/internals.md, "callbacks/monitor.py"); NaN: nothing to measure
    finite = {k: v for k, v in row.items() if v == v}
    for logger in trainer.loggers:
        logger.log_metrics(finite, step=step)
    # and where callbacks look (ModelCheckpoint(monitor=...), EarlyStopping, a user's own): Lightning's
    # `trainer.callback_metrics`, the dict its logger connector keeps and returns (what `self.log` fills)
    tensors = {k: torch.tensor(v) for k, v in finite.items()}
    trainer.callback_metrics.update(tensors)
    trainer.logged_metrics.update(tensors)  # where `self.log` lists what it sent to the loggers


def _stepped(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether this batch ended with an optimizer step (not an accumulation micro-batch)."""
    accumulate = trainer.accumulate_grad_batches
    return accumulate == 1 or (batch_idx + 1) % accumulate == 0 or (batch_idx + 1) == trainer.num_training_batches


def _add_to_tensorboard(trainer: pl.Trainer, path: str, step: int) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            import matplotlib.image

            image = matplotlib.image.imread(path)[..., :3]
            logger.experiment.add_image("static_dist/timeline", image, global_step=step, dataformats="HWC")
