"""PhaseRecording, driven through the phases both front ends call (:class:`StepPhases` over the real roster): the
recorder it is given gets one interval per compute phase, in the step's order, and the backward interval closes at
``after_backward``, before the waits of every participant's ``finish_gradients``. A phase object that ran the phases
in another order would fail here."""

from __future__ import annotations

import time

import torch

from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants import Participants, StepParticipant, StepPhases
from lightning_static_dist.plan.strategy_config import StrategyConfig

from ._view import Context, Regression, View


class _Wait(StepParticipant):
    """Waits ``wait_s`` where a synchroniser waits for its collectives: in ``finish_gradients``."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s

    def finish_gradients(self, accumulating: bool) -> None:
        time.sleep(self.wait_s)


def _recorder() -> StepRecorder:
    recorder = StepRecorder(torch.device("cpu"))
    recorder.active = True
    recorder.begin_step(step=3, rank=0)
    return recorder


def _phases(wait_s: float = 0.0) -> tuple[Regression, StepPhases]:
    model = Regression()
    view = View(model, StrategyConfig(), optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
    parts = Participants(view, failed=lambda: False)
    parts.ordered = (_Wait(wait_s), *parts.ordered)  # waiting first: only the phase order keeps it out of backward
    phases = StepPhases(parts)
    phases.set_up(view.enter(Context()), build_optimizers=lambda: None, prepare=lambda: None)
    return model, phases


def _one_step(model: Regression, phases: StepPhases) -> None:
    phases.on_train_batch_start()
    phases.before_forward()
    loss = model.training_step((torch.randn(4, 8), torch.randn(4, 1)), 0)
    phases.after_forward()
    phases.before_backward()
    loss.backward()
    phases.end_backward()  # what the Trainer's post_backward calls (Fabric's run_backward: the same two phases)
    phases.after_optimizer_step()


def test_each_phase_is_one_interval_in_the_step_s_order() -> None:
    model, phases = _phases()
    recorder = _recorder()
    phases.attach_recorder(recorder)
    _one_step(model, phases)
    timeline = recorder.end_step()
    assert timeline is not None and timeline.step == 3
    assert [phase for phase, _, _ in timeline.compute] == ["forward", "backward", "optimizer"]
    ends = [t for _, start, end in timeline.compute for t in (start, end)]
    assert ends == sorted(ends)  # each begins where the one before it ended, or later


def test_the_wait_after_backward_is_outside_every_compute_interval() -> None:
    model, phases = _phases(wait_s=0.05)
    recorder = _recorder()
    phases.attach_recorder(recorder)
    _one_step(model, phases)
    timeline = recorder.end_step()
    assert timeline is not None
    spans = {phase: (start, end) for phase, start, end in timeline.compute}
    assert spans["optimizer"][0] - spans["backward"][1] >= 0.05
    assert spans["backward"][1] - spans["backward"][0] < 0.05


def test_without_a_recorder_and_after_teardown_nothing_is_recorded() -> None:
    model, phases = _phases()
    _one_step(model, phases)  # no recorder attached: every phase is a no-op
    recorder = _recorder()
    phases.attach_recorder(recorder)
    assert phases.teardown(failed=False) is None
    assert phases.participants.recording.recorder is None
    phases.set_up(Context(), build_optimizers=lambda: None, prepare=lambda: None)
    _one_step(model, phases)
    timeline = recorder.end_step()
    assert timeline is not None and timeline.compute == []
