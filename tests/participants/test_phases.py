"""StepPhases, driven as the front ends drive it, over a real view and the real participants (one rank): every order
the Trainer and Fabric produce is accepted, and a front end that skips a phase or calls one out of order gets a
``RuntimeError`` naming it; teardown tears every participant down even when one raises, and returns the ranks'
mismatch instead of raising it."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from lightning_static_dist.participants import Participants, StepParticipant, StepPhases, StepState
from lightning_static_dist.participants.phases import run_backward, teardown_all
from lightning_static_dist.agreement.fingerprint import RankMismatchError
from lightning_static_dist.plan.strategy_config import StrategyConfig

from ._view import Context, Regression, View


def _phases(set_up: bool = True, context: Optional[Context] = None) -> tuple[Regression, StepPhases]:
    model = Regression()
    view = View(model, StrategyConfig(), optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
    phases = StepPhases(Participants(view, failed=lambda: False))
    phases.setup_distributed()
    if set_up:
        phases.set_up(view.enter(context or Context()), build_optimizers=lambda: None, prepare=lambda: None)
    return model, phases


def _forward(model: Regression, phases: StepPhases) -> torch.Tensor:
    phases.before_forward()
    loss = model.training_step((torch.randn(4, 8), torch.randn(4, 1)), 0)
    phases.after_forward()
    return loss


def _trainer_backward(model: Regression, phases: StepPhases) -> None:
    loss = _forward(model, phases)
    phases.before_backward()  # Lightning's pre_backward, the backward, post_backward
    loss.backward()
    phases.end_backward()


def test_the_trainer_s_orders_are_accepted() -> None:
    model, phases = _phases()
    phases.before_reading_parameters()  # the sanity check's validation forward
    phases.on_validation_end()
    for _ in range(2):  # accumulate_grad_batches=2: one micro-batch accumulates, the next steps
        phases.on_train_batch_start()
        with phases.no_sync():
            assert phases.accumulating
            _trainer_backward(model, phases)
        assert phases.state is StepState.IDLE and not phases.accumulating
        phases.on_train_batch_start()
        _trainer_backward(model, phases)
        assert phases.state is StepState.GRADIENTS_FINAL
        phases.after_optimizer_step()
        assert phases.state is StepState.IDLE
    phases.on_train_batch_start()
    _forward(model, phases)  # a training_step returning None: no backward, no step
    phases.on_train_batch_start()
    _trainer_backward(model, phases)  # manual optimization: two backward passes, then one step
    _trainer_backward(model, phases)
    phases.after_optimizer_step()
    phases.on_train_batch_start()
    phases.before_backward()  # an exception inside the backward: the next batch starts over
    phases.on_exception(RuntimeError("user code"))
    assert phases.teardown(failed=True) is None
    assert phases.state is StepState.NOT_SET_UP
    phases.set_up(Context(fitting=False), build_optimizers=lambda: None, prepare=lambda: None)  # a test stage after
    phases.before_reading_parameters()
    assert phases.teardown(failed=False) is None


def test_fabric_s_orders_are_accepted() -> None:
    generator, gen_phases = _phases()
    critic, critic_phases = _phases()
    for phases, model in ((gen_phases, generator), (critic_phases, critic)):  # what Fabric's gradient hooks do
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(phases.note_gradient)
    for _ in range(2):  # a GAN loop: the critic's loss of a detached fake does not reach the generator
        gen_phases.on_train_batch_start()
        fake = _forward(generator, gen_phases)
        critic_phases.on_train_batch_start()
        critic_loss = critic(torch.randn(4, 8)).mean() + fake.detach()
        run_backward([gen_phases, critic_phases], critic_loss.backward)
        assert gen_phases.state is StepState.BACKWARD_ENDED and not gen_phases.got_gradients
        critic_phases.after_optimizer_step()
        loss = _forward(generator, gen_phases)
        run_backward([gen_phases], loss.backward)
        gen_phases.after_optimizer_step()
    with torch.no_grad():
        generator(torch.randn(2, 8))  # an evaluation forward: no phase
    with critic_phases.no_sync():  # fabric.no_backward_sync(critic)
        critic_phases.on_train_batch_start()
        run_backward([critic_phases], _forward(critic, critic_phases).backward)
    assert not critic_phases.batch_open  # the next forward starts a batch
    assert teardown_all([gen_phases, critic_phases], failed=False) is None


def test_a_model_set_up_at_its_first_forward_inside_no_sync_still_accumulates() -> None:
    model, phases = _phases(set_up=False)
    with phases.no_sync():  # fabric.no_backward_sync(model) around the first forward, which sets the model up
        phases.set_up(Context(), build_optimizers=lambda: None, prepare=lambda: None)
        phases.on_train_batch_start()
        loss = _forward(model, phases)
        phases.before_backward()
        loss.backward()
        assert phases.accumulating
        phases.end_backward()
    assert phases.state is StepState.IDLE  # accumulated: no optimizer step follows


def test_a_model_never_set_up_runs_its_backward_phases_unchecked() -> None:
    model, phases = _phases(set_up=False)  # Fabric: set up at the first training forward, which never came
    run_backward([phases], model(torch.randn(2, 8)).sum().backward)
    assert phases.state is StepState.NOT_SET_UP


@pytest.mark.parametrize("skip, refused", [("before_backward", "after_backward"),
                                           ("after_backward", "finish_gradients")])
def test_a_front_end_that_skips_a_backward_phase_is_refused(skip: str, refused: str) -> None:
    model, phases = _phases()
    phases.on_train_batch_start()
    loss = _forward(model, phases)
    calls = [call for call in ("before_backward", "after_backward", "finish_gradients") if call != skip]
    with pytest.raises(RuntimeError, match=f"{refused} while the step is"):
        getattr(phases, calls[0])()
        loss.backward()
        for call in calls[1:]:
            getattr(phases, call)()


def test_ending_a_backward_that_never_began_and_finishing_twice_are_refused() -> None:
    model, phases = _phases()
    with pytest.raises(RuntimeError, match="after_backward while the step is set up, no backward in flight"):
        phases.end_backward()
    _trainer_backward(model, phases)
    with pytest.raises(RuntimeError, match="finish_gradients while the step is gradients final"):
        phases.finish_gradients()


@pytest.mark.parametrize("phase", ["on_train_batch_start", "before_forward"])
def test_a_forward_before_setup_is_refused(phase: str) -> None:
    _, phases = _phases(set_up=False)
    with pytest.raises(RuntimeError, match=f"{phase} before the step was set up"):
        getattr(phases, phase)()


class _Teardown(StepParticipant):
    """Tears down (recording it), raising ``error`` if given; its step check raises ``mismatch`` if given."""

    def __init__(self, torn: list[tuple[str, bool]], name: str, error: Optional[BaseException] = None,
                 mismatch: Optional[RankMismatchError] = None) -> None:
        self.torn, self.name, self.error, self.mismatch = torn, name, error, mismatch

    def check_in_step(self) -> None:
        if self.mismatch is not None:
            raise self.mismatch

    def teardown(self, failed: bool) -> None:
        self.torn.append((self.name, failed))
        if self.error is not None:
            raise self.error


def test_teardown_tears_every_participant_down_and_raises_the_first_error() -> None:
    _, phases = _phases()
    torn: list[tuple[str, bool]] = []
    first, second = ValueError("first"), KeyError("second")
    phases.participants.ordered = (_Teardown(torn, "a", first), *phases.participants.ordered,
                                   _Teardown(torn, "b", second), _Teardown(torn, "c"))
    with pytest.raises(ValueError, match="first"):
        phases.teardown(failed=False)
    assert torn == [("a", False), ("b", False), ("c", False)]
    assert phases.state is StepState.NOT_SET_UP


def test_teardown_returns_the_mismatch_and_tears_down_without_collectives() -> None:
    _, phases = _phases()
    _, other = _phases()
    torn: list[tuple[str, bool]] = []
    mismatch = RankMismatchError("rank 1 is a step behind")
    phases.participants.ordered = (*phases.participants.ordered, _Teardown(torn, "a"))
    other.participants.ordered = (*other.participants.ordered, _Teardown(torn, "b", mismatch=mismatch))
    marked = []
    assert teardown_all([phases, other], failed=False, on_mismatch=lambda: marked.append(list(torn))) is mismatch
    assert marked == [[]]  # the front end hears of the mismatch before any participant tears down
    assert torn == [("b", True), ("a", True)]  # the last set up first; the first too without collectives
    torn.clear()
    assert teardown_all([phases, other], failed=True) is None  # failed: no step check
    assert torn == [("b", True), ("a", True)]


class _Reads(StepParticipant):
    """Records when the parameters are made readable, and folds a marker into the saved state."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def before_reading_parameters(self) -> None:
        self.events.append("parameters readable")

    def model_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        self.events.append("folded")
        return {**state, "marker": 1}


def test_the_state_dict_is_read_only_once_the_parameters_may_be_read() -> None:
    # a module whose state_dict copies (a hook that casts, .cpu()) must not copy a shard whose gather is in flight
    model, phases = _phases()
    events: list[str] = []
    phases.participants.ordered = (_Reads(events), *phases.participants.ordered)

    def read() -> dict[str, Any]:
        events.append("state_dict")
        return model.state_dict()

    state = phases.model_state_dict(read)
    assert events == ["parameters readable", "state_dict", "folded"]
    assert state["marker"] == 1 and set(model.state_dict()) < set(state)
