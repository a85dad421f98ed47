"""SyncSchedule (``sync.schedule: auto``) on 2 real Gloo ranks: over the trial's steps each batch start switches the
synchroniser between ``overlap`` and ``after_backward``, then both ranks keep the schedule that was faster on the
slowest rank; the choice is in the checkpoint, and loaded before setup (as Lightning loads) it schedules from the
first step with no second trial; teardown drops the trial. Without ``auto`` (or with nothing to synchronise) there is
no trial."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.gradients import SCHEDULE_KEY, GradientSynchronization, SyncSchedule
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.strategy_config import StrategyConfig

from ._view import Context, Regression, View

TRIAL_STEPS = 2  # per schedule, the first untimed: overlap on steps 0-1, after_backward on 2-3, the choice at 4
STEPS = 6
SLOW_S = 0.3  # what rank 1 adds to the timed step of the schedule a test makes slow


def _participants(schedule: str) -> tuple[Regression, View, GradientSynchronization, SyncSchedule]:
    """A model, the real gradient participant (compile and embeddings off) and SyncSchedule on it, not set up."""
    model = Regression()
    view = View(model, StrategyConfig.from_dict({"sync": {"schedule": schedule,
                                                          "schedule_trial_steps": TRIAL_STEPS}}))
    view.optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    recording = PhaseRecording()
    gradients = GradientSynchronization(view, StaticCompile(view), EmbeddingShards(view, recording), recording)
    return model, view, gradients, SyncSchedule(view, gradients)


def _set_up(view: View, gradients: GradientSynchronization, schedule: SyncSchedule) -> Context:
    context = view.enter(Context())
    gradients.setup(context)
    gradients.after_setup(context)
    schedule.after_setup(context)
    return context


def _fit(rank: int, model: Regression, view: View, gradients: GradientSynchronization, schedule: SyncSchedule,
         context: Context, slow: str = "") -> list[bool]:
    """``STEPS`` real training steps; each batch start's ``launch_during_backward``. Rank 1 is slower on the timed
    step of the schedule ``slow`` names (after its collectives: rank 0 does not wait for it there)."""
    (optimizer,) = view.optimizers
    launched = []
    for step in range(STEPS):
        context.step = step
        schedule.on_train_batch_start()
        launch = gradients.synchronizer.launch_during_backward
        launched.append(launch)
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data
        model.training_step((torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)), step).backward()
        gradients.finish_gradients(accumulating=False)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 1 and step % TRIAL_STEPS == 1 and launch == (slow == "overlap") and step < 2 * TRIAL_STEPS:
            time.sleep(SLOW_S)
        schedule.after_optimizer_step()
    return launched


def _trial(rank: int, slow: str) -> dict[str, Any]:
    model, view, gradients, schedule = _participants("auto")
    context = _set_up(view, gradients, schedule)
    launched = _fit(rank, model, view, gradients, schedule, context, slow=slow)
    seen = {"launched": launched, "state": schedule.state_dict()}
    schedule.teardown(failed=False)
    gradients.teardown(failed=False)
    seen.update(trial_after_teardown=schedule.trial, state_after_teardown=schedule.state_dict())
    return seen


def _resumed(rank: int, saved: dict[str, Any], before_setup: bool) -> dict[str, Any]:
    model, view, gradients, schedule = _participants("auto")
    checkpoint = {SCHEDULE_KEY: dict(saved), "other": 1}
    if before_setup:  # Lightning loads a checkpoint before the strategy's setup
        schedule.load_state_dict(checkpoint)
    context = _set_up(view, gradients, schedule)
    if not before_setup:
        schedule.load_state_dict(checkpoint)
    launched = _fit(rank, model, view, gradients, schedule, context)
    seen = {"launched": launched, "left": checkpoint, "state": schedule.state_dict()}
    schedule.teardown(failed=False)
    gradients.teardown(failed=False)
    return seen


def _not_auto(rank: int) -> dict[str, Any]:
    model, view, gradients, schedule = _participants("after_backward")
    context = _set_up(view, gradients, schedule)
    launched = _fit(rank, model, view, gradients, schedule, context)
    seen = {"mode": gradients.mode, "trial": schedule.trial, "launched": launched, "state": schedule.state_dict()}
    gradients.teardown(failed=False)
    return seen


SAVED = {"choice": "after_backward", "step_s": {"overlap": 0.2, "after_backward": 0.1}}


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    seen = {f"slow_{slow}": _trial(rank, slow) for slow in ("after_backward", "overlap")}
    seen["resumed_first"] = _resumed(rank, SAVED, before_setup=True)
    seen["resumed_late"] = _resumed(rank, SAVED, before_setup=False)
    seen["not_auto"] = _not_auto(rank)
    dist.barrier()
    return seen


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_on_two_ranks, world_size=2, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("slow", "kept"), [("after_backward", "overlap"), ("overlap", "after_backward")])
def test_the_trial_switches_between_the_schedules_then_every_rank_keeps_the_same_one(
        ranks: list[dict[str, Any]], slow: str, kept: str) -> None:
    trials = [r[f"slow_{slow}"] for r in ranks]
    for trial in trials:
        # overlap's two steps, after_backward's two, then the choice at step 4 and kept after it
        assert trial["launched"] == [True, True, False, False] + [kept == "overlap"] * 2
        saved = trial["state"][SCHEDULE_KEY]
        assert saved["choice"] == kept
        assert set(saved["step_s"]) == {"overlap", "after_backward"}
        assert saved["step_s"][slow] >= SLOW_S  # rank 1's time: the slowest rank's, on rank 0 too
    assert trials[0]["state"] == trials[1]["state"]  # the same times and choice on every rank


@pytest.mark.multiprocess
def test_teardown_drops_the_trial(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for slow in ("after_backward", "overlap"):
            assert r[f"slow_{slow}"]["trial_after_teardown"] is None
            assert r[f"slow_{slow}"]["state_after_teardown"] == {}


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["resumed_first", "resumed_late"])
def test_a_saved_choice_schedules_from_the_first_step_without_a_second_trial(
        ranks: list[dict[str, Any]], when: str) -> None:
    for r in ranks:
        resumed = r[when]
        assert resumed["launched"] == [False] * STEPS  # after_backward from step 0; nothing switched
        assert resumed["state"] == {SCHEDULE_KEY: SAVED}  # the saved times kept: nothing timed again
        assert resumed["left"] == {"other": 1}  # the entry is taken: Lightning does not see it


@pytest.mark.multiprocess
def test_a_schedule_that_is_not_auto_builds_no_trial(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        not_auto = r["not_auto"]
        assert not_auto["mode"] == "hooks" and not_auto["trial"] is None
        assert not_auto["launched"] == [False] * STEPS
        assert not_auto["state"] == {}


def test_auto_with_nothing_to_synchronise_builds_no_trial(one_rank_gloo: None) -> None:
    _, view, gradients, schedule = _participants("auto")
    _set_up(view, gradients, schedule)
    assert gradients.mode is None and schedule.trial is None
    schedule.on_train_batch_start()  # no synchroniser, no trial: nothing to switch
    assert schedule.state_dict() == {}
