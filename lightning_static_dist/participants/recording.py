"""The overlap monitor's view of a step: the recorder is told where compute phases begin and end.

The monitor (:class:`~lightning_static_dist.callbacks.monitor.OverlapMonitor`) attaches a
:class:`~lightning_static_dist.overlap.recorder.StepRecorder`; the synchronisers report their collectives to it
themselves. Backward ends before the wait for the gradient collectives: waiting is not compute.

Example::

    recording = PhaseRecording()
    recording.attach_recorder(StepRecorder(device))
"""

from __future__ import annotations

from typing import Optional

from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants.base import StepParticipant


class PhaseRecording(StepParticipant):
    """Marks the forward, backward and optimizer phases on the attached recorder (none attached: nothing)."""

    def __init__(self) -> None:
        self.recorder: Optional[StepRecorder] = None
        """The overlap monitor's recorder, when one is attached."""

    def attach_recorder(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    def before_forward(self) -> None:
        if self.recorder is not None:
            self.recorder.begin("forward")

    def after_forward(self) -> None:
        if self.recorder is not None:
            self.recorder.end("forward")

    def before_backward(self) -> None:
        if self.recorder is not None:
            self.recorder.begin("backward")

    def after_backward(self) -> None:
        if self.recorder is not None:
            self.recorder.end("backward")  # before the wait: waiting is not compute

    def before_optimizer_step(self) -> None:
        if self.recorder is not None:
            self.recorder.begin("optimizer")

    def after_optimizer_step(self) -> None:
        if self.recorder is not None:
            self.recorder.end("optimizer")

    def teardown(self, failed: bool) -> None:
        self.recorder = None
