"""The step participants: each feature's part of the strategy's hooks (:mod:`.base` says what a phase is).

Both front ends call every phase through one typed :class:`~.phases.StepPhases`, which runs it on all of them in
one fixed order (:class:`~.roster.Participants` lists it and says why): a new feature is a new participant in that
list, not an edit of each hook.
"""

from lightning_static_dist.participants.base import StepContext, StepParticipant, StrategyView
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.compression_state import CompressionState
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.participants.roster import Participants
from lightning_static_dist.participants.phases import StepPhases, StepState
from lightning_static_dist.participants.schedule_trial import ScheduleTrial
from lightning_static_dist.participants.runtime import PeerWatch, SigtermAgreement
from lightning_static_dist.participants.parameter_shards import ParameterShards

__all__ = [
    "CompressionState",
    "EmbeddingShards",
    "GradientAveraging",
    "Participants",
    "PeerWatch",
    "PhaseRecording",
    "ParameterShards",
    "SigtermAgreement",
    "StaticCompile",
    "StepContext",
    "StepParticipant",
    "StepPhases",
    "StepState",
    "StrategyView",
    "ScheduleTrial",
]
