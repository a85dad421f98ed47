"""Where a resumed run cannot continue bit for bit: one line, at the first step of a fit resumed mid-epoch.

Lightning's fit loop saves a training loader's position only when the loader has ``state_dict`` and
``load_state_dict`` (``torchdata``'s ``StatefulDataLoader``, or
:class:`~lightning_static_dist.examples.charlm.ResumableLoader`). A plain ``DataLoader`` resumed from a mid-epoch
checkpoint starts its epoch again from the first batch: the weights are restored exactly, the data that follows is
not the uninterrupted run's, and the curves part.

Example (the strategy builds it in its ``__init__``)::

    check = MidEpochResume(strategy)
    check.on_train_batch_start()   # the fit's first batch: says so on rank 0 if its loader cannot resume mid-epoch
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.compat import train_loaders
from lightning_static_dist.participants.base import StepContext, StepParticipant, StrategyView


def is_resumable(loader: object) -> bool:
    """Whether Lightning saves and restores ``loader``'s position (its ``_Stateful`` test: both methods)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class MidEpochResume(StepParticipant):
    """At a fit's first training batch: if the fit resumed mid-epoch and a training loader keeps no position, rank 0
    prints one line saying that the run does not continue as the uninterrupted one would."""

    def __init__(self, view: StrategyView) -> None:
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
