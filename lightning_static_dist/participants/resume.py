"""What a later run resumes from: the last step of every fit that trained is in a checkpoint, and where a resumed run
cannot continue bit for bit, one line says so at the first step of a fit resumed mid-epoch.

:class:`LastStepSave` has the run's ``ModelCheckpoint`` write the fit's last step when the fit ends if no save of
the fit holds it; :class:`MidEpochResume` says, in one line, when a training loader that keeps no position is
resumed mid-epoch. Why each is needed: docs/internals.md, "participants/resume.py".

Example (the strategy builds it in its ``__init__``)::

    check = MidEpochResume(strategy)
    check.on_train_batch_start()   # the fit's first batch: says so on rank 0 if its loader cannot resume mid-epoch
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.compat import save_step_as_at_interval, train_loaders
from lightning_static_dist.participants.base import StepContext, StepParticipant, StepView
def is_resumable(loader: object) -> bool:
    """Whether Lightning saves and restores ``loader``'s position (its ``_Stateful`` test: both methods)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class MidEpochResume(StepParticipant):
    """At a fit's first training batch: if the fit resumed mid-epoch and a training loader keeps no position, rank 0
    prints one line saying that the run does not continue as the uninterrupted one would."""

    def __init__(self, view: StepView) -> None:
        self._view = view
        self._first_batch = True
        self._trainer: Any = None

    def setup(self, context: StepContext) -> None:
        self._first_batch = True  # once per fit
        self._trainer = context.trainer_loop  # Lightning's fit loop knows the position (Fabric has no such loop)

    def on_train_batch_start(self) -> None:
        trainer = self._trainer
        if not self._first_batch or trainer is None:
            return
        self._first_batch = False
        batch = trainer.fit_loop.epoch_loop.batch_idx  # a fit's first batch is its epoch's first unless resumed
        if batch == 0:
            return
        plain = sorted({type(loader).__name__ for loader in train_loaders(trainer) if not is_resumable(loader)})
        if plain:
            rank_zero_info(
                f"static_dist: resumed mid-epoch (epoch {trainer.current_epoch}, batch {batch}, step "
                f"{trainer.global_step}) with a training loader that keeps no position ({', '.join(plain)} has no "
                "state_dict/load_state_dict): its epoch starts again from the first batch, so the run does not "
                "continue bit for bit")


class LastStepSave(StepParticipant):
    """At the end of a fit that took a step, where no checkpoint of this fit holds its last step (a ``ModelCheckpoint``
    at its interval, or the user's own ``trainer.save_checkpoint``): the run's first ``ModelCheckpoint`` writes it,
    as at its interval (its file name, its ``save_top_k``, its ``last`` file), and rank 0 says so. Nothing without a
    ``ModelCheckpoint`` (``enable_checkpointing=False``: the user keeps none), with ``fast_dev_run``, after a failure
    or an agreed SIGTERM stop (that one saved already), and for a fit that resumed a finished run (it took no
    step)."""

    def __init__(self, view: StepView) -> None:
        self._view = view
        self._loop: Any = None
        self._first_step: Optional[int] = None
        self._saved_step: Optional[int] = None

    def setup(self, context: StepContext) -> None:
        self._loop = context.trainer_loop if context.fitting else None  # (Fabric has no such loop)
        self._first_step = self._saved_step = None

    def on_train_batch_start(self) -> None:
        if self._first_step is None and self._loop is not None:
            self._first_step = self._loop.global_step  # after the checkpoint it resumed from was loaded

    def check_in_step(self) -> None:
        if self._loop is not None:  # every save of the fit comes here first (an unwritten one ends the fit)
            self._saved_step = self._loop.global_step

    def on_train_end(self) -> None:
        loop = self._loop
        if loop is None or self._first_step is None or loop.global_step <= self._first_step or loop.fast_dev_run:
            return
        callbacks = [c for c in loop.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        if not callbacks or self._saved_step == loop.global_step:
            return
        path = save_step_as_at_interval(callbacks[0], loop)
        rank_zero_info(f"static_dist: the fit ended at step {loop.global_step}, which no checkpoint held:"
                       f" saved {path}")
