"""What a Lightning ``Trainer`` run means to the step participants (:class:`TrainerContext`), and the one check of
the Trainer's callbacks only the strategy's setup can make (:func:`refuse_saves_on_exception`).

Example::

    refuse_saves_on_exception(trainer.callbacks, world_size=2)
    context = TrainerContext(trainer)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_static_dist.config import ConfigError


def refuse_saves_on_exception(callbacks: list[Any], world_size: int) -> None:
    """``ModelCheckpoint(save_on_exception=True)`` with more than one rank: a :class:`ConfigError`. An exception
    reaches one rank, and that rank alone would start the save, a collective here (the state's gather, the write's
    agreement, Lightning's barrier): it would wait for peers that never come. A SIGTERM stop saves by itself."""
    if world_size < 2:
        return
    for callback in callbacks:
        if getattr(callback, "save_on_exception", False):
            raise ConfigError(f"{type(callback).__name__}(save_on_exception=True): under static_dist a save is a"
                              " collective, and an exception reaches one rank, whose save would wait for the others;"
                              " allowed: save_on_exception=False (a SIGTERM stop saves a checkpoint by itself)")


class TrainerContext:
    """The :class:`~lightning_static_dist.participants.StepContext` of a Lightning ``Trainer``: what the step
    participants may know of it (fitting or not, the global step, the training loop, its callbacks).

    Example::

        context = TrainerContext(trainer)
        context.fitting, context.global_step     # (True, 0) at the start of a fit
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    @property
    def fitting(self) -> bool:
        return self._trainer.state.fn == TrainerFn.FITTING

    @property
    def global_step(self) -> int:
        return self._trainer.global_step

    @property
    def training(self) -> bool:
        return self._trainer.training

    def add_callback(self, callback: pl.Callback) -> None:
        if not any(isinstance(c, type(callback)) for c in self._trainer.callbacks):
            self._trainer.callbacks.append(callback)

    @property
    def micro_batches(self) -> int:
        return self._trainer.accumulate_grad_batches

    @property
    def gradient_readers(self) -> list[str]:
        """Clipping, the hooks Lightning runs between backward and the step where the module or a callback
        overrides them (they may read any gradient), and the module's own ``optimizer_step`` / ``backward`` where
        overridden (either may run a backward without a step after it, or read the gradients before the step)."""
        trainer = self._trainer
        found = []
        if trainer.gradient_clip_val:  # (None or 0: no clipping)
            found.append(f"gradient clipping (trainer.gradient_clip_val={trainer.gradient_clip_val}) needs every"
                         " bucket's average first")
        module = trainer.lightning_module
        for hook in ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"):
            owners = [module] if is_overridden(hook, module, parent=pl.LightningModule) else []
            owners += [c for c in trainer.callbacks if is_overridden(hook, c, parent=pl.Callback)]
            found.extend(f"{type(owner).__name__}.{hook} is overridden and may read the gradients" for owner in owners)
        found.extend(f"{type(module).__name__}.{hook} is overridden and may run a backward without stepping, or read"
                     " the gradients before the step" for hook in ("optimizer_step", "backward")
                     if is_overridden(hook, module, parent=pl.LightningModule))
        return found

    @property
    def trainer_loop(self) -> pl.Trainer:
        return self._trainer
