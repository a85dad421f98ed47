"""What a Lightning ``Trainer`` run means to the step participants (:class:`TrainerContext`), the refusals its
arguments decide before any process starts (:func:`refuse_before_launch`: ``lsd-train`` reads them from the run
file, the launcher from the ``Trainer``), and the one check of the Trainer's callbacks only the strategy's setup can
make (:func:`refuse_saves_on_exception`).

Example::

    refuse_before_launch(config, TrainerSettings.from_arguments({"gradient_clip_val": 1.0, "devices": 2}))
    refuse_saves_on_exception(trainer.callbacks, world_size=2)
    context = TrainerContext(trainer)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_static_dist.compile.cudagraphs import choose_cudagraphs
from lightning_static_dist.config import ConfigError
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync.optimizer_overlap import SCALER_HAZARD, choose_optimizer_overlap

#: Lightning's precisions that carry a gradient scaler.
_SCALED = ("16-mixed", "16")

def clipping_clause(value: Any) -> str:
    """Why gradient clipping rules the optimizer overlap out (a clause of a line)."""
    return f"gradient clipping (trainer.gradient_clip_val={value}) needs every bucket's average first"


@dataclass(frozen=True)
class TrainerSettings:
    """The ``Trainer`` arguments that decide a refusal before any process starts, read from a run file's ``trainer``
    block (:meth:`from_arguments`) or from a built ``Trainer`` (:meth:`of`).

    Example::

        TrainerSettings.from_arguments({"accelerator": "cpu", "devices": 2, "accumulate_grad_batches": 2})
    """

    gradient_clip_val: Optional[float] = None
    """Clipping by norm or value (``None`` or 0: none)."""
    accumulate_grad_batches: int = 1
    """Backward passes per optimizer step."""
    precision: str = "32-true"
    """As Lightning spells it (``16-mixed`` carries a gradient scaler)."""
    device_type: str = "cpu"
    """What the ranks run on: ``cpu`` or ``cuda``."""
    ranks: Optional[int] = None
    """Processes the job starts (devices x nodes; ``None``: the accelerator counts them once it runs)."""
    num_nodes: int = 1

    @classmethod
    def from_arguments(cls, trainer: Mapping[str, Any], on_cpu: bool = True) -> TrainerSettings:
        """From ``lightning.Trainer`` keyword arguments, checked already (``runfile.py``); ``on_cpu``: the accelerator
        runs CPU processes."""
        devices = trainer.get("devices", "auto")
        text = str(devices).strip()
        if isinstance(devices, (list, tuple)):
            count: Optional[int] = len(devices)
        elif text.isdigit():
            count = int(text)
        elif on_cpu and text == "auto":
            count = 1  # (Lightning's CPU accelerator counts one device)
        elif "," in text:
            count = len([part for part in text.split(",") if part.strip()])
        else:
            count = None
        nodes = int(trainer.get("num_nodes", 1) or 1)
        return cls(gradient_clip_val=trainer.get("gradient_clip_val"),
                   accumulate_grad_batches=int(trainer.get("accumulate_grad_batches", 1) or 1),
                   precision=str(trainer.get("precision", "32-true")), device_type="cpu" if on_cpu else "cuda",
                   ranks=None if count is None else count * nodes, num_nodes=nodes)

    @classmethod
    def of(cls, trainer: pl.Trainer) -> TrainerSettings:
        """From a built ``Trainer`` (its strategy knows its devices, not yet its processes)."""
        strategy = trainer.strategy
        return cls(gradient_clip_val=trainer.gradient_clip_val, accumulate_grad_batches=trainer.accumulate_grad_batches,
                   precision=str(trainer.precision), device_type=strategy.root_device.type,
                   ranks=getattr(strategy, "world_size", None), num_nodes=trainer.num_nodes)


def refuse_before_launch(config: StrategyConfig, settings: TrainerSettings) -> None:
    """Raise the one-line ``ConfigError`` that setup would raise on every rank, where the ``strategy`` block and the
    ``Trainer``'s arguments (``settings``) decide it alone: ``compile.cudagraphs: true`` with accumulation, and
    ``sync.optimizer_overlap: true`` with clipping or a gradient scaler. What needs the model (an overridden hook, its optimizer) is still refused at setup."""
    if config.compile.enabled is True or (config.compile.enabled == "auto" and settings.device_type == "cuda"):
        choose_cudagraphs(config.compile, torch.device(settings.device_type), config.sync.mode,
                          gathers_parameters=config.sync.reduce == "reduce_scatter" or config.mesh.dp_shard != 1
                          or config.embedding.shard is not False,
                          micro_batches=settings.accumulate_grad_batches)  # (true with a hazard: raises)
    world = config.simulate.world_size or settings.ranks
    if config.sync.optimizer_overlap is not True or world == 1:
        return  # (one rank averages nothing: there is no overlap to refuse)
    found = []  # (sync.schedule measured with true: refused by the strategy block itself, on every device)
    if settings.gradient_clip_val:
        found.append(clipping_clause(settings.gradient_clip_val))
    if settings.precision in _SCALED:
        found.append(SCALER_HAZARD)
    choose_optimizer_overlap(True, found)  # (a hazard: raises)


def refuse_saves_on_exception(callbacks: list[Any], world_size: int) -> None:
    """``ModelCheckpoint(save_on_exception=True)`` with more than one rank: a :class:`ConfigError` (why:
    docs/internals.md, "trainer_context.py"). A SIGTERM stop saves by itself."""
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
            found.append(clipping_clause(trainer.gradient_clip_val))
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
