"""OptimizerOverlap (``sync.optimizer_overlap``) on 2 real Gloo ranks: decided at setup from the config, the front end's
gradient readers, the optimizer and the precision plugin; on, it leaves the synchroniser's after-backward waits to
the optimizer step it wraps; off, it names the first reason; ``true`` with a reason found at setup is one line; teardown
stops the deferral. Without anything to average (one rank) there is nothing to decide."""

from __future__ import annotations

from typing import Any, Optional, Union

import pytest
import torch
from _dist import run_ranks

from lightning_static_dist.config import ConfigError
from lightning_static_dist.participants.schedule_trial import ScheduleTrial
from lightning_static_dist.participants.optimizer_overlap import OptimizerOverlap
from lightning_static_dist.sync.optimizer_overlap import BucketwiseOptimizer

from ._view import Context, gradient_participant

CLIPPING = "gradient clipping (trainer.gradient_clip_val=1.0) needs every bucket's average first"


def _decide(setting: Union[bool, str], schedule: str = "after_backward", readers: Optional[tuple[str, ...]] = (),
            optimizer: str = "adamw") -> dict[str, Any]:
    """Set up the real gradient participant and OptimizerOverlap on it; what they chose, or the error."""
    _, view, gradients = gradient_participant({"sync": {"schedule": schedule, "optimizer_overlap": setting}},
                                              torch.optim.LBFGS if optimizer == "lbfgs" else torch.optim.AdamW)
    overlap = OptimizerOverlap(view, gradients)
    context = view.enter(Context(gradient_readers=readers))
    gradients.setup(context)
    gradients.after_setup(context)
    try:
        overlap.after_setup(context)
    except ConfigError as err:
        gradients.teardown(failed=False)
        return {"error": str(err)}
    sync = gradients.synchronizer
    seen = {"choice": overlap.choice.describe(), "defer": sync.schedule.defer_waits,
            "wrapped": type(overlap.optimizer_to_step(view.optimizers[0])).__name__}
    overlap.teardown(failed=False)
    gradients.teardown(failed=False)
    seen["defer_after_teardown"] = sync.schedule.defer_waits
    return seen


def _settled_by(rank: int) -> dict[str, tuple[bool, bool]]:
    """For each phase that comes before a backward or a read of the parameters: whether a deferred round was pending
    before it, and still after it (a front end that ran a backward and did not step)."""
    model, view, gradients = gradient_participant({"sync": {"schedule": "after_backward"}}, torch.optim.AdamW)
    overlap = OptimizerOverlap(view, gradients)
    context = view.enter(Context())
    gradients.setup(context)
    gradients.after_setup(context)
    overlap.after_setup(context)
    sync = gradients.synchronizer
    seen = {}
    for step, (name, phase) in enumerate((("first round", lambda: None),
                                          ("on_train_batch_start", overlap.on_train_batch_start),
                                          ("before_forward", overlap.before_forward),
                                          ("before_reading_parameters", overlap.before_reading_parameters))):
        g = torch.Generator().manual_seed(10 * step + rank)
        model.training_step((torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)), step).backward()
        gradients.finish_gradients(accumulating=False)
        before = sync.unsettled
        phase()
        seen[name] = (before, sync.unsettled)
        sync.settle()
        view.optimizers[0].zero_grad()
    overlap.teardown(failed=False)
    gradients.teardown(failed=False)
    return seen


def _under_schedule_auto() -> dict[str, Optional[str]]:
    """What OptimizerOverlap announces under sync.schedule auto: before its trial decides, and once it chose each
    kind of candidate."""
    model, view, gradients = gradient_participant({"sync": {"schedule": "auto", "schedule_trial_steps": 2}},
                                                  torch.optim.AdamW)
    schedule = ScheduleTrial(view, gradients)
    overlap = OptimizerOverlap(view, gradients, schedule)
    context = view.enter(Context())
    gradients.setup(context)
    seen: dict[str, Optional[str]] = {}
    for chosen in ("after_backward/fp32", "overlap/fp32/sms=default"):
        for participant in (gradients, schedule, overlap):
            participant.after_setup(context)
        seen["trial"] = overlap.announced
        schedule.trial.load_state_dict({"choice": chosen})  # (as the trial decides at a batch start)
        overlap.on_train_batch_start()
        seen[chosen] = overlap.announced
        schedule.teardown(failed=False)
        overlap.teardown(failed=False)
    gradients.teardown(failed=False)
    return seen


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "settled_by": _settled_by(rank),
        "under_schedule_auto": _under_schedule_auto(),
        "auto": _decide("auto"),
        "auto_under_schedule_auto": _decide("auto", schedule="auto"),
        "auto_clipped": _decide("auto", readers=(CLIPPING,)),
        "auto_fabric": _decide("auto", readers=None),  # (as Fabric's context: it cannot tell)
        "auto_lbfgs": _decide("auto", optimizer="lbfgs"),
        "true_clipped": _decide(True, readers=(CLIPPING,)),
        "false": _decide(False),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_on_two_ranks, world_size=2, timeout=120)


@pytest.mark.multiprocess
def test_auto_with_nothing_in_the_way_defers_the_waits_and_wraps_the_optimizer(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for key in ("auto", "auto_under_schedule_auto"):
            assert r[key] == {"choice": "optimizer overlap: on (auto: nothing reads the gradients between backward and"
                                        " the step)", "defer": True, "wrapped": "BucketwiseOptimizer",
                              "defer_after_teardown": False}
        assert BucketwiseOptimizer.__name__ == r["auto"]["wrapped"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("key", "why"), [
    ("auto_clipped", CLIPPING),
    ("auto_lbfgs", "LBFGS is not one of torch.optim's per-parameter optimizers"),
    ("auto_fabric", "the front end's own loop may read the gradients between backward and the step (Fabric)"),
    ("false", "strategy.sync.optimizer_overlap=false"),
])
def test_off_names_its_reason_and_leaves_the_step_alone(ranks: list[dict[str, Any]], key: str, why: str) -> None:
    for r in ranks:
        assert r[key]["choice"].startswith(f"optimizer overlap: off ({why}")
        assert (r[key]["defer"], r[key]["wrapped"]) == (False, "AdamW" if key != "auto_lbfgs" else "LBFGS")


@pytest.mark.multiprocess
def test_true_with_a_reason_found_at_setup_is_one_line(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["true_clipped"] == {"error": f"strategy.sync.optimizer_overlap=True: {CLIPPING}; allowed with it:"
                                              " auto (off here), false"}


@pytest.mark.multiprocess
def test_a_round_left_pending_is_settled_before_the_next_batch_its_forward_and_any_read_of_the_parameters(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["settled_by"] == {
            "first round": (False, False),  # (it adopts the parameters into the plan: settled in finish)
            "on_train_batch_start": (True, False),
            "before_forward": (True, False),
            "before_reading_parameters": (True, False),
        }


@pytest.mark.multiprocess
def test_under_schedule_auto_the_announced_state_is_conditional_until_the_trial_chooses(
        ranks: list[dict[str, Any]]) -> None:
    why = "auto: nothing reads the gradients between backward and the step"
    for r in ranks:
        assert r["under_schedule_auto"] == {
            "trial": f"optimizer overlap: on for sync.schedule auto's after_backward candidates ({why})",
            "after_backward/fp32": f"optimizer overlap: on ({why})",
            "overlap/fp32/sms=default": "optimizer overlap: off (sync.schedule auto chose overlap/fp32/sms=default:"
                                        " every bucket is waited for as backward ends)",
        }


def test_nothing_to_average_decides_nothing(one_rank_gloo: None) -> None:
    _, view, gradients = gradient_participant({"sync": {"schedule": "after_backward", "optimizer_overlap": True}},
                                              optimizer=None)
    overlap = OptimizerOverlap(view, gradients)
    context = view.enter(Context())
    gradients.setup(context)
    overlap.after_setup(context)
    assert overlap.choice is None and overlap.optimizer_to_step("the optimizer") == "the optimizer"
