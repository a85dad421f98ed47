"""Reading recorded steps once they are complete, and combining their figures over the ranks on the host.

A rank never waits for a step's events; the steps every rank has completed are logged, each with its figures'
mean and maximum over ranks, a step or more after they ran. Why and how: docs/internals.md, "overlap/readout.py".

Example::

    readout = StepReadout(("comm_ms",), offer.host_max, rank=0, world_size=2)
    readout.add(recorder.close_step())                  # at the end of a recorded step
    for timeline, row in readout.read():                # every later step: the ones every rank has completed
        logger.log_metrics(row, step=timeline.step)     # {"static_dist/comm_ms": ..., "static_dist/comm_ms_max": ...}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_static_dist.overlap.intervals import step_metrics
from lightning_static_dist.overlap.recorder import ClosedStep
from lightning_static_dist.overlap.timeline import StepTimeline

#: the strategy's maximum over ranks of host figures (``StaticDistOffer.host_max``): a collective
HostMax = Callable[[Sequence[float]], list[float]]


@dataclass
class _Pending:
    """A closed step, and its timeline and figures once read (kept while another rank has not completed it)."""

    closed: ClosedStep
    timeline: Optional[StepTimeline] = None
    figures: Optional[list[float]] = None


class StepReadout:
    """The closed steps of this rank not logged yet, read once every rank has completed them.

    Args:
        names: the figures of :func:`~lightning_static_dist.overlap.intervals.step_metrics` to combine, in order.
        host_max: the strategy's maximum over ranks of host figures (a collective, on the host).
        rank: this rank.
        world_size: the number of ranks.
        no_max: figures logged without ``_max`` (a per-step maximum already).

    Every rank must add the same steps and call :meth:`read` at the same points (a collective at world size > 1).
    """

    def __init__(self, names: Sequence[str], host_max: HostMax, rank: int, world_size: int,
                 no_max: Sequence[str] = ()) -> None:
        self.names = tuple(names)
        self.no_max = tuple(no_max)
        self._host_max = host_max
        self._rank, self._world_size = rank, world_size
        self._pending: list[_Pending] = []

    @property
    def pending(self) -> int:
        """Closed steps not read yet."""
        return len(self._pending)

    def add(self, closed: ClosedStep) -> None:
        self._pending.append(_Pending(closed))

    def clear(self) -> None:
        """Forget the closed steps (a failed fit: no collective may follow)."""
        self._pending = []

    def read(self, wait: bool = False) -> list[tuple[StepTimeline, dict[str, float]]]:
        """The oldest steps that every rank has completed, each with its row (``static_dist/<name>``: the mean over
        ranks, ``..._max``: the maximum; NaN where no rank measured it), removed from the queue. ``wait``: wait for
        every pending step first (the end of an epoch), so that all are read. A collective at world size > 1."""
        if not self._pending:
            return []
        ready = 0
        for entry in self._pending:
            if wait:
                entry.closed.wait()
            elif not entry.closed.complete():  # a query: the steps complete in order, so the first no ends the count
                break
            if entry.figures is None:
                entry.timeline = entry.closed.timeline()
                figures = step_metrics(entry.timeline)
                entry.figures = [figures[name] for name in self.names]
            ready += 1
        figures = [entry.figures for entry in self._pending[:ready] if entry.figures is not None]
        agreed, tables = gather_on_host(self._host_max, self._rank, self._world_size, figures, len(self._pending),
                                        len(self.names))
        read, self._pending = self._pending[:agreed], self._pending[agreed:]
        return [(entry.timeline, row_of(self.names, table, prefix="", no_max=self.no_max))
                for entry, table in zip(read, tables) if entry.timeline is not None]


def gather_on_host(host_max: HostMax, rank: int, world_size: int, figures: Sequence[Sequence[float]],
                   slots: int, width: int) -> tuple[int, list[torch.Tensor]]:
    """Every rank's figures of the first steps that all ranks have, through one ``host_max``. A collective.

    Args:
        host_max: the maximum over ranks (a collective).
        rank, world_size: this rank and the number of ranks.
        figures: this rank's figures of its first ``len(figures)`` steps (one row of ``width`` each).
        slots: the steps pending (the same on every rank; ``len(figures) <= slots``).
        width: the number of figures per step (the same on every rank).

    Returns:
        The number of steps every rank had (the smallest ``len(figures)``), and for each of those steps a
        ``(world_size, width)`` float64 table, row ``r`` rank ``r``'s figures, NaN where it measured nothing.

    Example::

        agreed, tables = gather_on_host(offer.host_max, rank=1, world_size=2, figures=[[0.5, 2.0]], slots=2, width=2)
    """
    if world_size == 1:
        return len(figures), [torch.tensor([row], dtype=torch.float64) for row in figures]
    table = [-math.inf] * (1 + slots * world_size * width)
    table[0] = -len(figures)  # the maximum of minus the count: minus the smallest count
    for step, row in enumerate(figures):
        start = 1 + (step * world_size + rank) * width
        table[start:start + width] = [value if value == value else -math.inf for value in row]
    gathered = host_max(table)
    agreed = int(-gathered[0])
    tables = []
    for step in range(agreed):
        start = 1 + step * world_size * width
        values = torch.tensor(gathered[start:start + world_size * width], dtype=torch.float64)
        tables.append(torch.where(torch.isneginf(values), math.nan, values).reshape(world_size, width))
    return agreed, tables


def mean_and_max(table: torch.Tensor) -> tuple[list[float], list[float]]:
    """The mean and the maximum of each column over the rows (ranks) of ``table``, NaN left out; NaN where a column
    has no number (and a maximum of ±inf). The arithmetic of ``RankAggregate.compute`` (``callbacks/monitor.py``).

    Example::

        mean_and_max(torch.tensor([[1.0, math.nan], [3.0, math.nan]], dtype=torch.float64))  # ([2.0, nan], [3.0, nan])
    """
    finite = ~torch.isnan(table)
    total = torch.where(finite, table, 0.0).sum(0)
    count = finite.to(table).sum(0)
    maximum = torch.where(finite, table, -math.inf).amax(0)
    mean = torch.where(count > 0, total / count.clamp(min=1), math.nan)
    maximum = torch.where(torch.isinf(maximum), math.nan, maximum)
    return mean.tolist(), maximum.tolist()


def row_of(names: Sequence[str], table: torch.Tensor, prefix: str, no_max: Sequence[str] = ()) -> dict[str, float]:
    """A step's logged row from its ``(ranks, len(names))`` table: ``static_dist/<prefix><name>`` the mean over
    ranks, ``..._max`` the maximum (not for ``no_max``, nor with one rank)."""
    if table.shape[0] == 1:  # one rank: the figures themselves, NaN kept (the history shows what was not measured)
        return {f"static_dist/{prefix}{name}": value for name, value in zip(names, table[0].tolist())}
    mean, maximum = mean_and_max(table)
    row = {f"static_dist/{prefix}{name}": value for name, value in zip(names, mean)}
    row.update({f"static_dist/{prefix}{name}_max": value for name, value in zip(names, maximum) if name not in no_max})
    return row
