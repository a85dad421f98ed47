"""``strategy.sync.optimizer_overlap``: the optimizer steps each bucket's parameters as soon as that bucket's average
lands (:mod:`~lightning_static_dist.sync.optimizer_overlap` has the mechanics and the decision).

:class:`OptimizerOverlap` decides once at setup, from the config, the run (the front end's gradient readers, the
optimizer, the precision plugin) and the synchroniser the gradient participant built; prints the choice on rank 0;
tells the synchroniser to leave its after-backward waits to the step; and hands the front end the optimizer its
precision plugin steps (:meth:`OptimizerOverlap.optimizer_to_step`).

Example (the roster builds it; ``StaticDistStrategy.optimizer_step`` steps what it hands back)::

    overlap = OptimizerOverlap(strategy, gradients)
    overlap.after_setup(context)       # "static_dist: optimizer overlap: on (...)"
    optimizer = overlap.optimizer_to_step(optimizer)
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.participants.base import StepContext, StepParticipant, StrategyView
from lightning_static_dist.participants.gradients import GradientSynchronization
from lightning_static_dist.sync import GradientSynchronizer
from lightning_static_dist.sync.optimizer_overlap import (
    BucketwiseOptimizer,
    OverlapChoice,
    choose_optimizer_overlap,
    step_hazards,
)


class OptimizerOverlap(StepParticipant):
    """``sync.optimizer_overlap``: resolved at setup (:attr:`choice`); while on, each after-backward round leaves its
    waits to the optimizer step, which settles and steps one bucket at a time. Under ``sync.schedule: auto`` only the
    trial's after_backward rounds defer (an ``overlap`` round is waited for as backward ends, and stepped at once)."""

    def __init__(self, view: StrategyView, gradients: GradientSynchronization) -> None:
        self._view = view
        self._gradients = gradients
        self.choice: Optional[OverlapChoice] = None
        """Whether the optimizer steps bucket by bucket in this fit, and why (``None`` where nothing is averaged)."""

    def _synchronizer(self) -> Optional[GradientSynchronizer]:
        sync = self._gradients.synchronizer
        return sync if isinstance(sync, GradientSynchronizer) else None

    def after_setup(self, context: StepContext) -> None:
        self.choice = None
        if self._gradients.mode is None:
            return  # one rank, or not fitting: nothing is averaged, nothing to overlap
        view = self._view
        config = view.config
        module = view.lightning_module
        hazards = config.sync.optimizer_overlap_hazards(config.compression.name, config.compile.optimizer,
                                                        sharded=self._gradients.mode == "sharded")
        hazards += step_hazards(context.gradient_readers,
                                automatic_optimization=getattr(module, "automatic_optimization", True),
                                scaler=getattr(view.precision_plugin, "scaler", None) is not None,
                                optimizers=view.optimizers)
        self.choice = choose_optimizer_overlap(config.sync.optimizer_overlap, hazards)  # (true + a hazard: raises)
        self.switch(self.choice.on)
        if self.announced is not None:
            rank_zero_info(f"static_dist: {self.announced}")

    @property
    def announced(self) -> Optional[str]:
        """The choice as printed at fit start and kept in the run summary, where the schedule makes the key mean
        anything (``after_backward``, ``auto``; with ``overlap`` every bucket is waited for as backward ends)."""
        if self.choice is None or self._view.config.sync.schedule == "overlap":
            return None
        return self.choice.describe()

    def switch(self, on: bool) -> None:
        """Step bucket by bucket from the next round on (``on``, where :attr:`choice` allows it) or wait for every
        bucket as backward ends; between rounds. (``schedule: auto`` need not call it: only an after_backward round
        defers its waits.)"""
        sync = self._synchronizer()
        if sync is not None:
            sync.defer_waits = on and self.choice is not None and self.choice.on

    def optimizer_to_step(self, optimizer: Any) -> Any:
        sync = self._synchronizer()
        if sync is None or not sync.defer_waits:
            return optimizer
        return BucketwiseOptimizer(optimizer, sync)

    def teardown(self, failed: bool) -> None:
        self.switch(False)  # (the choice stays readable)
