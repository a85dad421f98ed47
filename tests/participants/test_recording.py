"""PhaseRecording: the recorder it is given gets one interval per compute phase, in the step's order, and the
backward interval closes at ``after_backward``, before the waits of ``finish_gradients``."""

from __future__ import annotations

import time

import torch

from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants.recording import PhaseRecording


def _recorder() -> StepRecorder:
    recorder = StepRecorder(torch.device("cpu"))
    recorder.active = True
    recorder.begin_step(step=3, rank=0)
    return recorder


def _one_step(recording: PhaseRecording, wait_s: float = 0.0) -> None:
    recording.on_train_batch_start()
    recording.before_forward()
    recording.after_forward()
    recording.before_backward()
    recording.after_backward()
    time.sleep(wait_s)  # what finish_gradients waits for: not compute
    recording.finish_gradients(accumulating=False)
    recording.before_optimizer_step()
    recording.after_optimizer_step()


def test_each_phase_is_one_interval_in_the_step_s_order() -> None:
    recording = PhaseRecording()
    recorder = _recorder()
    recording.attach_recorder(recorder)
    _one_step(recording)
    timeline = recorder.end_step()
    assert timeline is not None and timeline.step == 3
    assert [phase for phase, _, _ in timeline.compute] == ["forward", "backward", "optimizer"]
    ends = [t for _, start, end in timeline.compute for t in (start, end)]
    assert ends == sorted(ends)  # each begins where the one before it ended, or later


def test_the_wait_after_backward_is_outside_every_compute_interval() -> None:
    recording = PhaseRecording()
    recorder = _recorder()
    recording.attach_recorder(recorder)
    _one_step(recording, wait_s=0.05)
    timeline = recorder.end_step()
    assert timeline is not None
    spans = {phase: (start, end) for phase, start, end in timeline.compute}
    assert spans["optimizer"][0] - spans["backward"][1] >= 0.05
    assert spans["backward"][1] - spans["backward"][0] < 0.05


def test_without_a_recorder_and_after_teardown_nothing_is_recorded() -> None:
    recording = PhaseRecording()
    _one_step(recording)  # no recorder attached: every phase is a no-op
    recorder = _recorder()
    recording.attach_recorder(recorder)
    recording.teardown(failed=False)
    assert recording.recorder is None
    _one_step(recording)
    timeline = recorder.end_step()
    assert timeline is not None and timeline.compute == []
