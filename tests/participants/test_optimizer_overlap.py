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
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.gradients import GradientSynchronization
from lightning_static_dist.participants.optimizer_overlap import OptimizerOverlap
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.strategy_config import StrategyConfig
from lightning_static_dist.sync.optimizer_overlap import BucketwiseOptimizer

from ._view import Context, Regression, View

CLIPPING = "gradient clipping (trainer.gradient_clip_val=1.0) needs every bucket's average first"


def _decide(setting: Union[bool, str], schedule: str = "after_backward", readers: Optional[tuple[str, ...]] = (),
            optimizer: str = "adamw") -> dict[str, Any]:
    """Set up the real gradient participant and OptimizerOverlap on it; what they chose, or the error."""
    model = Regression()
    view = View(model, StrategyConfig.from_dict({"sync": {"schedule": schedule, "optimizer_overlap": setting}}))
    make = torch.optim.LBFGS if optimizer == "lbfgs" else torch.optim.AdamW
    view.optimizers = [make(model.parameters(), lr=0.1)]
    recording = PhaseRecording()
    gradients = GradientSynchronization(view, StaticCompile(view), EmbeddingShards(view, recording), recording)
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
    seen = {"choice": overlap.choice.describe(), "defer": sync.defer_waits,
            "wrapped": type(overlap.optimizer_to_step(view.optimizers[0])).__name__}
    overlap.teardown(failed=False)
    gradients.teardown(failed=False)
    seen["defer_after_teardown"] = sync.defer_waits
    return seen


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    return {
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


def test_nothing_to_average_decides_nothing(one_rank_gloo: None) -> None:
    model = Regression()
    view = View(model, StrategyConfig.from_dict({"sync": {"schedule": "after_backward", "optimizer_overlap": True}}))
    recording = PhaseRecording()
    gradients = GradientSynchronization(view, StaticCompile(view), EmbeddingShards(view, recording), recording)
    overlap = OptimizerOverlap(view, gradients)
    context = view.enter(Context())
    gradients.setup(context)
    overlap.after_setup(context)
    assert overlap.choice is None and overlap.optimizer_to_step("the optimizer") == "the optimizer"
