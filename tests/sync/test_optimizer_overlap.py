"""``sync.optimizer_overlap`` below Lightning: the synchroniser's deferred waits and the step per bucket on 2 real
Gloo ranks (each rank its own data), against DDP and against the same synchroniser waiting for every bucket; the
decision and the one-line errors, without processes."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from _dist import run_ranks
from lightning_static_dist import StaticDistStrategy
from lightning_static_dist.config import ConfigError
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer
from lightning_static_dist.sync.round_state import RoundSchedule
from lightning_static_dist.sync.optimizer_overlap import (
    PER_PARAMETER,
    BucketwiseOptimizer,
    choose_optimizer_overlap,
    step_hazards,
    step_per_bucket,
)

STEPS = 4


class Tower(nn.Module):
    """Four linear layers (several buckets at a few KiB each) and a layer no rank ever calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32),
                                    nn.GELU(), nn.Linear(32, 1))
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _synchronizer(model: nn.Module, defer: bool) -> GradientSynchronizer:
    sync = GradientSynchronizer(model.named_parameters(), capacity=BucketCapacity.from_mib(0.004, 0.004))
    sync.follow(RoundSchedule(launch_during_backward=False, defer_waits=defer))  # (sync.schedule: after_backward)
    sync.attach()
    return sync


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
    return nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 1, generator=g))


def _three_ways(rank: int, world: int) -> dict[str, Any]:
    """The same AdamW training with DDP, with the synchroniser waiting for every bucket, and stepping per bucket;
    what each sub-step of the last saw; and which uses of the gradients settle a pending round first."""
    base = Tower()
    models = {name: copy.deepcopy(base) for name in ("ddp", "wait_all", "per_bucket")}
    ddp = DistributedDataParallel(models["ddp"], find_unused_parameters=True)
    syncs = {"wait_all": _synchronizer(models["wait_all"], defer=False),
             "per_bucket": _synchronizer(models["per_bucket"], defer=True)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for name, m in models.items()}
    sync = syncs["per_bucket"]
    seen: list[tuple[int, int, bool]] = []  # each sub-step: (parameters it stepped, buckets settled, round pending)
    per_bucket, step_whole = optimizers["per_bucket"], optimizers["per_bucket"].step

    def step_and_see(*args: Any, **kwargs: Any) -> Any:  # (not a step hook: one would turn the overlap off)
        seen.append((sum(len(g["params"]) for g in per_bucket.param_groups), sync.settled_buckets, sync.unsettled))
        return step_whole(*args, **kwargs)

    per_bucket.step = step_and_see
    pending_after_backward = []
    for step in range(STEPS):
        _loss(ddp, rank, step).backward()
        for name in syncs:
            _loss(models[name], rank, step).backward()
            syncs[name].finish_if_pending()
        pending_after_backward.append((syncs["wait_all"].unsettled, sync.unsettled))
        for name, optimizer in optimizers.items():
            if name == "per_bucket":
                BucketwiseOptimizer(optimizer, sync).step()
            else:
                optimizer.step()
            optimizer.zero_grad()
    # every way of reading the gradients next completes a pending round first: (pending before, rounds completed)
    def in_no_sync() -> None:
        with sync.no_sync():
            pass

    def switch_between_rounds() -> None:
        sync.group = sync.group  # (as sync.schedule auto's trial switches a candidate's group)

    settled_by, next_backward = {}, None
    for name, use in (("no_sync", in_no_sync), ("check_pending_rounds", sync.check_pending_rounds),
                      ("a switch between rounds", switch_between_rounds), ("detach", sync.detach)):
        _loss(models["per_bucket"], rank, 10).backward()
        sync.finish_if_pending()  # (finished by the engine: the round stays pending)
        before, rounds = sync.unsettled, sync.stats.rounds
        use()
        settled_by[name] = (before, sync.stats.rounds - rounds)
        sync.settle()  # (the next backward's own round)
        optimizers["per_bucket"].zero_grad()
    # a backward with the round still pending is too late to settle (its first gradient is in .grad): one error
    sync.attach()
    _loss(models["per_bucket"], rank, 10).backward()
    sync.finish_if_pending()
    optimizers["per_bucket"].zero_grad()  # (what Lightning's closure does before the next backward)
    try:
        _loss(models["per_bucket"], rank, 9).backward()
    except RuntimeError as err:
        next_backward = (str(err), sync.unsettled)
    sync.settle()
    return {
        "weights": {name: {n: p.detach().clone() for n, p in m.named_parameters()} for name, m in models.items()},
        "buckets": len(sync.plan.buckets),
        "planned": len(sync.plan.param_indices),
        "seen": seen,
        "pending_after_backward": pending_after_backward,
        "settled_by": settled_by,
        "next_backward": next_backward,
        "rounds": sync.stats.rounds,
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_three_ways, 2, timeout=120)


@pytest.mark.multiprocess
def test_stepping_per_bucket_ends_with_the_weights_ddp_and_wait_all_give(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for name in ("wait_all", "per_bucket"):
            for key, value in r["weights"]["ddp"].items():
                torch.testing.assert_close(r["weights"][name][key], value, atol=1e-6, rtol=1e-6,
                                           msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
        assert torch.equal(r["weights"]["per_bucket"]["unused.weight"], r["weights"]["ddp"]["unused.weight"])


@pytest.mark.multiprocess
def test_each_bucket_steps_once_its_own_average_has_landed_while_later_ones_are_pending(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        buckets = r["buckets"]
        assert buckets >= 3 and r["planned"] == 8  # the unused layer is in no bucket
        # round 1 adopts every parameter into the plan (settled in finish: one plain step); then per bucket
        assert r["pending_after_backward"] == [(False, False)] + [(False, True)] * (STEPS - 1)
        assert r["seen"][0] == (10, 0, False)
        per_step = r["seen"][1:]
        assert len(per_step) == buckets * (STEPS - 1)
        for step in range(STEPS - 1):
            subs = per_step[step * buckets:(step + 1) * buckets]
            assert [settled for _, settled, _ in subs] == list(range(1, buckets + 1))
            assert all(pending for _, _, pending in subs)  # the round is still open while each bucket steps
            assert sum(n for n, _, _ in subs) == 8  # every planned parameter stepped once, in its bucket's step


@pytest.mark.multiprocess
def test_whatever_reads_the_gradients_next_completes_the_pending_round_first(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["settled_by"] == {name: (True, 1) for name in
                                   ("no_sync", "check_pending_rounds", "a switch between rounds", "detach")}


@pytest.mark.multiprocess
def test_a_backward_with_the_round_still_pending_is_an_error_not_corrupted_gradients(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["next_backward"] is not None, "the backward went ahead over the pending averages"
        message, still_pending = r["next_backward"]
        assert message.startswith("static_dist: a backward pass started while the previous round's gradient averages"
                                  " were still pending")
        assert "strategy.sync.optimizer_overlap=false" in message and "\n" not in message
        assert still_pending  # (left to settle(), which the caller may still call)


def test_step_per_bucket_without_a_pending_round_is_one_plain_step() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    calls = []
    optimizer.register_step_pre_hook(lambda *args: calls.append(1))
    sync = GradientSynchronizer(model.named_parameters())  # (never attached: no round, nothing pending)
    model(torch.ones(1, 2)).sum().backward()
    step_per_bucket(optimizer, sync)
    assert calls == [1]


# ------------------------------------------------------------------------------------------- the decision


def test_auto_is_on_with_nothing_in_the_way_and_off_naming_the_first_hazard() -> None:
    adamw = [torch.optim.AdamW(nn.Linear(2, 2).parameters())]
    assert choose_optimizer_overlap("auto", step_hazards([], True, False, adamw)).describe() == (
        "optimizer overlap: on (auto: nothing reads the gradients between backward and the step)")
    clipping = ["gradient clipping (trainer.gradient_clip_val=0.5) needs every bucket's average first"]
    assert choose_optimizer_overlap("auto", step_hazards(clipping, True, False, adamw)).describe() == (
        "optimizer overlap: off (gradient clipping (trainer.gradient_clip_val=0.5) needs every bucket's average first)")
    lbfgs = [torch.optim.LBFGS(nn.Linear(2, 2).parameters())]
    assert "LBFGS is not one of torch.optim's per-parameter" in choose_optimizer_overlap(
        "auto", step_hazards([], True, False, lbfgs)).why
    assert "Fabric" in choose_optimizer_overlap("auto", step_hazards(None, True, False, adamw)).why
    assert choose_optimizer_overlap(False, []).describe() == "optimizer overlap: off (strategy.sync.optimizer_overlap=false)"
    assert torch.optim.AdamW in PER_PARAMETER and torch.optim.LBFGS not in PER_PARAMETER


def test_optimizer_step_hooks_would_run_once_per_bucket_so_auto_is_off_and_true_is_one_line() -> None:
    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert step_hazards([], True, False, [sgd]) == []
    handle = sgd.register_step_pre_hook(lambda *args: None)
    own = ("SGD has step hooks (register_step_pre_hook / register_step_post_hook) that would run once per bucket")
    assert choose_optimizer_overlap("auto", step_hazards([], True, False, [sgd])).describe() == (
        f"optimizer overlap: off ({own})")
    handle.remove()
    handle = sgd.register_step_post_hook(lambda *args: None)
    assert step_hazards([], True, False, [sgd]) == [own]
    handle.remove()
    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        with pytest.raises(ConfigError) as excinfo:
            choose_optimizer_overlap(True, step_hazards([], True, False, [sgd]))
    finally:
        handle.remove()
    assert str(excinfo.value) == (
        "strategy.sync.optimizer_overlap=True: torch's global optimizer step hooks (register_optimizer_step_pre_hook /"
        " _post_hook) would run once per bucket; allowed with it: auto (off here), false")
    handle = register_optimizer_step_post_hook(lambda *args: None)
    try:
        assert len(step_hazards([], True, False, [sgd])) == 1
    finally:
        handle.remove()
    assert step_hazards([], True, False, [sgd]) == []


def test_true_with_a_hazard_found_at_setup_is_one_line() -> None:
    with pytest.raises(ConfigError) as excinfo:
        choose_optimizer_overlap(True, step_hazards([], False, True, []))
    message = str(excinfo.value)
    assert "\n" not in message
    assert message == ("strategy.sync.optimizer_overlap=True: manual optimization steps inside training_step;"
                       " allowed with it: auto (off here), false")


@pytest.mark.parametrize(("strategy", "named"), [
    pytest.param({"sync": {"schedule": "overlap"}}, "sync.schedule=overlap", id="schedule-overlap"),
    pytest.param({"sync": {"mode": "graph"}}, "sync.mode=graph", id="graph-mode"),
    pytest.param({"sync": {"schedule": "after_backward", "nonfinite": "skip"}}, "sync.nonfinite=skip", id="nonfinite"),
    pytest.param({"sync": {"schedule": "after_backward"}, "compression": {"name": "bf16"}}, "compression.name=bf16",
                 id="compression"),
    pytest.param({"sync": {"schedule": "after_backward"}, "compile": {"optimizer": True}}, "compile.optimizer=true",
                 id="compiled-optimizer"),
])
def test_true_where_the_config_shows_a_hazard_is_refused_before_any_process(strategy: dict[str, Any],
                                                                            named: str) -> None:
    sync = {**strategy.get("sync", {}), "optimizer_overlap": True}
    with pytest.raises(ConfigError) as excinfo:
        StaticDistStrategy(**{**strategy, "sync": sync})
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("strategy.sync.optimizer_overlap=True: ") and named in message
    assert message.endswith("allowed with it: auto (off here), false")


def test_true_and_auto_are_accepted_where_the_config_allows_them() -> None:
    for setting in (True, "auto", False):
        config = StrategyConfig.from_dict({"sync": {"schedule": "after_backward", "optimizer_overlap": setting}})
        assert config.sync.optimizer_overlap == setting
    assert StrategyConfig.from_dict({"sync": {"schedule": "auto", "optimizer_overlap": True}}).sync.optimizer_overlap
    with pytest.raises(ConfigError, match=r"^strategy.sync.optimizer_overlap='on': expected bool \| 'auto'$"):
        StrategyConfig.from_dict({"sync": {"optimizer_overlap": "on"}})


def test_the_synchronisers_schedule_is_one_frozen_value_changed_through_follow_only() -> None:
    sync = GradientSynchronizer(nn.Linear(2, 2).named_parameters())
    assert sync.schedule == RoundSchedule(launch_during_backward=True, defer_waits=False)
    with pytest.raises(AttributeError):  # (read-only: no object sets the synchroniser's switches)
        sync.schedule = RoundSchedule(launch_during_backward=False)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sync.schedule.defer_waits = True  # type: ignore[misc]
    sync.follow(RoundSchedule(launch_during_backward=False, defer_waits=True))
    assert sync.schedule.leaves_waits and not hasattr(sync, "launch_during_backward")
