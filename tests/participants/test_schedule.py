"""ScheduleTrial (``sync.schedule: auto``) on 2 real Gloo ranks, each its own data: over the trial's steps each batch
start switches the synchroniser between the candidates (``overlap/fp32/sms=default`` and ``after_backward/fp32``; with
``reduce_dtype: auto`` each in bf16 too), then both ranks keep the candidate that was fastest on the slowest rank; the
choice is in the checkpoint, and loaded before setup (as Lightning loads) it applies its schedule and dtype from the
first step with no second trial (a checkpoint naming a bare schedule, from before the candidates had dtypes, too);
teardown drops the trial. Without ``auto`` (or with nothing to synchronise) there is no trial."""

from __future__ import annotations

import time
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.participants.schedule_trial import SCHEDULE_KEY, ScheduleTrial

from ._view import Context, Regression, View, gradient_participant

TRIAL_STEPS = 2  # per schedule, the first untimed: overlap on steps 0-1, after_backward on 2-3, the choice at 4
STEPS = 6
SLOW_S = 0.3  # what rank 1 adds to the timed step of the schedule a test makes slow


OVERLAP, AFTER = "overlap/fp32/sms=default", "after_backward/fp32"


def _participants(schedule: str, reduce_dtype: str = "fp32"
                  ) -> tuple[Regression, View, GradientAveraging, ScheduleTrial]:
    """A model, the real gradient participant (compile and embeddings off) and ScheduleTrial on it, not set up."""
    model, view, gradients = gradient_participant({"sync": {"schedule": schedule, "reduce_dtype": reduce_dtype,
                                                            "schedule_trial_steps": TRIAL_STEPS}})
    return model, view, gradients, ScheduleTrial(view, gradients)


def _set_up(view: View, gradients: GradientAveraging, schedule: ScheduleTrial) -> Context:
    context = view.enter(Context())
    gradients.setup(context)
    gradients.after_setup(context)
    schedule.after_setup(context)
    return context


def _fit(rank: int, model: Regression, view: View, gradients: GradientAveraging, schedule: ScheduleTrial,
         context: Context, slow: str = "", steps: int = STEPS, dtypes: Optional[list] = None) -> list[bool]:
    """``steps`` real training steps; each batch start's ``launch_during_backward`` (and into ``dtypes``, the dtype
    each round's buckets travel in). Rank 1 is slower on the timed step of the schedule ``slow`` names (after its
    collectives: rank 0 does not wait for it there)."""
    (optimizer,) = view.optimizers
    launched = []
    for step in range(steps):
        context.step = step
        schedule.on_train_batch_start()
        launch = gradients.synchronizer.schedule.launch_during_backward
        launched.append(launch)
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data
        model.training_step((torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)), step).backward()
        gradients.finish_gradients(accumulating=False)
        if dtypes is not None:  # (the first round reduces in a one-off bucket: its buffers are not kept)
            dtypes.append([str((b.wire if b.wire is not None else b.flat).dtype) for b in gradients.synchronizer.buffers])
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


SAVED = {"choice": AFTER, "step_s": {OVERLAP: 0.2, AFTER: 0.1}, "trial_steps": 4, "trial_s": 0.5}
LEGACY = {"choice": "after_backward", "step_s": {"overlap": 0.2, "after_backward": 0.1}}  # (a bare schedule's name)
DTYPE_STEPS = 4 * TRIAL_STEPS + 2  # 4 candidates, then 2 steps of the choice


def _dtype_trial(rank: int) -> dict[str, Any]:
    """``reduce_dtype: auto``: every candidate in turn, each its schedule and dtype."""
    model, view, gradients, schedule = _participants("auto", "auto")
    context = _set_up(view, gradients, schedule)
    dtypes: list = []
    launched = _fit(rank, model, view, gradients, schedule, context, steps=DTYPE_STEPS, dtypes=dtypes)
    seen = {"candidates": [c.name for c in schedule.candidates], "launched": launched, "dtypes": dtypes,
            "state": schedule.state_dict(), "trial_s": schedule.trial_s, "trial_steps": schedule.trial_steps}
    schedule.teardown(failed=False)
    gradients.teardown(failed=False)
    return seen


def _dtype_resumed(rank: int, choice: str) -> dict[str, Any]:
    model, view, gradients, schedule = _participants("auto", "auto")
    schedule.load_state_dict({SCHEDULE_KEY: {"choice": choice, "step_s": {}}})
    context = _set_up(view, gradients, schedule)
    dtypes: list = []
    launched = _fit(rank, model, view, gradients, schedule, context, steps=3, dtypes=dtypes)
    seen = {"launched": launched, "dtypes": dtypes, "choice": schedule.trial.choice}
    schedule.teardown(failed=False)
    gradients.teardown(failed=False)
    return seen


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    seen = {f"slow_{slow}": _trial(rank, slow) for slow in ("after_backward", "overlap")}
    seen["resumed_first"] = _resumed(rank, SAVED, before_setup=True)
    seen["resumed_late"] = _resumed(rank, SAVED, before_setup=False)
    seen["resumed_legacy"] = _resumed(rank, LEGACY, before_setup=True)
    seen["dtype_trial"] = _dtype_trial(rank)
    seen["dtype_resumed"] = _dtype_resumed(rank, "overlap/bf16/sms=default")
    seen["not_auto"] = _not_auto(rank)
    dist.barrier()
    return seen


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_on_two_ranks, world_size=2, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("slow", "kept"), [("after_backward", OVERLAP), ("overlap", AFTER)])
def test_the_trial_switches_between_the_schedules_then_every_rank_keeps_the_same_one(
        ranks: list[dict[str, Any]], slow: str, kept: str) -> None:
    trials = [r[f"slow_{slow}"] for r in ranks]
    for trial in trials:
        # overlap's two steps, after_backward's two, then the choice at step 4 and kept after it
        assert trial["launched"] == [True, True, False, False] + [kept == OVERLAP] * 2
        saved = trial["state"][SCHEDULE_KEY]
        assert saved["choice"] == kept
        assert set(saved["step_s"]) == {OVERLAP, AFTER}
        assert saved["step_s"][OVERLAP if slow == "overlap" else AFTER] >= SLOW_S  # rank 1's: the slowest rank's
        assert saved["trial_steps"] == 2 * TRIAL_STEPS and saved["trial_s"] > 0  # what the trial cost
    assert trials[0]["state"] == trials[1]["state"]  # the same times and choice on every rank


@pytest.mark.multiprocess
def test_teardown_drops_the_trial(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for slow in ("after_backward", "overlap"):
            assert r[f"slow_{slow}"]["trial_after_teardown"] is None
            assert r[f"slow_{slow}"]["state_after_teardown"] == {}


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["resumed_first", "resumed_late", "resumed_legacy"])
def test_a_saved_choice_schedules_from_the_first_step_without_a_second_trial(
        ranks: list[dict[str, Any]], when: str) -> None:
    for r in ranks:
        resumed = r[when]
        assert resumed["launched"] == [False] * STEPS  # after_backward from step 0; nothing switched
        saved = SAVED if when != "resumed_legacy" else {**LEGACY, "choice": AFTER}  # (the bare name: fp32's)
        assert resumed["state"] == {SCHEDULE_KEY: saved}  # the saved times kept: nothing timed again
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


@pytest.mark.multiprocess
def test_with_reduce_dtype_auto_the_trial_times_each_schedule_in_fp32_and_bf16_and_every_rank_keeps_one(
        ranks: list[dict[str, Any]]) -> None:
    trials = [r["dtype_trial"] for r in ranks]
    names = ["overlap/fp32/sms=default", "overlap/bf16/sms=default", "after_backward/fp32", "after_backward/bf16"]
    for trial in trials:
        assert trial["candidates"] == names  # Gloo: no SMs to switch
        saved = trial["state"][SCHEDULE_KEY]
        choice = saved["choice"]
        assert choice in names and set(saved["step_s"]) == set(names)
        assert trial["trial_steps"] == 4 * TRIAL_STEPS and trial["trial_s"] > 0
        chosen_dtype = "torch.bfloat16" if "bf16" in choice else "torch.float32"
        per_candidate = [name for name in names for _ in range(TRIAL_STEPS)] + [choice] * 2
        assert trial["launched"] == [name.startswith("overlap") for name in per_candidate]
        for step, (name, dtypes) in enumerate(zip(per_candidate, trial["dtypes"])):
            if step > 0:  # each round's buckets travel in its candidate's dtype
                assert set(dtypes) == {"torch.bfloat16" if "bf16" in name else "torch.float32"}, (step, name)
        assert set(trial["dtypes"][-1]) == {chosen_dtype}
    assert trials[0]["state"] == trials[1]["state"]  # one decision: the same times and choice on every rank


@pytest.mark.multiprocess
def test_a_saved_bf16_choice_reduces_in_bf16_from_the_first_step_without_a_trial(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        resumed = r["dtype_resumed"]
        assert resumed["choice"] == "overlap/bf16/sms=default"
        assert resumed["launched"] == [True] * 3
        assert all(set(d) == {"torch.bfloat16"} for d in resumed["dtypes"][1:])
