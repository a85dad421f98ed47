"""The step participants' :class:`~lightning_static_dist.offer.StaticDistOffer`: what a callback reads of them, and
the one way it changes the reducer (through its owner,
:class:`~lightning_static_dist.participants.compression_state.CompressionState`).

Example (what ``StaticDistStrategy.__init__`` does, and the Fabric strategy per trainable model; users and callbacks
get it with ``offer_of(trainer)`` or ``offer_of(fabric)``)::

    offer = RosterOffer(participants, strategy, host_max=strategy.host_max)
    offer.sync_figures()          # SyncFigures(mode="hooks", rounds=..., bytes_sent=..., ...)
    offer.swap_reducer(None)      # the exact mean from the next round on
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from lightning_static_dist.compile import CompileReport
from lightning_static_dist.compression import CompressingReducer
from lightning_static_dist.trial import StepTrial
from lightning_static_dist.offer import ScheduleChoice, StaticDistOffer, SyncFigures
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants.base import RanksView
from lightning_static_dist.participants.roster import Participants
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.sync.schedule_choice import MeasuredChoice


class RosterOffer(StaticDistOffer):
    """:class:`~lightning_static_dist.offer.StaticDistOffer` over one strategy's participants (read when asked: a
    figure is this moment's).

    Args:
        participants: the strategy's participants.
        view: the strategy, as the participants read it.
        host_max: the strategy's maximum over ranks of host figures (a collective).
    """

    def __init__(self, participants: Participants, view: RanksView,
                 host_max: Callable[[Sequence[float]], list[float]]) -> None:
        self._parts = participants
        self._view = view
        self._host_max = host_max

    @property
    def root_device(self) -> torch.device:
        return self._view.root_device

    @property
    def simulation(self) -> Optional[SimulateConfig]:
        return self._view.simulation

    def sync_figures(self) -> Optional[SyncFigures]:
        gradients = self._parts.gradients
        sync = gradients.synchronizer  # (kept after teardown: its counters stay readable)
        graph = gradients.graph_sync
        if sync is None and graph is None:
            return None
        stats = sync.stats if sync is not None else None
        graph_rounds = graph.rounds if graph is not None else 0
        graph_bytes = graph.bytes_per_round if graph is not None else 0
        return SyncFigures(
            mode="graph" if graph is not None else "hooks",
            rounds=(stats.rounds if stats else 0) + graph_rounds,
            collectives=stats.collectives if stats else None,
            bytes_sent=(stats.bytes_sent if stats else 0) + graph_rounds * graph_bytes,
            bytes_per_round=graph_bytes or (stats.last_round_bytes if stats else 0),
            bucket_plan=sync.plan.describe() if sync is not None else None,
            optimizer_overlap=self._parts.overlap.announced,
            dense_bytes_per_round=graph_bytes or (stats.last_round_dense_bytes if stats else 0),
        )

    @property
    def compile_report(self) -> Optional[CompileReport]:
        return self._parts.compile.report

    def attach_recorder(self, recorder: StepRecorder) -> None:
        for participant in self._parts.ordered:
            participant.attach_recorder(recorder)

    @property
    def compression_trial(self) -> Optional[StepTrial]:
        return self._parts.compression.trial

    def schedule_choice(self) -> Optional[ScheduleChoice]:
        schedule = self._parts.schedule
        trial = schedule.trial
        if trial is None or trial.choice is None:
            return None
        return ScheduleChoice(choice=trial.choice, step_s=dict(trial.step_s), trial_steps=schedule.trial_steps,
                              trial_s=schedule.trial_s)

    def measured_schedule(self) -> Optional[MeasuredChoice]:
        return self._parts.probe.choice

    @property
    def compressing_reducer(self) -> Optional[CompressingReducer]:
        return self._parts.compression.reducer

    def swap_reducer(self, compressor: Optional[Any]) -> None:
        self._parts.compression.swap(compressor)

    def host_max(self, values: Sequence[float]) -> list[float]:
        return self._host_max(values)

    def wait_for_parameters(self) -> None:
        sharded = self._parts.gradients.sharded_sync
        if sharded is not None:
            sharded.wait_gather()
