"""The gradient synchroniser on 2 real Gloo ranks, against torch's DistributedDataParallel on the same data."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from _dist import RankPool, run_ranks
from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer
from lightning_static_dist.sync.broadcast import broadcast_tensors

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """Two Gloo ranks shared by the cases that leave the default group as they found it (one start-up)."""
    with RankPool(2) as pool:
        yield pool


class Zoo(nn.Module):
    """Every parameter kind the synchroniser must handle: tied, unused, frozen, BatchNorm, a root parameter,
    and a branch whose use depends on the data (``use_branch``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 8)
        self.branch = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)  # never called
        self.scale = nn.Parameter(torch.ones(()))  # a parameter on the root, not in a leaf module
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = self.frozen(self.emb(idx).mean(1))
        h = self.fc2(self.bn(self.fc1(h)).relu()) * self.scale
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 11, (6, 5), generator=g)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _ours_vs_ddp(rank: int, world: int, schedule: list[list[bool]], first_bucket_mb: float, bucket_mb: float) -> dict:
    """Train Zoo with DDP and with the synchroniser side by side; ``schedule[step][rank]`` says who uses the branch."""
    torch.manual_seed(0)
    base = Zoo()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DistributedDataParallel(theirs, find_unused_parameters=True)
    sync = GradientSynchronizer(ours.named_parameters(), capacity=BucketCapacity.from_mib(first_bucket_mb, bucket_mb))
    sync.attach()
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=0.1, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=0.1, weight_decay=0.1)
    mismatches = []
    for step, users in enumerate(schedule):
        idx = _batch(rank, step)
        broadcast_tensors(list(ours.buffers()))  # what the strategy does before each training forward
        ours(idx, use_branch=users[rank]).logsumexp(-1).mean().backward()
        sync.finish_if_pending()
        ddp(idx, use_branch=users[rank]).logsumexp(-1).mean().backward()
        for (name, g_ours), g_theirs in zip(_grads(ours).items(), _grads(theirs).values()):
            if (g_ours is None) != (g_theirs is None):
                mismatches.append(f"step {step} {name}: ours {g_ours is None=} theirs {g_theirs is None=}")
            elif g_ours is not None and not torch.allclose(g_ours, g_theirs, atol=1e-6, rtol=1e-6):
                mismatches.append(f"step {step} {name}: max diff {(g_ours - g_theirs).abs().max():.3g}")
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
    return {
        "mismatches": mismatches,
        "weights": {n: p.detach().clone() for n, p in ours.named_parameters()},
        "ddp_weights": {n: p.detach().clone() for n, p in theirs.named_parameters()},
        "stats": sync.stats,
        "planned": sorted(sync.parameter_names[i] for i in sync.plan.param_indices),
        "buckets": len(sync.plan.buckets),
    }


def test_gradients_equal_ddp_with_tied_unused_frozen_and_batchnorm(ranks: RankPool) -> None:
    results = ranks.run(_ours_vs_ddp, args=([[False, False]] * 3, 1.0, 25.0))
    for r in results:
        assert r["mismatches"] == []
        for name, w in r["weights"].items():
            torch.testing.assert_close(w, r["ddp_weights"][name], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results[0]["weights"], results[1]["weights"], atol=0, rtol=0)
    # the never-used branch and the frozen layer are not in the plan; the tied weight is planned once
    planned = results[0]["planned"]
    assert not any(n.startswith(("unused.", "branch.", "frozen.")) for n in planned)
    assert "emb.weight" in planned and "head.weight" not in planned
    assert results[0]["stats"].rounds == 3 and results[0]["stats"].plan_rebuilds == 0


def test_many_small_buckets_launch_in_order_and_still_match_ddp(ranks: RankPool) -> None:
    # ~0.1 KB buckets: every parameter its own collective; hooks fire in an order plan order must tame
    results = ranks.run(_ours_vs_ddp, args=([[False, False]] * 2, 1e-4, 1e-4))
    assert results[0]["mismatches"] == [] and results[1]["mismatches"] == []
    assert results[0]["buckets"] >= 6


def test_usage_that_differs_between_ranks_and_changes_over_time(ranks: RankPool) -> None:
    # steps 0-1: nobody uses the branch (left out of the plan); step 2: only rank 1 does (plan rebuilt);
    # step 3: only rank 0; step 4: nobody (planned but unused: grads stay None like DDP's)
    schedule = [[False, False], [False, False], [False, True], [True, False], [False, False]]
    results = ranks.run(_ours_vs_ddp, args=(schedule, 1.0, 25.0))
    for r in results:
        assert r["mismatches"] == []
        assert "branch.weight" in r["planned"]
        assert r["stats"].plan_rebuilds == 1
    torch.testing.assert_close(results[0]["weights"], results[1]["weights"], atol=0, rtol=0)


def _accumulate(rank: int, world: int, micro_batches: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    sync = GradientSynchronizer(model.named_parameters())
    sync.attach()
    counts = []
    for i in range(micro_batches):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
        boundary = i == micro_batches - 1
        if boundary:
            model(x).pow(2).sum().backward()
            sync.finish_if_pending()
        else:
            with sync.no_sync():
                model(x).pow(2).sum().backward()
                sync.finish_if_pending()
        counts.append(sync.stats.collectives)
        reference(x).pow(2).sum().backward()
    for p in reference.parameters():  # the accumulated local sums, averaged once by hand
        dist.all_reduce(p.grad)
        p.grad /= world
    return {
        "counts": counts,
        "skipped": sync.stats.skipped_rounds,
        "grads": [p.grad.clone() for p in model.parameters()],
        "reference": [p.grad.clone() for p in reference.parameters()],
    }


def test_accumulation_communicates_only_on_the_boundary(ranks: RankPool) -> None:
    results = ranks.run(_accumulate, args=(4,))
    for r in results:
        # no collective during the 3 accumulation micro-batches; the boundary round reduces the sums
        assert r["counts"][:3] == [0, 0, 0]
        assert r["counts"][3] > 0
        assert r["skipped"] == 3
        torch.testing.assert_close(r["grads"], r["reference"], atol=1e-6, rtol=1e-6)


def _mixed_dtypes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8).to(torch.bfloat16))
    sync = GradientSynchronizer(model.named_parameters())
    sync.attach()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    model[1](model[0](x).to(torch.bfloat16)).float().sum().backward()
    local = [p.grad.float().clone() for p in model.parameters()]
    sync.finish_if_pending()
    return {
        "grads": [p.grad.float() for p in model.parameters()],
        "dtypes": [p.grad.dtype for p in model.parameters()],
        "local": local,
        "bucket_dtypes": [b.dtype for b in sync.plan.buckets],
    }


def test_each_dtype_gets_its_own_bucket_and_the_mean_is_right(ranks: RankPool) -> None:
    r0, r1 = ranks.run(_mixed_dtypes)
    assert sorted(map(str, r0["bucket_dtypes"])) == ["torch.bfloat16", "torch.float32"]
    assert r0["dtypes"] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    for g0, g1, l0, l1 in zip(r0["grads"], r1["grads"], r0["local"], r1["local"]):
        torch.testing.assert_close(g0, g1, atol=0, rtol=0)
        torch.testing.assert_close(g0, (l0 + l1) / 2, atol=2e-2, rtol=2e-2)  # bf16 rounding


class RegisteredBackwards(nn.Module):
    """``head`` is registered first but runs last, so its gradient is the first one ready."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 64)
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _plan_order(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = RegisteredBackwards()
    capacity = BucketCapacity(first_bytes=64 * 65 * 4, bytes=1 << 20)
    sync = GradientSynchronizer(model.named_parameters(), capacity=capacity)
    sync.attach()
    for step in range(2):
        model(torch.randn(3, 64, generator=torch.Generator().manual_seed(rank + 10 * step))).sum().backward()
        sync.finish_if_pending()
        model.zero_grad()
    first = [sync.parameter_names[i] for i in sync.plan.buckets[0].param_indices]
    return {"first_bucket": first, "plan": sync.plan.describe()}


def test_buckets_follow_the_observed_gradient_order_on_every_rank(ranks: RankPool) -> None:
    r0, r1 = ranks.run(_plan_order)
    # reverse registration order would have put body.3 first and head last
    assert r0["first_bucket"] == ["head.bias", "head.weight"] or r0["first_bucket"] == ["head.weight", "head.bias"]
    assert r0["plan"] == r1["plan"]


def _skip_a_step(rank: int, world: int, check_each_collective: bool = False) -> str:
    from lightning_static_dist.agreement.fingerprint import RankMismatchError
    from lightning_static_dist.sync import GradientSynchronizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    sync = GradientSynchronizer(model.named_parameters(), check_each_collective=check_each_collective)
    sync.attach()
    try:
        for step in range(6):  # a round's verdict is read at the start of the round after next
            if rank == 1 and step == 2:
                with sync.no_sync():  # rank 1 skips this step's synchronisation: its next round is rank 0's third
                    model(torch.randn(2, 8)).sum().backward()
                continue
            model(torch.randn(2, 8)).sum().backward()
            sync.finish_if_pending()
    except RankMismatchError as err:
        return str(err)
    return "no error"


def test_a_rank_that_skips_a_step_is_named_on_every_rank() -> None:
    for message in run_ranks(_skip_a_step, 2, timeout=60):
        # rank 0's third synchronised backward (pass 2) met rank 1's fourth (pass 3: its skipped step counted)
        assert message.startswith("static_dist: ranks are in different steps — rank 0 at backward pass 2, rank 1 at"
                                  " backward pass 3"), message


def test_the_per_collective_check_names_the_disagreement_before_exchanging_data() -> None:
    for message in run_ranks(_skip_a_step, 2, args=(True,), timeout=60):
        assert message == ("static_dist: ranks disagree on the next gradient collective — rank 0: bucket 0, 144 values,"
                           " 4 parameters, backward pass 2; rank 1: bucket 0, 144 values, 4 parameters, backward pass 3")


def _round_check(rank: int, world: int, passes: list[int]) -> Any:
    from lightning_static_dist.sync.round_check import _RoundCheck

    check = _RoundCheck(passes[rank], group=None, device=torch.device("cpu"))
    check.settle()
    return check.sums()


def test_the_round_check_flags_every_rank_of_a_desynchronised_world_even_one_at_the_mean() -> None:
    # three ranks at passes 1, 2 and 3: rank 1 is at the mean, but sum(p)^2 = 36 != 3 * sum(p^2) = 42 on every rank;
    # in step (all at pass 70): nothing. Integer sums: exact on any number of ranks
    with RankPool(3) as three:
        assert three.run(_round_check, args=([1, 2, 3],)) == [(6, 14)] * 3
        assert three.run(_round_check, args=([70, 70, 70],)) == [None] * 3


# ------------------------------------------------------------------ the contracts, on a one-rank Gloo group


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def test_every_synchroniser_keeps_the_contract_its_participant_relies_on(one_rank_gloo: None) -> None:
    from lightning_static_dist.sync import Synchronizer, RoundSynchronizer
    from lightning_static_dist.sync.graph import GraphSynchronizer
    from lightning_static_dist.sync.sharded_synchronizer import ShardedSynchronizer

    model, sharded_model = _two_layers(), _two_layers()
    optimizer = torch.optim.SGD(sharded_model.parameters(), lr=0.1)
    hooks = GradientSynchronizer(model.named_parameters())
    sharded = ShardedSynchronizer(sharded_model.named_parameters(), optimizer, None, None)
    graph = GraphSynchronizer(model)
    assert all(isinstance(sync, Synchronizer) for sync in (hooks, sharded, graph))
    assert isinstance(hooks, RoundSynchronizer) and isinstance(sharded, RoundSynchronizer)
    assert not isinstance(graph, RoundSynchronizer)  # its collectives are in the compiled graph: no rounds to end


def test_a_reducer_hears_every_phase_of_the_rounds(one_rank_gloo: None) -> None:
    from lightning_static_dist.sync import MeanAllReduce

    class Phases(MeanAllReduce):
        def __init__(self) -> None:
            self.calls: Counter[str] = Counter()

        def gradient_ready(self) -> None:
            self.calls["gradient_ready"] += 1

        def round_finished(self) -> None:
            self.calls["round_finished"] += 1

        def abandon_round(self) -> None:
            self.calls["abandon_round"] += 1

    model, reducer = _two_layers(), Phases()
    sync = GradientSynchronizer(model.named_parameters(), reducer=reducer)
    sync.attach()
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        sync.finish_if_pending()
    sync.detach()
    # the first round plans (no bucket yet: its hooks fill nothing); the second fills 4 gradients into buckets
    assert reducer.calls == {"gradient_ready": 4, "round_finished": 2, "abandon_round": 1}


def test_a_reducer_without_the_round_phases_is_refused_where_it_is_plugged_in(one_rank_gloo: None) -> None:
    from lightning_static_dist.sync import MeanAllReduce

    class LaunchOnly:  # a duck-typed reducer: neither BucketReducer's phases nor a PendingReduction with nbytes
        def launch(self, bucket: Any, flat: torch.Tensor, group: Any) -> Any:
            return MeanAllReduce().launch(bucket, flat, group)

        def payload_bytes(self, bucket: Any, flat: torch.Tensor) -> int:
            return flat.numel() * flat.element_size()

    model = _two_layers()
    with pytest.raises(TypeError, match="LaunchOnly lacks gradient_ready, round_finished, abandon_round; subclass"):
        GradientSynchronizer(model.named_parameters(), reducer=LaunchOnly())  # type: ignore[arg-type]
    sync = GradientSynchronizer(model.named_parameters())
    with pytest.raises(TypeError, match="LaunchOnly lacks"):
        sync.reducer = LaunchOnly()  # type: ignore[assignment]

    class WithPhases(LaunchOnly):  # the phases defined by hand; its pending results still have no nbytes
        def gradient_ready(self) -> None: ...

        def round_finished(self) -> None: ...

        def abandon_round(self) -> None: ...

    sync.reducer = WithPhases()  # type: ignore[assignment]
    sync.attach()
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        sync.finish_if_pending()
    sync.detach()
    # the reducer's own count stands in for the missing nbytes: its payload is the buckets' dense bytes
    assert sync.stats.rounds == 2 and sync.stats.last_round_bytes == sync.stats.last_round_dense_bytes > 0


def test_the_sharded_synchroniser_hands_the_pieces_the_average_and_keeps_no_full_gradient(one_rank_gloo: None) -> None:
    from lightning_static_dist.sync.sharded_synchronizer import ShardedSynchronizer

    model, reference = _two_layers(), _two_layers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = ShardedSynchronizer(model.named_parameters(), optimizer, None, None)
    sync.bind()
    sync.attach()
    x = torch.randn(5, 4)
    model(x).sum().backward()
    sync.finish_if_pending()
    reference(x).sum().backward()
    expected = list(reference.parameters())
    for shard in sync.shards:
        flat = torch.cat([expected[i].grad.reshape(-1) for i in shard.bucket.param_indices])
        for piece in shard.pieces:
            torch.testing.assert_close(piece.param.grad, flat[piece.start : piece.end], atol=0, rtol=0)
    assert all(p.grad is None for p in model.parameters()) and sync.stats.rounds == 1
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"'0.weight' was frozen during fit"):
        model(x).sum().backward()
        sync.finish_if_pending()
    sync.release()
    assert sync.buffers == () and sync.shards == []


def test_a_pass_moves_through_one_round_state(one_rank_gloo: None) -> None:
    # the first hook starts the pass, the engine ends it and finishes its round, finish_if_pending closes it; under
    # no_sync the engine ends the pass and finishes nothing, and finish_if_pending counts the skipped round
    from lightning_static_dist.sync.round_state import RoundState

    model = nn.Linear(4, 2)
    sync = GradientSynchronizer(model.named_parameters())
    sync.attach()
    during: list[RoundState] = []
    model.bias.register_post_accumulate_grad_hook(lambda _: during.append(sync.state))  # (after the synchroniser's)
    states = [sync.state]
    model(torch.ones(3, 4)).sum().backward()
    states.append(sync.state)
    sync.finish_if_pending()
    states.append(sync.state)
    with sync.no_sync():
        model(torch.ones(3, 4)).sum().backward()
        states.append(sync.state)
        sync.finish_if_pending()
    states.append(sync.state)
    assert during == [RoundState.BACKWARD, RoundState.BACKWARD]
    assert states == [RoundState.IDLE, RoundState.FINISHED, RoundState.IDLE, RoundState.PASS_ENDED, RoundState.IDLE]
    assert (sync.backward_passes, sync.stats.rounds, sync.stats.skipped_rounds) == (2, 1, 1)
