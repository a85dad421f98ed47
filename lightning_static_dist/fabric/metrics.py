"""The ``static_dist/*`` figures a Fabric run logs with ``fabric.log_dict(fabric.strategy.metrics())``.

Rank-local when read: the synchroniser's own counters (the same on every rank), this rank's compile counts, and the
overlap figures of the last recorded step, combined over the ranks in ``optimizer.step()`` (which every rank calls).

Example::

    figures = StepFigures()
    figures.after_step(timeline, world_size, device)  # every rank, after each optimizer step (device: the root one)
    figures.read([(synchronizer, compile_report)])  # rank-local; one pair per trainable model
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_static_dist.compile import CompileReport
from lightning_static_dist.overlap.intervals import step_metrics
from lightning_static_dist.callbacks.monitor import METRICS, RankAggregate, aggregate_over_ranks
from lightning_static_dist.overlap.timeline import StepTimeline


def sync_figures(sync: Any) -> dict[str, float]:
    """The synchroniser's own figures, rank-local (equal on every rank: one plan, one round count)."""
    stats = sync.stats
    return {"static_dist/sync_rounds": float(stats.rounds), "static_dist/sync_buckets": float(len(sync.plan.buckets)),
            "static_dist/sync_bytes_sent": float(stats.bytes_sent),
            "static_dist/sync_round_bytes": float(stats.last_round_bytes)}


class StepFigures:
    """The overlap figures of the last recorded step (aggregated over the ranks), handed out once."""

    def __init__(self) -> None:
        self._aggregate: Optional[RankAggregate] = None
        self._overlap: dict[str, float] = {}

    def after_step(self, timeline: Optional[StepTimeline], world_size: int, device: torch.device) -> None:
        """After an optimizer step (every rank is here): a recorded step's figures, combined over the ranks on
        ``device`` (the strategy's root device: NCCL gathers CUDA tensors only; read here, after launch)."""
        if timeline is None:  # the same steps are recorded on every rank: they all aggregate, or none does
            return
        if self._aggregate is None:
            self._aggregate = RankAggregate(len(METRICS)).to(device)
        self._overlap = aggregate_over_ranks(self._aggregate, METRICS, step_metrics(timeline), "", world_size,
                                             no_max=("trigger_delay_worst_bucket_ms",))

    def read(self, models: Sequence[tuple[Any, Optional[CompileReport]]]) -> dict[str, float]:
        """The figures as ``StaticDistFabricStrategy.metrics`` documents them (NaN ones left out), from each trainable
        model's ``(synchronizer, compile report)`` in the order they were set up: the first model's under
        ``static_dist/``, model ``i``'s (``i >= 1``) under ``static_dist/model{i}/``; the overlap figures are the
        first model's (the one recorded)."""
        figures: dict[str, float] = {}
        for index, (synchronizer, report) in enumerate(models):
            own = sync_figures(synchronizer) if synchronizer is not None else {}
            if index == 0:
                overlap, self._overlap = self._overlap, {}  # once per recorded step, as the monitor logs them
                own.update(overlap)
            if report is not None:
                own.update({"static_dist/graph_breaks": float(len(report.graph_breaks)),
                            "static_dist/recompiles": float(len(report.recompiles)),
                            "static_dist/compile_s": float(report.compile_s)})
            prefix = "static_dist/" if index == 0 else f"static_dist/model{index}/"
            figures.update({prefix + name.removeprefix("static_dist/"): value for name, value in own.items()})
        return {name: value for name, value in figures.items() if not math.isnan(value)}
