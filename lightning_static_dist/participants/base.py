"""A step participant: one feature's part of a step, and what it may read of the front end.

Each feature owns its part of every phase as a :class:`StepParticipant`; :class:`~.phases.StepPhases` runs a phase on
every participant in one fixed order, so a hook never asks which features are on (a feature that is off does nothing).
The phases in the order of a step: docs/architecture.md, "Phases, in the order of a step".

Example (a participant that counts optimizer steps)::

    class StepCounter(StepParticipant):
        def __init__(self) -> None:
            self.steps = 0

        def after_optimizer_step(self) -> None:
            self.steps += 1
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.plan.step_plan import StepPlan
from lightning_static_dist.overlap.recorder import StepRecorder


class StepContext(Protocol):
    """What a participant knows of the run it serves, whichever front end drives it (a ``Trainer`` or Fabric's loop).
    Handed to the setup phases, then kept as :attr:`StrategyView.context`; a participant reads it, never the
    ``Trainer`` (docs/architecture.md: Layers)."""

    @property
    def fitting(self) -> bool:
        """Gradients are computed and the optimizers step (a Trainer's ``fit``; Fabric: a module with trainable
        parameters); ``False`` for validate, test and predict."""
        ...

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        ...

    @property
    def training(self) -> bool:
        """A training loop is running (not a validation or prediction loop)."""
        ...

    def add_callback(self, callback: Any) -> None:
        """Add a front-end callback, unless one of its type is there already (Fabric, which has no such callbacks:
        nothing)."""
        ...

    @property
    def micro_batches(self) -> Optional[int]:
        """Backward passes per optimizer step where the front end fixes them (a Trainer's
        ``accumulate_grad_batches``); ``None`` where the loop decides step by step (Fabric's ``no_backward_sync``)."""
        ...

    @property
    def gradient_readers(self) -> Optional[list[str]]:
        """What the front end runs between a step's backward and its optimizer step that may read the gradients, a
        clause each (gradient clipping, an overridden ``on_after_backward`` ...); ``None`` where it cannot tell
        (Fabric: the script's own loop runs there)."""
        ...

    @property
    def trainer_loop(self) -> Any:
        """The ``Trainer``, for the participants bound to Lightning's loop:
        :class:`~lightning_static_dist.participants.runtime.SigtermAgreement` patches it, and
        :class:`~lightning_static_dist.participants.resume.MidEpochResume` reads where a resumed fit starts;
        ``None`` under Fabric."""
        ...


class PlanView(Protocol):
    """The plan of the world that started: what phases read, never the config."""

    @property
    def plan(self) -> StepPlan:
        """The config resolved for the world that started (set up with the processes)."""
        ...

    def settle_schedule(self, plan: StepPlan) -> None:
        """Replace the plan by ``plan``, in which a pending ``sync.schedule: measured`` is settled (the probe at
        setup; ``participants/schedule_probe.py``)."""
        ...


class RanksView(Protocol):
    """The ranks that started: their number, this rank, its device, the groups and the mesh, a simulated world."""

    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def device_mesh(self) -> Any: ...

    @property
    def simulation(self) -> Optional[SimulateConfig]:
        """``strategy.simulate`` when the world is simulated, else ``None``."""
        ...

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]: ...

    @property
    def host_group(self) -> Optional[dist.ProcessGroup]: ...

    def barrier(self, *args: Any, **kwargs: Any) -> None: ...


class TrainingView(Protocol):
    """What is trained: the module, the optimizers, the precision plugin."""

    @property
    def lightning_module(self) -> Optional[pl.LightningModule]: ...

    @property
    def model(self) -> Optional[torch.nn.Module]: ...

    @property
    def optimizers(self) -> list[Any]: ...

    @property
    def precision_plugin(self) -> Any: ...


class StepView(Protocol):
    """Where the run stands: its :class:`StepContext` and whether it stopped at an agreed SIGTERM."""

    @property
    def context(self) -> Optional[StepContext]:
        """The run's :class:`StepContext` once a stage's setup began; ``None`` before."""
        ...

    @property
    def preempted(self) -> bool:
        """Whether ``fit`` ended at the ranks' agreed SIGTERM stop (its checkpoint already written on every rank)."""
        ...


class WorldView(PlanView, RanksView, Protocol):
    """The plan and the ranks it was resolved for."""


class TrialView(WorldView, StepView, Protocol):
    """What a trial or a watch over the steps reads: the plan, the ranks, the step."""


class ModelWorldView(WorldView, TrainingView, Protocol):
    """The plan, the ranks and what they train, without the step."""


class StrategyView(WorldView, TrainingView, StepView, Protocol):
    """All a front end offers its participants (each participant is typed with the part it reads: :class:`PlanView`,
    :class:`RanksView`, :class:`TrainingView`, :class:`StepView` or one of their unions). A participant never imports
    the strategy (a layer above); it is handed this view."""


def syncs_gradients(context: StepContext, view: RanksView) -> bool:
    """Whether this setup builds gradient synchronisation: while fitting, on more than one rank (one rank has
    nothing to average: no buckets, no copies)."""
    return context.fitting and view.world_size > 1


def global_step(view: StepView) -> int:
    """The optimizer steps taken so far; ``-1`` before a stage's setup."""
    return view.context.global_step if view.context is not None else -1


def advance_trial(trial: Any, synchronizer: Any, view: StepView, apply: Any) -> None:
    """One batch start of an ``auto`` trial (``compression.name``; ``sync.schedule``'s runs its own) of
    ``synchronizer``: the candidate for the coming step applied with ``apply(candidate)``."""
    if trial is None or trial.decided or synchronizer is None:
        return
    candidate = trial.before_step(global_step(view))
    if candidate != "keep":
        apply(candidate)


def end_trial_step(trial: Any, apply: Any, label: Optional[str]) -> bool:
    """One optimizer step's end in an ``auto`` trial: the choice, made at the end of the trial's last step, applied
    with ``apply(candidate)`` and printed (``label``; ``None``: the caller prints it, with what the trial cost).
    Whether the trial decided now."""
    if trial is None or trial.decided:
        return False
    candidate = trial.after_step()
    if candidate != "keep":
        apply(candidate)
    if trial.decided and label is not None:
        rank_zero_info(f"static_dist: {label}: {trial.describe()}")
    return bool(trial.decided)


class StepParticipant:
    """One feature's part of a step. Every phase is a no-op here: override the ones the feature acts in."""

    def setup_distributed(self) -> None:
        """The process group and the data-parallel mesh exist."""

    def before_optimizers(self, context: StepContext) -> None:
        """Setup, with the model on the device and the same on every rank, before the optimizers are built."""

    def setup(self, context: StepContext) -> None:
        """Setup, with the optimizers built (while fitting), before the precision plugin is set up."""

    def after_setup(self, context: StepContext) -> None:
        """Setup's end: the precision plugin is set up and the optimizers are on the device."""

    def process_dataloader(self, dataloader: object) -> None:
        """A dataloader Lightning is about to iterate (changed in place, if at all)."""

    def attach_recorder(self, recorder: StepRecorder) -> None:
        """The overlap monitor's recorder, to be told of compute phases and collectives."""

    def on_train_batch_start(self) -> None:
        """A training batch begins (before its forward)."""

    def before_forward(self) -> None:
        """The training step's forward is next."""

    def after_forward(self) -> None:
        """The training step's forward returned."""

    def before_reading_parameters(self) -> None:
        """A validation forward, or the model's state dict, is about to read the parameters' values."""

    def before_backward(self) -> None:
        """The backward pass is next."""

    def after_backward(self) -> None:
        """The backward's own compute is over: what comes next (waiting for collectives) is not compute."""

    def finish_gradients(self, accumulating: bool) -> None:
        """Make this micro-batch's gradients final (synchronised where this is an optimizer step's last micro-batch,
        ``accumulating`` otherwise); runs before clipping, the gradient scaler and ``on_before_optimizer_step``."""

    def before_optimizer_step(self) -> None:
        """The optimizer step (clipping and unscaling first) is next."""

    def optimizer_to_step(self, optimizer: Any) -> Any:
        """The optimizer the front end's precision plugin steps: ``optimizer`` itself, or this participant's wrapper of
        it (the one before it in the order may have wrapped it already)."""
        return optimizer

    def after_optimizer_step(self) -> None:
        """The optimizer stepped."""

    def on_validation_end(self) -> None:
        """A validation loop ended (inside ``fit`` too, the sanity check included)."""

    def on_train_end(self) -> None:
        """The training loop ended without an error: every rank took the same last step (a collective may run)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A context for a micro-batch whose gradients accumulate locally (no synchronisation)."""
        return nullcontext()

    def on_exception(self, exception: BaseException) -> None:
        """The run failed: forget what waits on peers (a failed peer may never join it)."""

    def check_in_step(self) -> None:
        """Before a checkpoint is written and before teardown: raise if the ranks' last steps disagreed (read from
        what the last steps recorded; no collective, so a missing peer cannot make it wait)."""

    # ------------------------------------------------------------------------------------------ checkpoints

    def model_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """The model's state dict as saved: Lightning's, as this participant would have it saved."""
        return state

    def model_state_to_load(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's model state dict as this rank's model loads it."""
        return state

    def after_model_loaded(self) -> None:
        """The model's state dict was loaded."""

    def optimizer_state(self, optimizer: Any) -> Optional[dict[str, Any]]:
        """The optimizer's state as saved, when this participant holds it in a form of its own (the first
        participant that returns one wins; ``None``: Lightning's)."""
        return None

    def optimizer_state_to_save(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """Lightning's optimizer state, as this participant would have it saved."""
        return state

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        """Load the checkpoint's optimizer states in this participant's own form; ``True``: loaded, Lightning's
        loading is skipped."""
        return False

    def optimizer_state_to_load(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's optimizer state as this rank's optimizer loads it."""
        return state

    def write_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> bool:
        """Write the checkpoint in this participant's own format; ``True``: written, Lightning's writing is
        skipped (and no participant adds its :meth:`state_dict`)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Entries this participant adds to a checkpoint (a collective where a rank's state is gathered: every rank
        calls it; an entry may be left out on ranks that do not write)."""
        return {}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint read on this rank: take (and remove) this participant's entries."""

    def teardown(self, failed: bool) -> None:
        """The stage is over. ``failed``: the run failed or the ranks were out of step; do no collective."""
