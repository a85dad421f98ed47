"""One strategy's step participants, built in their one order, and how their answers to a phase combine.

Most phases only act; the checkpoint phases answer, and the answers combine here: each participant folds the state
the one before it returned; the first to claim a file or an optimizer's state wins.

Example (what ``StaticDistStrategy.__init__`` does)::

    participants = Participants(strategy, failed=strategy.has_failed)
    phases = StepPhases(participants)
    state = participants.optimizer_state(optimizer, lightning_state)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from lightning_static_dist.participants.base import StepParticipant, StrategyView
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.compression_state import CompressionState
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.participants.optimizer_overlap import OptimizerOverlap
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.participants.resume import LastStepSave, MidEpochResume
from lightning_static_dist.participants.schedule_probe import ScheduleProbe
from lightning_static_dist.participants.schedule_trial import ScheduleTrial
from lightning_static_dist.participants.runtime import CollectiveTimeout, PeerWatch, SigtermAgreement, SimulationMark
from lightning_static_dist.participants.parameter_shards import ParameterShards


class Participants:
    """The participants of one strategy, named (``participants.gradients.synchronizer`` ...)
    and in the one order every phase calls them (each one's part: docs/architecture.md, Layers).

    The order keeps what must come first first: the schedule settled (``measured``) before anything follows it; the
    buffers before the embeddings' gather before the recorder's
    forward; the gradients synchronised and checked, then the embeddings released; the synchroniser built before
    the participants that act on it set up; at teardown its hooks are taken out before the sharded one gives the
    parameters back (a collective); the recorder last, so that a phase it marks begins after the waits of the
    others, and never counts waiting as compute.

    Args:
        view: the strategy, as the participants read it.
        failed: whether this rank is reporting a failure itself (the peer watchdog's thread asks).
    """

    def __init__(self, view: StrategyView, failed: Callable[[], bool]) -> None:
        self.recording = PhaseRecording()
        self.compile = StaticCompile(view)
        self.probe = ScheduleProbe(view, self.compile)
        self.embeddings = EmbeddingShards(view, self.recording)
        self.gradients = GradientAveraging(view, self.compile, self.embeddings, self.recording)
        self.sharded = ParameterShards(view, self.gradients, self.compile)
        self.compression = CompressionState(view, self.gradients)
        self.schedule = ScheduleTrial(view, self.gradients)
        self.overlap = OptimizerOverlap(view, self.gradients, self.schedule)
        # (CollectiveTimeout reads the SM groups through a bound method, not a lambda: the spawn launcher pickles this)
        self.ordered: tuple[StepParticipant, ...] = (
            self.probe, self.gradients, self.sharded, self.compile, self.embeddings, SigtermAgreement(view),
            PeerWatch(view, failed=failed), CollectiveTimeout(view, groups=self.schedule.comm_groups),
            self.compression, self.schedule, self.overlap,
            SimulationMark(view), MidEpochResume(view), LastStepSave(view), self.recording,
        )

    # ----------------------------------------------------------------------------- the checkpoint phases' answers

    def model_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """Lightning's model state dict as saved (a collective where weights are gathered: every rank calls it)."""
        for participant in self.ordered:
            state = participant.model_state_dict(state)
        return state

    def model_state_to_load(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's model state dict as this rank's model loads it."""
        for participant in self.ordered:
            state = participant.model_state_to_load(state)
        return state

    def optimizer_state(self, optimizer: Any, lightning_state: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """The optimizer's state as saved: a participant's own form where one holds it, else ``lightning_state``'s
        as the participants would have it saved."""
        for participant in self.ordered:
            own = participant.optimizer_state(optimizer)
            if own is not None:
                return own
        state = lightning_state(optimizer)
        for participant in self.ordered:
            state = participant.optimizer_state_to_save(optimizer, state)
        return state

    def optimizer_to_step(self, optimizer: Any) -> Any:
        """The optimizer the precision plugin steps: ``optimizer`` as the participants wrap it, in their order."""
        for participant in self.ordered:
            optimizer = participant.optimizer_to_step(optimizer)
        return optimizer

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        """Whether a participant loaded the checkpoint's optimizer states in its own form (Lightning's is skipped)."""
        return any(participant.load_optimizer_states(checkpoint) for participant in self.ordered)

    def optimizer_state_to_load(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's optimizer state as this rank's optimizer loads it."""
        for participant in self.ordered:
            state = participant.optimizer_state_to_load(optimizer, state)
        return state

    def write_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> bool:
        """Whether a participant wrote the checkpoint in its own format (Lightning's writing is skipped)."""
        return any(participant.write_checkpoint(checkpoint, path) for participant in self.ordered)

    def state_dict(self) -> dict[str, Any]:
        """The entries every participant adds to a checkpoint (a collective: every rank calls it)."""
        entries: dict[str, Any] = {}
        for participant in self.ordered:
            entries.update(participant.state_dict())
        return entries
