"""ParameterShards on 2 real Gloo ranks over a 1 x 2 mesh (``sync.reduce: reduce_scatter``, dp_shard 2): each rank's
optimizer steps only its own chunks; after the step the all-gathers, waited for before the forward and before the
parameters are read, leave both ranks with the same whole parameters, those of one plain Adam step on the gradient
averaged over both ranks' data; the optimizer state is saved in full form (``checkpoint.format: full``, loadable by
an unsharded optimizer) or as this rank's own ranges (``sharded``); teardown gives the parameters their own storage
and the optimizer its parameters back. Two optimizers are refused in one line naming the key."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from lightning_static_dist.checkpoint import parse_key
from lightning_static_dist.config import ConfigError
from lightning_static_dist.mesh import MeshConfig, build_dp_mesh
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.participants.parameter_shards import ParameterShards
from lightning_static_dist.plan.strategy_config import StrategyConfig

from ._view import Context, Regression, View

STEPS = 2
LR = 0.01


def _config(checkpoint_format: str) -> StrategyConfig:
    return StrategyConfig.from_dict({"sync": {"reduce": "reduce_scatter"}, "mesh": {"dp_shard": 2},
                                     "checkpoint": {"format": checkpoint_format}})


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _participants(view: View) -> tuple[GradientAveraging, ParameterShards]:
    """The gradient participant with its real collaborators (compile and embeddings off), and ParameterShards on it."""
    recording = PhaseRecording()
    compile = StaticCompile(view)
    gradients = GradientAveraging(view, compile, EmbeddingShards(view, recording), recording)
    return gradients, ParameterShards(view, gradients, compile)


def _a_fit(rank: int, mesh: Any) -> dict[str, Any]:
    model = Regression()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    view = View(model, _config("full"), optimizers=[optimizer], mesh=mesh)
    gradients, sharded = _participants(view)
    context = view.enter(Context())
    gradients.setup(context)  # the roster's order: the synchroniser is built before ParameterShards sets up
    sharded.setup(context)
    gradients.after_setup(context)
    seen: dict[str, Any] = {
        "mode": gradients.mode,
        "model_numel": sum(p.numel() for p in model.parameters()),
        "optimizer_numel": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        "optimizer_holds_model_params": any(p is q for g in optimizer.param_groups for p in g["params"]
                                            for q in model.parameters()),
    }
    in_flight, waited = [], []
    for step in range(STEPS):
        context.step = step
        # the first step waits before the forward, the last before its parameters are read (a callback, a save)
        sharded.before_forward()
        model.training_step(_batch(rank, step), step).backward()
        gradients.finish_gradients(accumulating=False)
        optimizer.step()
        optimizer.zero_grad()
        sharded.after_optimizer_step()  # the all-gathers start
        in_flight.append(all(shard.work is not None for shard in sharded.sharded_sync.shards))
        if step < STEPS - 1:
            sharded.before_forward()
        else:
            sharded.before_reading_parameters()
        waited.append(all(shard.work is None for shard in sharded.sharded_sync.shards))
    seen.update(in_flight=in_flight, waited=waited,
                params={n: p.detach().clone() for n, p in model.named_parameters()},
                full_state=sharded.optimizer_state(optimizer))

    sharded_view = View(model, _config("sharded"), optimizers=[optimizer], mesh=mesh)
    pieces = ParameterShards(sharded_view, gradients, StaticCompile(sharded_view)).optimizer_state(optimizer)
    seen["pieces"] = {key: {name: t.clone() for name, t in value.items()} for key, value in pieces.items()}

    gradients.teardown(failed=False)  # the roster's order: the synchroniser's hooks out first, then the release
    sharded.teardown(failed=False)
    params = list(model.parameters())
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    seen.update(
        released=sharded.sharded_sync is None,
        optimizer_back=len(stepped) == len(params) and all(a is b for a, b in zip(stepped, params)),
        state_shapes=[tuple(optimizer.state[p]["exp_avg"].shape) for p in params],
        own_storage=len({p.untyped_storage().data_ptr() for p in params}) == len(params),
        after_teardown={n: p.detach().clone() for n, p in model.named_parameters()},
    )
    return seen


def _two_optimizers(mesh: Any) -> str:
    model = Regression()
    optimizers = [torch.optim.SGD(model.net[0].parameters(), lr=LR), torch.optim.SGD(model.net[2].parameters(), lr=LR)]
    view = View(model, _config("full"), optimizers=optimizers, mesh=mesh)
    gradients, _ = _participants(view)
    try:
        gradients.setup(view.enter(Context()))
    except ConfigError as err:
        return str(err)
    return "no error"


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    mesh = build_dp_mesh("cpu", MeshConfig(dp_shard=2))  # as the strategy builds it: a 1 x 2 mesh
    seen = {"fit": _a_fit(rank, mesh), "two_optimizers": _two_optimizers(mesh)}
    dist.barrier()
    return seen


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_on_two_ranks, world_size=2, timeout=120)


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One process, no sharding: Adam on the gradient averaged over both ranks' batches."""
    model = Regression()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            model.zero_grad()
            model.training_step(_batch(rank, step), step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer.state_dict()


@pytest.mark.multiprocess
def test_each_rank_s_optimizer_steps_only_its_own_half(ranks: list[dict[str, Any]]) -> None:
    fits = [r["fit"] for r in ranks]
    assert [f["mode"] for f in fits] == ["sharded", "sharded"]
    total = fits[0]["model_numel"]
    assert sum(f["optimizer_numel"] for f in fits) == total  # the chunks split the elements, padding aside
    for f in fits:
        assert abs(f["optimizer_numel"] - total / 2) <= 1
        assert not f["optimizer_holds_model_params"]  # it holds the chunks, not the parameters


@pytest.mark.multiprocess
def test_after_the_gathers_both_ranks_hold_one_plain_step_on_the_averaged_gradient(
        ranks: list[dict[str, Any]]) -> None:
    expected, _ = _reference()  # (Adam's steps barely see the gradient's scale: exp_avg pins it, in the tests below)
    for r in ranks:
        fit = r["fit"]
        assert fit["in_flight"] == [True] * STEPS  # after_optimizer_step starts the gathers; nothing waits there
        assert fit["waited"] == [True] * STEPS  # before_forward, then before_reading_parameters, wait for them
        torch.testing.assert_close(fit["params"], expected)
    for name in expected:
        torch.testing.assert_close(ranks[0]["fit"]["params"][name], ranks[1]["fit"]["params"][name], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_the_full_format_is_the_unsharded_optimizer_s_state_and_a_fresh_one_loads_it(
        ranks: list[dict[str, Any]]) -> None:
    expected_params, expected = _reference()
    for r in ranks:
        full = r["fit"]["full_state"]
        assert full["param_groups"][0]["params"] == expected["param_groups"][0]["params"]
        assert set(full["state"]) == set(expected["state"])
        for index, entry in expected["state"].items():
            torch.testing.assert_close(full["state"][index], entry)
        fresh = Regression()
        for p, name in zip(fresh.parameters(), expected_params):
            p.data.copy_(expected_params[name])
        resumed = torch.optim.Adam(fresh.parameters(), lr=LR)
        resumed.load_state_dict(full)  # an unsharded run resumes from it
        assert all(resumed.state[p]["exp_avg"].shape == p.shape for p in fresh.parameters())


@pytest.mark.multiprocess
def test_the_sharded_format_is_this_rank_s_own_ranges(ranks: list[dict[str, Any]]) -> None:
    _, expected = _reference()
    covered: dict[int, list[tuple[int, int, int]]] = {}
    for rank, r in enumerate(ranks):
        (pieces,) = r["fit"]["pieces"].values()
        own = 0
        for name, value in pieces.items():
            index, key, where = parse_key(name)
            if where is None:
                continue  # a scalar (Adam's step), the same on every rank
            lo, hi = where
            torch.testing.assert_close(value, expected["state"][index][key].flatten()[lo:hi])
            if key == "exp_avg":
                covered.setdefault(index, []).append((lo, hi, rank))
                own += hi - lo
        assert own == r["fit"]["optimizer_numel"]  # its own half, nothing gathered
    for index, ranges in covered.items():  # the two ranks' ranges tile each parameter, each element once
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == expected["state"][index]["exp_avg"].numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert any(len({rank for *_, rank in ranges}) == 2 for ranges in covered.values())


@pytest.mark.multiprocess
def test_teardown_gives_the_parameters_and_the_optimizer_back_whole(ranks: list[dict[str, Any]]) -> None:
    shapes = [tuple(p.shape) for p in Regression().parameters()]
    for r in ranks:
        fit = r["fit"]
        assert fit["released"]
        assert fit["optimizer_back"]  # the optimizer holds the model's own parameters again
        assert fit["state_shapes"] == shapes  # with its state in full form
        assert fit["own_storage"]  # each parameter its own storage, no more a view of a bucket
        torch.testing.assert_close(fit["after_teardown"], fit["params"], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_two_optimizers_are_refused_in_one_line_naming_the_key(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        message = r["two_optimizers"]
        assert "strategy.sync.reduce" in message and "needs exactly one optimizer" in message
        assert "\n" not in message
