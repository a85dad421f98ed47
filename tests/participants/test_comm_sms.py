"""``sync.schedule: auto``'s SM budgets (:class:`CommSmsSwitch`, and :class:`ScheduleTrial` driving it): the groups a
budget gets carry the strategy's start-up timeout and then ``strategy.timeout_s`` (``CollectiveTimeout``); the groups
not chosen are destroyed once the trial decides, and a resumed run opens the chosen budget's group only; teardown
destroys the rest, except after a failure (then it only forgets them), and puts the simulated world's SMs back first,
even when the synchroniser refuses its group back. Which transports switch SMs: a simulated world with a link, NCCL
whose options have ``max_ctas``; not free links, not NCCL without ``max_ctas``.

NCCL needs GPUs: here the per-budget groups are Gloo groups (made by the real ``CommSmsSwitch.open`` through a
``new_group`` that records what it was asked for), on one rank in this process or on 2 real Gloo ranks."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from lightning_static_dist.participants import comm_sms as comm_sms_module
from lightning_static_dist.participants import schedule_trial as schedule_module
from lightning_static_dist.participants.comm_sms import CommSmsSwitch
from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.participants.schedule_trial import SCHEDULE_KEY, ScheduleTrial, schedule_transport
from lightning_static_dist.participants.runtime import CollectiveTimeout
from lightning_static_dist.simulate.config import LinkConfig, SimulateConfig
from lightning_static_dist.simulate.group import WORLD
from lightning_static_dist.plan.strategy_config import StrategyConfig

from ._view import Context, Regression, View, gradient_participant

START_UP = timedelta(seconds=600)  # plan/step_plan.py's START_UP_S: timeout_s (60) is shorter
TIMEOUT_S = 60.0
TRIAL_STEPS = 2
_REAL_NEW_GROUP = dist.new_group


def _alive(group: dist.ProcessGroup) -> bool:
    return group in dist.distributed_c10d._world.pg_map


def _timeout(group: dist.ProcessGroup) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


class _Synchronizer:
    """What the switch reads and sets of the synchroniser: its group (``refuse``: the setter raises)."""

    def __init__(self, group: Any, refuse: bool = False) -> None:
        self._group, self._refuse = group, refuse

    @property
    def group(self) -> Any:
        return self._group

    @group.setter
    def group(self, group: Any) -> None:
        if self._refuse:
            raise RuntimeError("static_dist: the process group of the synchroniser changes between rounds only")
        self._group = group


@pytest.fixture
def world_sms() -> Any:
    saved = WORLD.sms
    WORLD.sms = 16
    yield
    WORLD.sms = saved


# ----------------------------------------------------------------------------------------- the switch, one rank


def _budget_groups(*budgets: int) -> dict[int, dist.ProcessGroup]:
    return {sms: dist.new_group([0], backend="gloo") for sms in budgets}


def test_after_a_failure_close_only_forgets_the_groups(one_rank_gloo: None) -> None:
    groups = _budget_groups(8, 4)
    switch = CommSmsSwitch("nccl", None, groups)
    synchronizer = _Synchronizer(switch.group_for(4))
    assert synchronizer.group is groups[4]
    switch.close(synchronizer, failed=True)
    assert synchronizer.group is None and switch.groups == []  # the default group back; nothing held
    assert all(_alive(g) for g in groups.values())  # not destroyed: left to the exit path
    for group in groups.values():
        dist.destroy_process_group(group)


def test_without_a_failure_close_destroys_them(one_rank_gloo: None) -> None:
    groups = _budget_groups(8, 4)
    switch = CommSmsSwitch("nccl", None, groups)
    switch.close(_Synchronizer(groups[8]), failed=False)
    assert not any(_alive(g) for g in groups.values())
    switch.close(None, failed=False)  # twice: nothing left to do


def test_keep_destroys_the_groups_not_chosen(one_rank_gloo: None) -> None:
    groups = _budget_groups(8, 4, 2)
    switch = CommSmsSwitch("nccl", None, groups)
    switch.keep(4)
    assert switch.groups == [groups[4]] and switch.group_for(4) is groups[4]
    assert _alive(groups[4]) and not _alive(groups[8]) and not _alive(groups[2])
    switch.keep(None)  # the default chosen: none kept
    assert switch.groups == [] and not _alive(groups[4])


@pytest.mark.parametrize("failed", [True, False], ids=["failure", "clean"])
def test_a_synchroniser_refusing_its_group_back_cannot_skip_the_restore(
        one_rank_gloo: None, world_sms: None, failed: bool) -> None:
    switch = CommSmsSwitch("simulated", None)
    switch.group_for(4)
    assert WORLD.sms == 4
    refusing = _Synchronizer(object(), refuse=True)
    if failed:
        switch.close(refusing, failed=True)  # (a teardown after a failure raises nothing of its own)
    else:
        with pytest.raises(RuntimeError, match="between rounds only"):
            switch.close(refusing, failed=False)
    assert WORLD.sms == 16
    groups = _budget_groups(8)  # on NCCL: the groups are released all the same
    with pytest.raises(RuntimeError, match="between rounds only"):
        CommSmsSwitch("nccl", None, groups).close(refusing, failed=False)
    assert not _alive(groups[8])


def test_open_gives_each_budget_the_timeout_and_skips_a_budget_without_max_ctas(
        one_rank_gloo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, Any]] = []
    new_group = dist.new_group

    def recording_new_group(ranks: list[int], timeout: Optional[timedelta] = None, backend: Optional[str] = None,
                            pg_options: Any = None) -> dist.ProcessGroup:
        asked.append({"ranks": ranks, "timeout": timeout, "backend": backend, "pg_options": pg_options})
        return new_group(ranks, timeout=timeout, backend="gloo")

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    monkeypatch.setattr(comm_sms_module, "nccl_options",
                        lambda backend, sms: {} if sms == 2 else {"pg_options": f"max_ctas={sms}"})
    switch = CommSmsSwitch.open("nccl", None, [8, 4, 2], timeout=START_UP)
    assert asked == [{"ranks": [0], "timeout": START_UP, "backend": "nccl", "pg_options": f"max_ctas={n}"}
                     for n in (8, 4)]
    assert len(switch.groups) == 2 and switch.group_for(2) is None  # no twin of the default group for 2
    assert all(_timeout(g) == START_UP for g in switch.groups)
    switch.close(None, failed=False)


# ---------------------------------------------------------------------------------------- which transports


def _view(simulation: Optional[SimulateConfig] = None) -> Any:
    return SimpleNamespace(simulation=simulation, dp_group=None, root_device=torch.device("cuda"))


def test_free_links_switch_no_sms_and_an_emulated_link_does() -> None:
    assert schedule_transport(_view(SimulateConfig(world_size=2))) == "gloo"  # free links hold no SMs
    link = SimulateConfig(world_size=2, link=LinkConfig(gbps=70.0))
    assert schedule_transport(_view(link)) == "simulated"


def test_nccl_without_max_ctas_tries_the_default_sms_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", None, raising=False)  # (this torch's NCCL, lacking it)
    with pytest.warns(UserWarning, match="schedule=auto's SM budgets: this torch's NCCL options have no max_ctas"):
        assert schedule_transport(_view()) == "gloo"
    monkeypatch.setattr(schedule_module, "nccl_options", lambda backend, sms, setting=None: {"pg_options": sms})
    assert schedule_transport(_view()) == "nccl"


# ----------------------------------------------------------------------------------------- CollectiveTimeout


class _TwoRankView(View):
    @property
    def world_size(self) -> int:
        return 2  # (CollectiveTimeout does nothing at one rank)


def test_collective_timeout_sets_each_fits_sm_groups_after_its_first_step(one_rank_gloo: None) -> None:
    view = _TwoRankView(Regression(), StrategyConfig.from_dict({"timeout_s": TIMEOUT_S}))
    groups: list[dist.ProcessGroup] = [dist.new_group([0], timeout=START_UP, backend="gloo")]
    timeouts = CollectiveTimeout(view, groups=lambda: groups)
    timeouts.after_optimizer_step()
    assert _timeout(groups[0]) == timedelta(seconds=TIMEOUT_S)
    assert _timeout(dist.group.WORLD) == timedelta(seconds=TIMEOUT_S)
    timeouts.teardown(failed=False)
    groups = [dist.new_group([0], timeout=START_UP, backend="gloo")]  # the next fit's own
    timeouts.after_optimizer_step()
    assert _timeout(groups[0]) == timedelta(seconds=TIMEOUT_S)


# --------------------------------------------------------------- ScheduleTrial on 2 Gloo ranks, groups per budget

CANDIDATES = ["overlap/fp32/sms=default", "overlap/fp32/sms=8", "overlap/fp32/sms=4", "overlap/fp32/sms=2",
              "after_backward/fp32"]


def _as_if_nccl(asked: list[Optional[int]]) -> None:
    """This rank's transport reads as NCCL with ``max_ctas``; each budget's group is a Gloo group (``asked``: the
    budgets, in the order their groups were made)."""
    def budget_group(ranks: list[int], timeout: Optional[timedelta] = None, backend: Optional[str] = None,
                     pg_options: Any = None) -> dist.ProcessGroup:
        asked.append(pg_options)
        return _REAL_NEW_GROUP(ranks, timeout=timeout, backend="gloo")

    schedule_module.schedule_transport = lambda view: "nccl"  # type: ignore[assignment]
    comm_sms_module.nccl_options = lambda backend, sms: {"pg_options": sms}  # type: ignore[assignment]
    dist.new_group = budget_group  # type: ignore[assignment]


def _schedule(saved: Optional[dict[str, Any]] = None, late: bool = False
              ) -> tuple[Regression, View, GradientAveraging, ScheduleTrial, CollectiveTimeout, Context]:
    model, view, gradients = gradient_participant({"timeout_s": TIMEOUT_S, "sync": {
        "schedule": "auto", "schedule_trial_steps": TRIAL_STEPS}})
    schedule = ScheduleTrial(view, gradients)
    if saved is not None and not late:
        schedule.load_state_dict({SCHEDULE_KEY: dict(saved)})  # (as Lightning loads: before setup)
    context = view.enter(Context())
    gradients.setup(context)
    gradients.after_setup(context)
    schedule.after_setup(context)
    if saved is not None and late:
        schedule.load_state_dict({SCHEDULE_KEY: dict(saved)})
    return model, view, gradients, schedule, CollectiveTimeout(view, groups=schedule.comm_groups), context


def _steps(rank: int, steps: int, parts: tuple, budget_of: dict[int, int],
           after_first: Optional[Any] = None) -> list[Optional[int]]:
    """``steps`` training steps; the budget of the group each round reduced over (``None``: the default group).
    ``after_first()`` is called after the first step."""
    model, view, gradients, schedule, timeouts, context = parts
    (optimizer,) = view.optimizers
    used = []
    for step in range(steps):
        context.step = step
        schedule.on_train_batch_start()
        used.append(budget_of.get(id(gradients.synchronizer.group)))
        g = torch.Generator().manual_seed(100 * rank + step)
        model.training_step((torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)), step).backward()
        gradients.finish_gradients(accumulating=False)
        optimizer.step()
        optimizer.zero_grad()
        timeouts.after_optimizer_step()
        schedule.after_optimizer_step()
        if step == 0 and after_first is not None:
            after_first()
    return used


def _budgets(schedule: ScheduleTrial) -> dict[int, dist.ProcessGroup]:
    return dict(schedule._sms._groups) if schedule._sms is not None else {}


def _trial(rank: int) -> dict[str, Any]:
    asked: list[Optional[int]] = []
    _as_if_nccl(asked)
    parts = _schedule()
    schedule, timeouts = parts[3], parts[4]
    opened = _budgets(schedule)
    seen: dict[str, Any] = {"candidates": [c.name for c in schedule.candidates], "asked": list(asked),
                            "start_up": {n: _timeout(g) for n, g in opened.items()}}
    seen["used"] = _steps(rank, len(CANDIDATES) * TRIAL_STEPS + 2, parts, {id(g): n for n, g in opened.items()},
                          after_first=lambda: seen.update(after_first_step={n: _timeout(g) for n, g in opened.items()}))
    seen["choice"] = schedule.trial.choice
    seen["kept"] = sorted(_budgets(schedule))
    seen["alive_after_choice"] = sorted(n for n, g in opened.items() if _alive(g))
    schedule.teardown(failed=False)
    parts[2].teardown(failed=False)
    timeouts.teardown(failed=False)
    seen["alive_after_teardown"] = sorted(n for n, g in opened.items() if _alive(g))
    return seen


def _resumed(rank: int, choice: str, late: bool, failed: bool) -> dict[str, Any]:
    asked: list[Optional[int]] = []
    _as_if_nccl(asked)
    parts = _schedule({"choice": choice, "step_s": {}}, late=late)
    schedule = parts[3]
    opened = _budgets(schedule)
    seen: dict[str, Any] = {"asked": list(asked), "kept": sorted(opened)}
    seen["used"] = _steps(rank, 3, parts, {id(g): n for n, g in opened.items()})
    schedule.teardown(failed=failed)
    parts[2].teardown(failed=failed)
    seen["alive_after_teardown"] = sorted(n for n, g in opened.items() if _alive(g))
    for group in opened.values():  # (what the exit path would do)
        if _alive(group):
            dist.destroy_process_group(group)
    return seen


def _late(rank: int) -> dict[str, Any]:
    """Loaded after setup: every budget's group opened, then the ones not chosen destroyed."""
    asked: list[Optional[int]] = []
    _as_if_nccl(asked)
    new_group = dist.new_group
    made: list[dist.ProcessGroup] = []
    dist.new_group = lambda *a, **k: made.append(new_group(*a, **k)) or made[-1]  # type: ignore[assignment]
    parts = _schedule({"choice": "overlap/fp32/sms=4", "step_s": {}}, late=True)
    schedule = parts[3]
    seen = {"asked": list(asked), "kept": sorted(_budgets(schedule)), "alive": [_alive(g) for g in made]}
    schedule.teardown(failed=False)
    parts[2].teardown(failed=False)
    return seen


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    seen = {"trial": _trial(rank),
            "resumed_sms4_failed": _resumed(rank, "overlap/fp32/sms=4", late=False, failed=True),
            "resumed_default": _resumed(rank, "after_backward/fp32", late=False, failed=False),
            "late": _late(rank)}
    dist.barrier()
    return seen


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_on_two_ranks, world_size=2, timeout=180)


@pytest.mark.multiprocess
def test_the_trial_switches_groups_and_keeps_the_chosen_budgets_group_only(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        trial = r["trial"]
        assert trial["candidates"] == CANDIDATES
        assert trial["asked"] == [8, 4, 2]  # one group per budget, in the same order on every rank
        assert trial["start_up"] == {n: START_UP for n in (8, 4, 2)}  # the start-up timeout, not NCCL's default
        # each candidate's two steps on its budget's group, then the choice's
        chosen = None if "sms=" not in trial["choice"] or "default" in trial["choice"] else int(
            trial["choice"].rsplit("=", 1)[1])
        assert trial["used"] == [None, None, 8, 8, 4, 4, 2, 2, None, None, chosen, chosen]
        assert trial["after_first_step"] == {n: timedelta(seconds=TIMEOUT_S) for n in (8, 4, 2)}  # CollectiveTimeout
        assert trial["kept"] == trial["alive_after_choice"] == ([] if chosen is None else [chosen])
        assert trial["alive_after_teardown"] == []
    assert ranks[0]["trial"]["choice"] == ranks[1]["trial"]["choice"]


@pytest.mark.multiprocess
def test_a_resumed_choice_opens_its_budgets_group_only_and_a_failure_leaves_it_to_the_exit(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        resumed = r["resumed_sms4_failed"]
        assert resumed["asked"] == [4] and resumed["kept"] == [4]
        assert resumed["used"] == [4, 4, 4]  # from the first step, no trial
        assert resumed["alive_after_teardown"] == [4]  # a failure: not destroyed at teardown
        default = r["resumed_default"]
        assert default["asked"] == [] and default["used"] == [None] * 3


@pytest.mark.multiprocess
def test_a_choice_loaded_after_setup_destroys_the_groups_not_chosen(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        late = r["late"]
        assert late["asked"] == [8, 4, 2] and late["kept"] == [4]
        assert late["alive"] == [False, True, False]
