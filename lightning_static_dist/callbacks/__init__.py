"""Callbacks a run file can switch on under ``callbacks:``; each validates its options with a ``Config`` dataclass
beside it (the run file's ``callbacks.<name>`` block), like the strategy's sections. The overlap monitor is
``monitor.py`` beside this module.

:class:`RunSummary` ends a run with the figures a user looks for first — loss, tokens/s (samples/s where batches are
not token ids) and the bytes the gradient synchroniser put on the wire — printed as a table on rank 0 and written to
``<log_dir>/summary.json``, which ``lsd-report`` reads back.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_module

from lightning_static_dist.compat import lightning_log_step
from lightning_static_dist.config.check import check_fields, fail
from lightning_static_dist.offer import CompileFacts, offer_of
from lightning_static_dist.callbacks.monitor import log_straight

SUMMARY_FILE = "summary.json"


def say(trainer: pl.Trainer, text: str) -> None:
    """Log a diagnostic (the compile report) on rank 0 at INFO, on stderr like Lightning's own messages; above the bar
    while a TQDM bar is open.

    Example::

        say(trainer, f"static_dist compile report (after the first step):\n{report.summary()}")
    """
    _write(trainer, text, result=False)


def show(trainer: pl.Trainer, text: str) -> None:
    """Print a result (a progress line, the summary table) on rank 0 to stdout, so that ``lsd-train ... > log.txt``
    keeps it; above the bar while a TQDM bar is open; nothing while Lightning's INFO messages are silenced.

    Example::

        show(trainer, f"step {trainer.global_step}  loss {loss:.4f}")
    """
    _write(trainer, text, result=True)


def _write(trainer: pl.Trainer, text: str, result: bool) -> None:
    if not trainer.is_global_zero or not rank_zero_module.log.isEnabledFor(logging.INFO):
        return  # (the level rank_zero_info respects: a user who silenced Lightning's messages silenced these too)
    bar = _open_tqdm_bar(trainer)
    if bar is not None:  # a line in mid-bar would be cut into the bar's own line: tqdm clears the bar first
        bar.write(text, file=sys.stdout if result else sys.stderr)
    elif result:
        print(text, flush=True)
    else:
        rank_zero_info(text)


def _open_tqdm_bar(trainer: pl.Trainer) -> Any:
    """The TQDM bar now on screen, or ``None`` (no TQDM callback, or its bars closed, e.g. in ``on_train_end``)."""
    callback = trainer.progress_bar_callback
    if not isinstance(callback, TQDMProgressBar) or not callback.is_enabled:
        return None
    # the attributes TQDMProgressBar.print itself looks through; a closed tqdm bar has `disable` set
    for name in ("_train_progress_bar", "_val_progress_bar", "_test_progress_bar", "_predict_progress_bar"):
        bar = getattr(callback, name, None)
        if bar is not None and not bar.disable:
            return bar
    return None


def batch_size_of(batch: Any) -> tuple[int, str]:
    """What a batch holds, counted in its own unit: ``(n, "tokens")`` when the input tensor (``x`` of ``(x, y)``, a
    tensor, or the first tensor value) is a 2-D tensor of ``int64``/``int32`` ids — a language model's
    ``(batch, sequence)`` token ids, counted one by one — else ``(n, "samples")``, its first dimension (images, also
    ``uint8`` ones, feature rows). ``(0, "samples")`` without a tensor."""
    if isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    elif isinstance(batch, dict):
        batch = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    if not isinstance(batch, torch.Tensor):
        return 0, "samples"
    if batch.dim() == 2 and batch.dtype in (torch.int64, torch.int32):
        return batch.numel(), "tokens"
    return (batch.shape[0] if batch.dim() else 1), "samples"


class RunSummary(Callback):
    """Print and save a summary of a fit: steps, losses, step time, tokens/s (or samples/s), bytes synchronised.

    Step times are wall-clock from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
    synchronisation, optimizer); the first ``warmup_steps`` are left out of the medians.

    Args:
        warmup_steps: steps excluded from timing (allocation, first-step planning).
        loss_key: the logged metric shown as the training loss.
        print_every_n_steps: also print a progress line every this many optimizer steps (and one per validation) on
            rank 0: step, loss, median time per optimizer step (all its accumulated micro-batches), tokens/s or
            samples/s (:func:`batch_size_of`); 0: never (the loss is read on the host only then).

    Raises:
        ConfigError: a bad option, in one line naming its run-file key (``callbacks.run_summary.warmup_steps=-1: ...``).

    Example::

        trainer = L.Trainer(strategy="static_dist", callbacks=[RunSummary()])
        trainer.fit(model)   # prints the table on rank 0, writes <log_dir>/summary.json
    """

    @dataclass
    class Config:
        """``callbacks.run_summary``: the options of :class:`RunSummary` (its keyword arguments), validated."""

        KEY = "callbacks.run_summary"

        warmup_steps: int = 5
        """Steps excluded from timing (allocation, first-step planning)."""
        loss_key: str = "train_loss"
        """The logged metric shown as the training loss."""
        print_every_n_steps: int = 0
        """Also print a progress line every this many optimizer steps (and one per validation) on rank 0; 0: never."""

        def __post_init__(self) -> None:
            check_fields(self)
            if self.warmup_steps < 0:
                fail(f"{self.KEY}.warmup_steps", self.warmup_steps, "must be an integer >= 0")
            if self.print_every_n_steps < 0:
                fail(f"{self.KEY}.print_every_n_steps", self.print_every_n_steps, "must be an integer >= 0 (0: never)")

    def __init__(self, warmup_steps: int = 5, loss_key: str = "train_loss", print_every_n_steps: int = 0) -> None:
        self.config = self.Config(warmup_steps=warmup_steps, loss_key=loss_key, print_every_n_steps=print_every_n_steps)
        self.print_every_n_steps = self.config.print_every_n_steps
        self.warmup_steps = self.config.warmup_steps
        self.loss_key = self.config.loss_key
        self.step_seconds: list[float] = []
        self.items_per_step: int = 0
        self.unit = "samples"
        """What a batch is counted in (:func:`batch_size_of`): ``tokens`` for integer ids, else ``samples``."""
        self.losses: list[torch.Tensor] = []
        self.summary: dict[str, Any] = {}
        self._started: Optional[float] = None
        self._step_at_start = 0
        self._window = (0.0, 0)  # (seconds, tokens or samples) of the micro-batches since the last optimizer step
        self._optimizer_steps: list[tuple[float, int]] = []  # (seconds, tokens or samples) of each recent optimizer step
        self._printed_step = -1
        self._log_dir: Optional[str] = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step_seconds, self.losses, self.summary = [], [], {}
        self._window, self._optimizer_steps, self._printed_step = (0.0, 0), [], -1

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()
        self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None:
            return
        seconds = time.perf_counter() - self._started
        self.step_seconds.append(seconds)
        self.items_per_step, self.unit = batch_size_of(batch)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())  # a tensor: float() here would wait for the GPU every step
            del self.losses[:-10]
        self._window = (self._window[0] + seconds, self._window[1] + self.items_per_step)
        if trainer.global_step == self._step_at_start:
            return  # accumulating: the optimizer has not stepped in this micro-batch
        self._optimizer_steps.append(self._window)
        self._window = (0.0, 0)
        every = self.print_every_n_steps
        del self._optimizer_steps[:-max(every, 1)]
        step = trainer.global_step
        if every and step % every == 0 and step != self._printed_step and self.losses:
            self._printed_step = step  # a step is printed once, whatever happens between two optimizer steps
            median_s = statistics.median(s for s, _ in self._optimizer_steps)
            per_s = statistics.median(n / s for s, n in self._optimizer_steps) * trainer.world_size
            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            show(trainer, f"step {step}{f'/{total}' if total else ''}  loss {float(self.losses[-1]):.4f}"
                         f"  {1e3 * median_s:.1f} ms/step  {per_s:,.0f} {self.unit}/s")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.print_every_n_steps or trainer.sanity_checking:
            return
        shown = {k: float(v) for k, v in trainer.callback_metrics.items()
                 if k.startswith("val") and isinstance(v, torch.Tensor) and v.numel() == 1}
        if shown:
            show(trainer, f"validation at step {trainer.global_step}: "
                         + "  ".join(f"{k} {v:.4f}" for k, v in sorted(shown.items())))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        timed = self.step_seconds[self.warmup_steps :] or self.step_seconds
        median_s = statistics.median(timed) if timed else float("nan")
        offer = offer_of(trainer)
        sync = offer.sync_figures() if offer is not None else None
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        tail = [float(loss) for loss in self.losses[-10:]]
        self.summary = {
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "steps": trainer.global_step,
            "batches": len(self.step_seconds),
            "train_loss_last10": sum(tail) / len(tail) if tail else None,
            "val_loss": metrics.get("val_loss"),
            "val_ppl": metrics.get("val_ppl"),
            "step_ms_median": median_s * 1e3,
            f"{self.unit}_per_s": self.items_per_step * trainer.world_size / median_s if timed else None,
            "sync_mode": sync.mode if sync else None,
            "sync_rounds": sync.rounds if sync else None,
            "sync_collectives": sync.collectives if sync else None,  # (graph mode: inside the compiled graph)
            "bytes_sent_per_rank": sync.bytes_sent if sync else None,
            "bytes_per_round": sync.bytes_per_round if sync else None,
            "bucket_plan": sync.bucket_plan if sync else None,
        }
        schedule = offer.schedule_choice() if offer is not None else None
        plan = getattr(trainer.strategy, "plan", None)  # (a strategy of one's own may offer figures and no plan)
        if sync is not None and plan is not None:  # the schedule this run used, as its plan resolved it
            self.summary["sync_schedule"] = plan.sync.schedule
            if plan.sync.schedule_line is not None:  # sync.schedule measured: what it became, and why
                self.summary["sync_schedule_line"] = plan.sync.schedule_line
            if plan.sync.schedule_choice is not None:  # the probe's evidence and each candidate's prediction
                self.summary["sync_schedule_measured"] = plan.sync.schedule_choice.as_dict()
        if schedule is not None:  # sync.schedule: auto: what it chose, and what choosing cost
            self.summary["sync_schedule"] = schedule.choice
            self.summary["sync_schedule_trial_steps"] = schedule.trial_steps or None
            self.summary["sync_schedule_trial_s"] = schedule.trial_s
        if sync is not None and sync.optimizer_overlap is not None:
            self.summary["optimizer_overlap"] = sync.optimizer_overlap
        simulation = offer.simulation if offer is not None else None
        if simulation is not None:  # one process stood for the world: say so where every figure is read
            link = simulation.link
            self.summary["simulated_world_size"] = simulation.world_size
            # what a byte count means here: this one process put nothing on a wire; it is what each rank would send
            counted_as = (f"bytes_sent_per_rank and bytes_per_round: what each of the {simulation.world_size} ranks"
                          " would send")
            self.summary["simulated_link"] = (f"{link.describe()} (emulated; {counted_as})" if link is not None else
                                              f"free (no data crossed a link; {counted_as})")
        log_dir = self._log_dir = trainer.log_dir  # a collective under distributed strategies: every rank must ask
        if trainer.is_global_zero and log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, SUMMARY_FILE), "w") as f:
                json.dump(self.summary, f, indent=2)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # printed here, not in on_train_end: a progress bar closes in its own on_train_end, which Lightning may call
        # after this callback's, and would draw its last line again below the table
        if not self.summary:
            return
        show(trainer, format_summary(self.summary) + (f"\nrun folder: {self._log_dir}" if self._log_dir else ""))


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as an aligned two-column table."""

    def fmt(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    width = max(len(k) for k in summary)
    rule = "-" * (width + 24)
    rows = [f"{key:<{width}}  {fmt(value)}" for key, value in summary.items()]
    return "\n".join([rule, "lightning-static-dist run summary", rule, *rows, rule])


class GraphReport(Callback):
    """Report what static compilation did: printed once on rank 0 after the first step, logged as metrics.

    Logs ``static_dist/graph_breaks``, ``static_dist/recompiles`` and ``static_dist/compile_s`` (cumulative, the
    maximum over ranks) every ``trainer.log_every_n_steps`` steps, and prints the report again at the end of
    training when a graph was compiled since (a recompile, the short last batch's graph). The strategy adds one when
    it compiles a model and none is present.

    Args:
        log_metrics: log the metrics.
        print_summary: print the report on rank 0.

    Example::

        trainer = L.Trainer(strategy=StaticDistStrategy(compile={"enabled": True}), callbacks=[GraphReport()])
    """

    METRICS = ("static_dist/graph_breaks", "static_dist/recompiles", "static_dist/compile_s")

    @dataclass
    class Config:
        """``callbacks.graph_report``: the options of :class:`GraphReport` (its keyword arguments), validated."""

        KEY = "callbacks.graph_report"

        log_metrics: bool = True
        """Log the metrics."""
        print_summary: bool = True
        """Print the report on rank 0."""

        def __post_init__(self) -> None:
            check_fields(self)

    def __init__(self, log_metrics: bool = True, print_summary: bool = True) -> None:
        self.config = self.Config(log_metrics=log_metrics, print_summary=print_summary)
        self.log_metrics = self.config.log_metrics
        self.print_summary = self.config.print_summary
        self._printed_recompiles: Optional[tuple[int, int]] = None  # (recompiles, graphs) when first printed
        self._logged_at = 0  # the global step last logged at (0: no optimizer step yet)
        self._at_end: Optional[str] = None  # the end-of-training report, said once the progress bar has closed

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._logged_at = trainer.global_step  # a resumed fit starts past its checkpoint's step

    @staticmethod
    def _report(trainer: pl.Trainer) -> Optional[CompileFacts]:
        offer = offer_of(trainer)
        return offer.compile_report if offer is not None else None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        offer = offer_of(trainer)
        report = offer.compile_report if offer is not None else None
        if offer is None or report is None:
            return
        if self.print_summary and self._printed_recompiles is None:
            self._printed_recompiles = (len(report.recompiles), len(report.graphs))
            say(trainer, f"static_dist compile report (after the first step):\n{report.summary()}")
        every, step = trainer.log_every_n_steps, trainer.global_step
        # as Lightning logs `self.log(on_step=True)`: once per optimizer step (not per accumulated micro-batch), every
        # log_every_n_steps steps, never with log_every_n_steps=0
        if self.log_metrics and every > 0 and step % every == 0 and step != self._logged_at:
            self._logged_at = step
            figures = [float(len(report.graph_breaks)), float(len(report.recompiles)), report.compile_s]
            # host figures, their maximum taken on the host, not by `log_dict(sync_dist=True)` (why: docs/internals.md,
            # "callbacks/__init__.py")
            figures = offer.host_max(figures)
            log_straight(trainer, dict(zip(self.METRICS, figures)), lightning_log_step(trainer))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = self._report(trainer)
        # again where a graph was compiled since: a recompile, the short last batch's graph, a dynamic one
        if report is not None and self.print_summary and (len(report.recompiles), len(report.graphs)) != self._printed_recompiles:
            self._at_end = f"static_dist compile report (end of training):\n{report.summary()}"

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # said here, after the progress bar's own on_train_end closed its bar (as RunSummary's table)
        if self._at_end is not None:
            say(trainer, self._at_end)
            self._at_end = None
