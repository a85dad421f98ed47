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

import dataclasses
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.participants.base import (StepContext, StepParticipant, StrategyView, TrainingView,
                                                     global_step)
from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.participants.schedule_trial import ScheduleTrial
from lightning_static_dist.sync import GradientSynchronizer
from lightning_static_dist.sync.optimizer_overlap import (
    BucketwiseOptimizer,
    OverlapChoice,
    choose_optimizer_overlap,
    step_hazards,
)


def run_hazards(view: TrainingView, context: Optional[StepContext]) -> list[str]:
    """What the run shows that rules the optimizer overlap out, a clause each: the front end's gradient readers, the
    optimizers and their step hooks, the precision plugin (the block's part: ``StepPlan.overlap_hazards``)."""
    return step_hazards(context.gradient_readers if context is not None else None,
                        automatic_optimization=getattr(view.lightning_module, "automatic_optimization", True),
                        scaler=getattr(view.precision_plugin, "scaler", None) is not None,
                        optimizers=view.optimizers)


class OptimizerOverlap(StepParticipant):
    """``sync.optimizer_overlap``: resolved at setup (:attr:`choice`); while on, each after-backward round leaves its
    waits to the optimizer step, which settles and steps one bucket at a time. Under ``sync.schedule: auto`` only the
    trial's after_backward rounds defer (an ``overlap`` round is waited for as backward ends, and stepped at once):
    what is printed and summarised says so until the trial decides, then what it decided (``schedule``: its trial).

    A round the step did not settle (a front end that ran a backward without stepping) is settled before the next
    training batch, its forward, and anything that reads the parameters: never by the next backward, whose first
    gradient would already be in ``param.grad`` (the synchroniser refuses that backward)."""

    def __init__(self, view: StrategyView, gradients: GradientAveraging,
                 schedule: Optional[ScheduleTrial] = None) -> None:
        self._view = view
        self._gradients = gradients
        self._schedule = schedule
        self.choice: Optional[OverlapChoice] = None
        """Whether the optimizer steps bucket by bucket in this fit, and why (``None`` where nothing is averaged)."""
        self._decided: Optional[str] = None  # under sync.schedule auto: the line once its trial chose
        self._context: Optional[StepContext] = None

    def _synchronizer(self) -> Optional[GradientSynchronizer]:
        return self._gradients.hook_sync

    def after_setup(self, context: StepContext) -> None:
        self.choice, self._decided, self._context = None, None, context
        if self._gradients.mode is None:
            return  # one rank, or not fitting: nothing is averaged, nothing to overlap
        plan = self._view.plan
        hazards = plan.overlap_hazards()
        hazards += self._run_hazards()
        measured = plan.sync.schedule_choice
        if measured is not None and plan.sync.schedule == "after_backward" and not measured.candidate.step_per_bucket:
            hazards.append("sync.schedule measured predicted after_backward faster with the step taken whole")
        self.choice = choose_optimizer_overlap(plan.sync.optimizer_overlap, hazards)  # (true + a hazard: raises)
        self.switch(self.choice.on)
        self._follow_trial()  # (a resumed fit's trial may have decided already)
        if self.announced is not None:
            rank_zero_info(f"static_dist: {self.announced}")

    @property
    def announced(self) -> Optional[str]:
        """The choice as printed at fit start and kept in the run summary, where the schedule makes the key mean
        anything (``after_backward``, ``auto``; with ``overlap`` every bucket is waited for as backward ends). Under
        ``sync.schedule: auto`` it is on for the after_backward candidates only until the trial decides, then as the
        choice makes it (an ``overlap/...`` choice steps no bucket on its own: off)."""
        if self.choice is None or self._view.plan.sync.schedule == "overlap":
            return None
        if self._view.plan.sync.schedule != "auto" or not self.choice.on:
            return self.choice.describe()
        return self._decided or f"optimizer overlap: on for sync.schedule auto's after_backward candidates" \
                                f" ({self.choice.why})"

    def _follow_trial(self) -> bool:
        """Under ``sync.schedule: auto``, once its trial has chosen: :attr:`announced` as the choice makes it. Whether
        that happened now."""
        trial = self._schedule.trial if self._schedule is not None else None
        if self._decided is not None or self.choice is None or not self.choice.on or trial is None or not trial.decided:
            return False
        chosen = str(trial.choice)
        self._decided = self.choice.describe() if chosen.startswith("after_backward") else (
            f"optimizer overlap: off (sync.schedule auto chose {chosen}: every bucket is waited for as backward ends)")
        return True

    def _run_hazards(self) -> list[str]:
        """:func:`run_hazards` at setup, and again before each batch (a hook can be registered later)."""
        return run_hazards(self._view, self._context)

    def turn_off(self, hazard: str) -> None:
        """A hazard that appeared after setup (a step hook registered in ``on_train_start``, a callback that reads
        the gradients): every bucket is waited for before the step from now on, said in one line. Never a hook run
        once per bucket."""
        if self.choice is None or not self.choice.on:
            return
        self.choice = OverlapChoice(False, f"{hazard}; found after setup, at step {global_step(self._view)}")
        self._decided = None
        self.switch(False)
        rank_zero_info(f"static_dist: {self.choice.describe()}")

    def _settle(self) -> None:
        sync = self._synchronizer()
        if sync is not None:
            sync.settle()

    def on_train_batch_start(self) -> None:
        self._settle()
        if self.choice is not None and self.choice.on:
            late = self._run_hazards()
            if late:
                self.turn_off(late[0])
        if self._follow_trial():  # (the schedule trial decided at the end of the step before)
            rank_zero_info(f"static_dist: {self.announced}")

    def before_forward(self) -> None:
        self._settle()  # (a closure run twice in one batch)

    def before_reading_parameters(self) -> None:
        self._settle()  # (validation, or the state dict, after a backward that was not stepped)

    def switch(self, on: bool) -> None:
        """Step bucket by bucket from the next round on (``on``, where :attr:`choice` allows it) or wait for every
        bucket as backward ends; between rounds. (``schedule: auto`` need not call it: only an after_backward round
        defers its waits.)"""
        sync = self._synchronizer()
        if sync is not None:
            sync.follow(dataclasses.replace(sync.schedule, defer_waits=on and self.choice is not None and self.choice.on))

    def optimizer_to_step(self, optimizer: Any) -> Any:
        sync = self._synchronizer()
        if sync is None or not sync.schedule.defer_waits:
            return optimizer
        return BucketwiseOptimizer(optimizer, sync, on_late_hazard=self.turn_off)

    def teardown(self, failed: bool) -> None:
        self.switch(False)  # (the choice stays readable)
