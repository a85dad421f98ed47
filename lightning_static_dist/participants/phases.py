"""The step's phases as typed methods, in their one order, with the state of the step checked in each.

Both front ends (``strategy.py`` for the Trainer, ``fabric/model.py`` for Fabric) drive the participants through a
:class:`StepPhases` and nothing else: each hook is one call here, so the sequences (setup, the end of a backward,
``no_sync``, teardown with the ranks' mismatch) are written once. :class:`StepState` records where the step is, as
FSDP2's ``TrainingState`` does per module; a front end that calls a phase the step cannot be in (gradients finished
with no backward, a forward before setup) gets a ``RuntimeError`` naming both. Only transitions every real front-end
order respects are checked: a training batch may start in any state (a step Lightning skipped, a manual loop that
did not step), a backward may start in any state (a Fabric model a backward does not reach keeps its state), and a
model never set up (Fabric: trained in eval mode) runs its backward phases unchecked.

Example (what ``StaticDistStrategy`` does)::

    phases = StepPhases(Participants(strategy, failed=strategy.has_failed))
    phases.set_up(context, build_optimizers=..., prepare=...)
    phases.before_backward(); loss.backward(); phases.end_backward()
    mismatch = phases.teardown(failed=False)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Optional

from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants.base import StepContext
from lightning_static_dist.participants.roster import Participants
from lightning_static_dist.agreement.fingerprint import RankMismatchError


class StepState(enum.Enum):
    """Where one roster's step is. ``IDLE`` also follows a backward whose gradients accumulate locally."""

    NOT_SET_UP = "not set up"
    SETTING_UP = "setting up"  # (counts as set up: a forward a participant's setup runs must not set up again)
    IDLE = "set up, no backward in flight"
    BACKWARD = "in backward"
    BACKWARD_ENDED = "backward ended, gradients not final"
    GRADIENTS_FINAL = "gradients final, the optimizer step next"


class StepPhases:
    """The one typed phase protocol over a roster (:class:`~.roster.Participants`), and the step's state.

    Args:
        participants: the roster whose phases run, in its order.

    Example::

        phases = StepPhases(participants)
        with phases.no_sync():          # a micro-batch that accumulates locally
            phases.before_backward(); loss.backward(); phases.end_backward()
    """

    def __init__(self, participants: Participants) -> None:
        self.participants = participants
        self.state = StepState.NOT_SET_UP
        self.accumulating = False
        """Inside :meth:`no_sync`: this micro-batch's gradients accumulate locally."""
        self.batch_open = False
        """A training batch began since the last optimizer step (or the last micro-batch that accumulated)."""
        self.got_gradients = False
        """A parameter's gradient was accumulated since the last :meth:`before_backward` (Fabric's gradient hooks
        tell it with :meth:`note_gradient`: which backward passes reach a model, as DDP's reducer reads them)."""

    def _expect(self, phase: str, *allowed: StepState) -> None:
        """A ``RuntimeError`` naming ``phase`` and the step's state, unless the step is in one of ``allowed``."""
        if self.state not in allowed:
            raise RuntimeError(f"static_dist: the front end called {phase} while the step is {self.state.value};"
                               f" allowed only when {' or '.join(s.value for s in allowed)}")

    def _expect_set_up(self, phase: str) -> None:
        if not self.is_set_up:
            raise RuntimeError(f"static_dist: the front end called {phase} before the step was set up")

    @property
    def is_set_up(self) -> bool:
        """The setup phases began (a stage's, or Fabric's at the model's setup or first training forward)."""
        return self.state is not StepState.NOT_SET_UP

    # ------------------------------------------------------------------------------------------------- setup

    def setup_distributed(self) -> None:
        for participant in self.participants.ordered:
            participant.setup_distributed()

    def set_up(self, context: StepContext, build_optimizers: Callable[[], None], prepare: Callable[[], None]) -> None:
        """``before_optimizers``; the front end builds (or repoints) the optimizers; ``setup``; the front end prepares
        (the precision plugin, the optimizers to the device); ``after_setup``. A new stage may begin in any state."""
        self.state = StepState.SETTING_UP  # (Fabric: maybe inside no_backward_sync, at the first forward)
        for participant in self.participants.ordered:
            participant.before_optimizers(context)  # the embeddings sharded: the optimizer must hold the shards
        build_optimizers()
        for participant in self.participants.ordered:
            participant.setup(context)  # the synchronisers, then compilation
        prepare()
        for participant in self.participants.ordered:
            participant.after_setup(context)
        self.state = StepState.IDLE

    def attach_recorder(self, recorder: StepRecorder) -> None:
        for participant in self.participants.ordered:
            participant.attach_recorder(recorder)

    def process_dataloader(self, dataloader: object) -> None:
        for participant in self.participants.ordered:
            participant.process_dataloader(dataloader)

    # ---------------------------------------------------------------------------------------------- one step

    def on_train_batch_start(self) -> None:
        self._expect_set_up("on_train_batch_start")
        self.batch_open = True
        for participant in self.participants.ordered:
            participant.on_train_batch_start()

    def before_forward(self) -> None:
        self._expect_set_up("before_forward")
        for participant in self.participants.ordered:
            participant.before_forward()

    def after_forward(self) -> None:
        for participant in self.participants.ordered:
            participant.after_forward()

    def before_reading_parameters(self) -> None:
        for participant in self.participants.ordered:
            participant.before_reading_parameters()

    def note_gradient(self, param: Any = None) -> None:
        """A gradient of this roster's model was accumulated (a post-accumulate-grad hook)."""
        self.got_gradients = True

    def before_backward(self) -> None:
        self.got_gradients = False
        if self.is_set_up:
            self.state = StepState.BACKWARD
        for participant in self.participants.ordered:
            participant.before_backward()

    def after_backward(self) -> None:
        """The backward's own compute is over (the recorder's backward ends before any round's waits)."""
        if self.is_set_up:
            self._expect("after_backward", StepState.BACKWARD)
            self.state = StepState.BACKWARD_ENDED
        for participant in self.participants.ordered:
            participant.after_backward()

    def finish_gradients(self) -> None:
        """After a backward that gave these parameters gradients: the round (or, inside :meth:`no_sync`, the local
        accumulation), the checks, then ``before_optimizer_step`` where a step follows."""
        if self.is_set_up:
            self._expect("finish_gradients", StepState.BACKWARD_ENDED)
        accumulating = self.accumulating
        for participant in self.participants.ordered:
            participant.finish_gradients(accumulating)
        if accumulating:  # no optimizer step follows this micro-batch: the next forward starts a batch
            self.state, self.batch_open = StepState.IDLE, False
            return
        self.state = StepState.GRADIENTS_FINAL
        for participant in self.participants.ordered:
            participant.before_optimizer_step()

    def end_backward(self) -> None:
        """:meth:`after_backward` then :meth:`finish_gradients`: a backward that reached this roster's model."""
        self.after_backward()
        self.finish_gradients()

    def optimizer_to_step(self, optimizer: Any) -> Any:
        """The optimizer the front end's precision plugin steps, as the participants wrap it (the optimizer overlap's
        stand-in steps bucket by bucket)."""
        return self.participants.optimizer_to_step(optimizer)

    def after_optimizer_step(self) -> None:
        for participant in self.participants.ordered:
            participant.after_optimizer_step()
        if self.is_set_up:
            self.state = StepState.IDLE
        self.batch_open = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """A micro-batch whose gradients accumulate locally: every participant's ``no_sync`` entered, in order."""
        self.accumulating = True
        try:
            with ExitStack() as stack:
                for participant in self.participants.ordered:
                    stack.enter_context(participant.no_sync())
                yield
        finally:
            self.accumulating = False

    # ----------------------------------------------------------------------------------------- loops and ends

    def on_validation_end(self) -> None:
        for participant in self.participants.ordered:
            participant.on_validation_end()

    def on_train_end(self) -> None:
        for participant in self.participants.ordered:
            participant.on_train_end()

    def on_exception(self, exception: BaseException) -> None:
        for participant in self.participants.ordered:
            participant.on_exception(exception)

    def check_in_step(self) -> None:
        """Raise the ranks' mismatch, if their last steps disagreed (no collective)."""
        for participant in self.participants.ordered:
            participant.check_in_step()

    def teardown(self, failed: bool, on_mismatch: Callable[[], None] = lambda: None) -> Optional[RankMismatchError]:
        """:func:`teardown_all` of this roster alone."""
        return teardown_all([self], failed, on_mismatch)

    # ------------------------------------------------------------------------------------------- checkpoints

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        for participant in self.participants.ordered:
            participant.load_state_dict(checkpoint)  # each takes its own entries out (kept until its setup)

    def after_model_loaded(self) -> None:
        for participant in self.participants.ordered:
            participant.after_model_loaded()

    def model_state_dict(self, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The model's state dict as saved: ``read()`` (the front end's state dict) once the parameters may be read
        (a module whose ``state_dict`` copies must not copy a shard's gather in flight), then the participants' forms
        (a collective where weights are gathered)."""
        self.before_reading_parameters()
        return self.participants.model_state_dict(read())


def run_backward(rosters: Sequence[StepPhases], run: Callable[[], None]) -> None:
    """One backward over several rosters (Fabric: the models whose training forward ran since their step): every
    roster's ``before_backward``, ``run()`` (the backward), every roster's ``after_backward`` (so no recorder counts
    another's waits as compute), then :meth:`~StepPhases.finish_gradients` of those it gave gradients, in order. A
    roster the backward does not reach runs no round, as DDP's reducer, fired by its gradient hooks, runs none."""
    for roster in rosters:
        roster.before_backward()
    run()
    for roster in rosters:
        roster.after_backward()
    for roster in rosters:
        if roster.got_gradients:
            roster.finish_gradients()


def teardown_all(rosters: Iterable[StepPhases], failed: bool,
                 on_mismatch: Callable[[], None] = lambda: None) -> Optional[RankMismatchError]:
    """Every roster's ``check_in_step`` (unless ``failed``), then every participant's ``teardown``, each also when
    another raised (the first error is raised once all ran). ``failed`` or out of step: with no collective (a peer may
    be gone). The ranks' mismatch is returned, for the front end to raise once its own teardown is done."""
    rosters = list(rosters)
    mismatch: Optional[RankMismatchError] = None
    if not failed:
        try:  # (no collective: the last rounds' verdicts, read from what they recorded)
            for roster in rosters:
                roster.check_in_step()
        except RankMismatchError as err:
            mismatch = err
            on_mismatch()  # (the front end marks this rank failed before anything tears down: its watchdog reads it)
    error: Optional[BaseException] = None
    for roster in reversed(rosters):  # the last set up first
        roster.state, roster.accumulating, roster.batch_open = StepState.NOT_SET_UP, False, False
        for participant in roster.participants.ordered:
            try:
                participant.teardown(failed or mismatch is not None)
            except BaseException as err:  # noqa: BLE001 (the others still tear down; the first is raised)
                error = error if error is not None else err
    if error is not None:
        raise error
    return mismatch
