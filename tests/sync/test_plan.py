"""Bucket planning: pure functions, exact expectations."""

import pytest
import torch

from lightning_static_dist.sync.plan import MiB, ParamSpec, plan_buckets

CPU = torch.device("cpu")


def specs(*numels: int, dtype: torch.dtype = torch.float32) -> list[ParamSpec]:
    return [ParamSpec(i, n, dtype, CPU) for i, n in enumerate(numels)]


def test_buckets_fill_in_reverse_registration_order() -> None:
    # 4 params of 4 KiB; first bucket holds 4 KiB, later ones 8 KiB
    plan = plan_buckets(specs(1024, 1024, 1024, 1024), first_bucket_bytes=4096, bucket_bytes=8192)
    assert [b.param_indices for b in plan.buckets] == [(3,), (2, 1), (0,)]
    assert plan.location == {3: (0, 0), 2: (1, 0), 1: (1, 1), 0: (2, 0)}
    assert [b.offsets for b in plan.buckets] == [(0,), (0, 1024), (0,)]
    assert [b.numel for b in plan.buckets] == [1024, 2048, 1024]


def test_first_bucket_is_small_and_later_buckets_large() -> None:
    # 200 parameters of 256 KiB (64 Ki floats) each: 50 MiB
    plan = plan_buckets(specs(*[64 * 1024] * 200), first_bucket_bytes=1 * MiB, bucket_bytes=25 * MiB)
    assert [b.nbytes for b in plan.buckets] == [1 * MiB, 25 * MiB, 24 * MiB]
    assert [len(b.param_indices) for b in plan.buckets] == [4, 100, 96]


def test_a_parameter_larger_than_the_capacity_gets_its_own_bucket() -> None:
    plan = plan_buckets(specs(10, 10_000, 10), first_bucket_bytes=100, bucket_bytes=100)
    assert [b.param_indices for b in plan.buckets] == [(2,), (1,), (0,)]


def test_dtypes_and_devices_never_share_a_bucket() -> None:
    mixed = [
        ParamSpec(0, 4, torch.float32, CPU),
        ParamSpec(1, 4, torch.bfloat16, CPU),
        ParamSpec(2, 4, torch.bfloat16, CPU),
        ParamSpec(3, 4, torch.float32, CPU),
    ]
    plan = plan_buckets(mixed, first_bucket_bytes=MiB, bucket_bytes=MiB)
    assert [(b.param_indices, b.dtype) for b in plan.buckets] == [
        ((3,), torch.float32),
        ((2, 1), torch.bfloat16),
        ((0,), torch.float32),
    ]
    assert plan.buckets[1].nbytes == 16


def test_plan_is_a_function_of_its_inputs_only() -> None:
    a = plan_buckets(specs(5, 7, 9, 11), 40, 64)
    b = plan_buckets(list(reversed(specs(5, 7, 9, 11))), 40, 64)
    assert a == b
    assert a.describe() == b.describe()


def test_empty_and_invalid() -> None:
    assert plan_buckets([], 10, 10).buckets == ()
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(specs(1), 0, 10)


def test_an_observed_ready_order_replaces_registration_order() -> None:
    # parameter 0 registered first but its gradient is ready first (a module registered early, run last)
    plan = plan_buckets(specs(1024, 1024, 1024, 1024), 4096, 8192, ready_order=[0, 3, 2, 1])
    assert [b.param_indices for b in plan.buckets] == [(0,), (3, 2), (1,)]
    # parameters the observation missed follow, in reverse registration order
    plan = plan_buckets(specs(1024, 1024, 1024, 1024), 4096, 8192, ready_order=[1])
    assert [b.param_indices for b in plan.buckets] == [(1,), (3, 2), (0,)]


def test_graph_pieces_get_one_bucket_each_whatever_their_size() -> None:
    # six parameters of 4 KiB in backward order 5..0; a cut graph made three pieces: {5, 4}, {3, 2, 1}, {0}
    groups = {5: 0, 4: 0, 3: 1, 2: 1, 1: 1, 0: 2}
    plan = plan_buckets(specs(*[1024] * 6), first_bucket_bytes=4096, bucket_bytes=8192, groups=groups)
    # capacities would have said (5,), (4, 3), (2, 1), (0,): a bucket straddling two pieces waits for the later one
    assert [b.param_indices for b in plan.buckets] == [(5, 4), (3, 2, 1), (0,)]


def test_parameters_outside_the_pieces_are_bucketed_by_capacity_and_never_join_a_piece() -> None:
    # 5 and 4 were read outside the compiled graph (no piece); 3..0 are one piece
    groups = {3: 7, 2: 7, 1: 7, 0: 7}
    plan = plan_buckets(specs(*[1024] * 6), first_bucket_bytes=4096, bucket_bytes=8192, groups=groups)
    assert [b.param_indices for b in plan.buckets] == [(5,), (4,), (3, 2, 1, 0)]


def test_bucket_sizes_in_mib_become_bytes_in_one_place() -> None:
    from lightning_static_dist.plan.step_plan import resolve_plan
    from lightning_static_dist.plan.strategy_config import StrategyConfig
    from lightning_static_dist.sync import BucketCapacity

    config = StrategyConfig.from_dict({"sync": {"bucket_mb": 10, "first_bucket_mb": 0.5, "schedule": "overlap"},
                                       "compile": {"enabled": True}})
    assert config.sync.capacity == BucketCapacity(first_bytes=1 << 19, bytes=10 << 20)
    assert (config.sync.capacity.first_mib, config.sync.capacity.mib) == (0.5, 10.0)
    # the compiled step is cut where the synchroniser's buckets end: the same bytes
    plan = resolve_plan(config, world_size=2, device_type="cpu", num_nodes=1, mesh=None)
    assert plan.compile.cut == plan.sync.capacity == BucketCapacity(1 << 19, 10 << 20)
