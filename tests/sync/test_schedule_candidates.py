"""``sync.schedule: auto``'s candidate set, pure: names, which candidates each transport gets, the dtypes only on
request, a checkpoint's choice found again (a bare schedule's name from older checkpoints too); and the config keys
that steer it refused in one line naming the key."""

from __future__ import annotations

import pytest

from lightning_static_dist import StaticDistStrategy
from lightning_static_dist.config.check import ConfigError
from lightning_static_dist.plan.step_plan import resolve_plan
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync.config import SyncConfig, schedule_without_probe
from lightning_static_dist.sync.schedule import ScheduleCandidate, candidate_named, schedule_candidates

AUTO = SyncConfig(schedule="auto", reduce_dtype="auto")


def _names(sync: SyncConfig, transport: str) -> list[str]:
    return [c.name for c in schedule_candidates(sync.reduce_dtype, sync.comm_sms, transport)]  # type: ignore[arg-type]


def test_on_nccl_with_reduce_dtype_auto_there_are_ten_candidates_overlap_first() -> None:
    assert _names(AUTO, "nccl") == [
        "overlap/fp32/sms=default", "overlap/fp32/sms=8", "overlap/fp32/sms=4", "overlap/fp32/sms=2",
        "overlap/bf16/sms=default", "overlap/bf16/sms=8", "overlap/bf16/sms=4", "overlap/bf16/sms=2",
        "after_backward/fp32", "after_backward/bf16",
    ]
    assert _names(AUTO, "simulated") == _names(AUTO, "nccl")  # the emulated link's SMs switch too


def test_on_gloo_only_the_default_sms() -> None:
    assert _names(AUTO, "gloo") == ["overlap/fp32/sms=default", "overlap/bf16/sms=default",
                                    "after_backward/fp32", "after_backward/bf16"]


@pytest.mark.parametrize(("reduce_dtype", "dtype"), [("fp32", "fp32"), ("bf16", "bf16")])
def test_a_pinned_reduce_dtype_is_the_only_dtype_tried(reduce_dtype: str, dtype: str) -> None:
    sync = SyncConfig(schedule="auto", reduce_dtype=reduce_dtype)  # type: ignore[arg-type]
    assert _names(sync, "gloo") == [f"overlap/{dtype}/sms=default", f"after_backward/{dtype}"]
    assert _names(sync, "nccl") == [f"overlap/{dtype}/sms={n}" for n in ("default", 8, 4, 2)] + [f"after_backward/{dtype}"]


def test_a_configured_comm_sms_is_the_default_and_not_tried_twice() -> None:
    sync = SyncConfig(schedule="auto", comm_sms=4)
    assert _names(sync, "nccl") == ["overlap/fp32/sms=default", "overlap/fp32/sms=8", "overlap/fp32/sms=2",
                                    "after_backward/fp32"]


def test_the_sharded_synchroniser_has_no_auto_schedule() -> None:
    with pytest.raises(ConfigError, match=r"^strategy\.sync\.schedule.*allowed: 'overlap'"):
        StaticDistStrategy(sync={"schedule": "auto", "reduce": "reduce_scatter"}, mesh={"dp_shard": 2})


def test_a_checkpoints_choice_is_found_again_and_a_bare_schedule_means_the_default() -> None:
    candidates = schedule_candidates("auto", None, "nccl")
    assert candidate_named("overlap/bf16/sms=4", candidates, "auto") == ScheduleCandidate("overlap", "bf16", 4)
    assert candidate_named("after_backward", candidates, "auto") == ScheduleCandidate("after_backward", "fp32")
    pinned = schedule_candidates("bf16", None, "gloo")
    assert candidate_named("overlap", pinned, "bf16") == ScheduleCandidate("overlap", "bf16")
    assert candidate_named("overlap/fp32/sms=4", schedule_candidates("auto", None, "gloo"), "auto") is None  # not on Gloo


@pytest.mark.parametrize(("sync", "key", "says"), [
    pytest.param({"reduce_dtype": "auto", "schedule": "overlap"}, "strategy.sync.reduce_dtype", "schedule 'auto'", id="dtype-auto-overlap"),
    pytest.param({"reduce_dtype": "auto", "schedule": "after_backward"}, "strategy.sync.reduce_dtype",
                 "schedule 'auto'", id="dtype-auto-after-backward"),
    pytest.param({"reduce_dtype": "fp16", "schedule": "auto"}, "strategy.sync.reduce_dtype", "'fp16'", id="dtype-fp16"),
    pytest.param({"comm_sms": 0, "schedule": "auto"}, "strategy.sync.comm_sms", "[1, 1024]", id="comm-sms-0"),
    pytest.param({"comm_sms": 2000}, "strategy.sync.comm_sms", "[1, 1024]", id="comm-sms-2000"),
])
def test_bad_values_are_one_line_errors_naming_the_key(sync: dict, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        StaticDistStrategy(sync=sync)
    message = str(caught.value)
    assert message.startswith(key) and says in message and "\n" not in message, message


def test_reduce_dtype_auto_with_a_compressor_or_sharding_is_refused_naming_the_key() -> None:
    for options in ({"compression": {"name": "powersgd"}}, {"sync": {"reduce": "reduce_scatter"}, "mesh": {"dp_shard": 2}}):
        sync = {"schedule": "auto", "reduce_dtype": "auto", **options.pop("sync", {})}
        with pytest.raises(ConfigError) as caught:
            StaticDistStrategy(sync=sync, **options)
        assert str(caught.value).startswith("strategy.sync."), caught.value


@pytest.mark.parametrize(("device", "world", "sync", "sharded", "free", "expected"), [
    ("cuda", 2, {}, False, False, None),                 # GPUs: the probe at setup decides
    ("cuda", 8, {"probe": True}, False, False, None),
    ("cpu", 2, {"probe": True}, False, False, None),     # asked for on CPUs: probed over Gloo
    ("cpu", 2, {}, False, False, "overlap"),             # Gloo on CPUs: hidden under backward, not probed
    ("cuda", 2, {"probe": False}, False, False, "overlap"),
    ("cuda", 1, {}, False, False, "overlap"),            # one rank: nothing to average
    ("cuda", 2, {"mode": "graph"}, False, False, "overlap"),
    ("cuda", 2, {}, True, False, "overlap"),             # reduce_scatter issues its buckets during backward
    ("cuda", 2, {}, False, True, "after_backward"),      # free simulated links: nothing to hide, the step uncut
    ("cuda", 2, {"schedule": "after_backward"}, False, False, None),  # a pinned schedule is not resolved here
    ("cpu", 2, {"schedule": "auto"}, False, False, None),
])
def test_measured_resolves_without_a_probe_only_where_none_can_decide(device: str, world: int, sync: dict,
                                                                      sharded: bool, free: bool,
                                                                      expected: str) -> None:
    found = schedule_without_probe(SyncConfig(**sync), device_type=device, world_size=world, sharded=sharded,
                                   free_links=free)
    assert (found[0] if found else None) == expected
    if found:
        assert found[1] and "\n" not in found[1]  # the reason, for the line printed at fit start


def test_by_topology_is_read_as_measured_and_says_so() -> None:
    with pytest.warns(FutureWarning, match="by_topology.*measured"):
        assert SyncConfig(schedule="by_topology").schedule == "measured"
    assert SyncConfig().schedule == "measured"


@pytest.mark.parametrize("where", [dict(device_type="cpu", world_size=2),
                                   dict(device_type="cuda", world_size=1),
                                   dict(device_type="cuda", world_size=2, mode="graph"),
                                   dict(device_type="cuda", world_size=2, free_links=True)],
                         ids=["cpu", "one-rank", "graph", "free-links"])
def test_reduce_dtype_auto_without_a_probe_is_the_exact_dtype_and_says_so(where: dict) -> None:
    mode = where.pop("mode", "hooks")
    config = StrategyConfig.from_dict({"sync": {"reduce_dtype": "auto", "mode": mode}})
    plan = resolve_plan(config, num_nodes=1, mesh=None, **where)
    assert plan.sync.reduce_dtype == "fp32" and "reduce_dtype auto: fp32" in plan.sync.schedule_line
    assert config.sync.reduce_dtype == "auto"  # the decision is the plan's; the config stays as asked


def test_the_resolver_settles_measured_where_no_probe_decides_and_says_why() -> None:
    config = StrategyConfig.from_dict({"sync": {"bucket_mb": 10}})
    plan = resolve_plan(config, world_size=2, device_type="cpu", num_nodes=1, mesh=None)
    assert plan.sync.schedule == "overlap" and plan.sync.capacity.mib == 10 and config.sync.schedule == "measured"
    assert plan.sync.schedule_line == "sync.schedule measured: overlap (CPU ranks: Gloo shares the cores with the" \
                                      " step; sync.probe=true measures them)"
    pending = resolve_plan(config, world_size=2, device_type="cuda", num_nodes=1, mesh=None)
    assert (pending.sync.schedule, pending.sync.schedule_line) == ("measured", None)
    assert pending.compile.cut is None  # no cut until the probe settles the schedule
    settled = pending.settled("overlap", "sync.schedule measured: overlap (probed)")
    assert settled.compile.cut == settled.sync.capacity and pending.sync.schedule == "measured"
    with pytest.raises(RuntimeError, match="only a pending 'measured' is settled"):
        settled.settled("after_backward", "again")


def test_optimizer_overlap_true_with_measured_is_one_line_before_any_process_starts() -> None:
    with pytest.raises(ConfigError) as caught:
        StrategyConfig.from_dict({"sync": {"optimizer_overlap": True}})
    message = str(caught.value)
    assert "\n" not in message and message.startswith("strategy.sync.optimizer_overlap=True")
    assert "measured may choose overlap" in message and "after_backward" in message
    pinned = StrategyConfig.from_dict({"sync": {"optimizer_overlap": True, "schedule": "after_backward"}})
    assert pinned.sync.schedule == "after_backward"
