"""The Trainer strategy's step participants under Fabric, on 2 CPU ranks (Gloo), each ending with Fabric ``ddp``'s
results: ``reduce_scatter`` over a 2-way shard group, a sharded embedding, ``sync.mode: graph`` with the non-finite
check, and two trainable models set up one after the other (a GAN's loop). Each rank reads its own batches (Fabric's
``DistributedSampler``)."""

from __future__ import annotations

import functools
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from _dist import fabric_launch
from lightning.fabric.strategies import DDPStrategy
from tests.fabric.test_fabric import assert_same_weights, static_dist

pytestmark = pytest.mark.multiprocess

STEPS = 3


class Tagger(nn.Module):
    """An embedding (sharded by ``embedding.shard``) feeding two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens).mean(1))


def _loader(tokens: bool) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (48, 6), generator=g) if tokens else torch.randn(48, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randn(48, 4, generator=g)), batch_size=4, shuffle=True)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _one_model(fabric: L.Fabric, tokens: bool) -> bytes:
    fabric.seed_everything(11)
    model = Tagger() if tokens else _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before setup, as Fabric users do
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for step, (x, y) in enumerate(fabric.setup_dataloaders(_loader(tokens))):
        if step == STEPS:
            break
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    state = {k: v.detach().clone() for k, v in fabric.strategy.get_module_state_dict(model._forward_module).items()} \
        if hasattr(fabric.strategy, "_models") else {k: v.detach().clone() for k, v in model.state_dict().items()}
    facts = {"state": state, "losses": losses}
    gradients = getattr(fabric.strategy, "_models", None)
    if gradients:
        facts["mode"] = gradients[0].parts.gradients.mode
        facts["sharded_embeddings"] = gradients[0].parts.embeddings.sharder is not None
    return pickle.dumps(facts)


def _gan_step(fabric: L.Fabric, generator: Any, critic: Any, g_opt: Any, c_opt: Any, x: Any, y: Any) -> None:
    """The critic's step on a detached fake (its backward does not reach the generator), then the generator's (its
    backward reaches both models)."""
    fake = generator(x)
    fabric.backward((critic(fake.detach()) - critic(y)).mean())
    c_opt.step()
    c_opt.zero_grad()
    fabric.backward(-critic(generator(x)).mean())
    g_opt.step()
    g_opt.zero_grad()
    critic.zero_grad()


def _gan(fabric: L.Fabric) -> bytes:
    fabric.seed_everything(13)
    generator, critic = _mlp(), nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    g_opt = torch.optim.SGD(generator.parameters(), lr=0.05)
    c_opt = torch.optim.SGD(critic.parameters(), lr=0.05)
    generator, g_opt = fabric.setup(generator, g_opt)
    critic, c_opt = fabric.setup(critic, c_opt)  # a second trainable model
    for step, (x, y) in enumerate(fabric.setup_dataloaders(_loader(False))):
        if step == STEPS:
            break
        _gan_step(fabric, generator, critic, g_opt, c_opt, x, y)
    state = {f"g.{k}": v.detach().clone() for k, v in generator.state_dict().items()}
    state.update({f"c.{k}": v.detach().clone() for k, v in critic.state_dict().items()})
    metrics = fabric.strategy.metrics() if hasattr(fabric.strategy, "metrics") else {}
    return pickle.dumps({"state": state, "metrics": metrics})


def launch(make_strategy: Any, fn: Any, *args: Any) -> dict[str, Any]:
    """``fn(fabric, *args)`` on two fresh ranks under the strategy ``make_strategy()``: rank 0's results."""
    return pickle.loads(fabric_launch(make_strategy, fn, *args))


# Launched once and shared by the cases that read the same run (a launch is two process start-ups); the results are
# only read, never changed.
@functools.cache
def fabric_ddp(fn: Any, *args: Any) -> dict[str, Any]:
    """Fabric ``ddp``'s results of ``fn(fabric, *args)``: the reference."""
    return launch(DDPStrategy, fn, *args)


@functools.cache
def default_static_dist(fn: Any, *args: Any) -> dict[str, Any]:
    """``static_dist``'s results of ``fn(fabric, *args)`` with every option at its default."""
    return launch(static_dist(), fn, *args)


@pytest.mark.parametrize(("tokens", "kwargs", "mode"), [
    (False, {"mesh": {"dp_shard": 2}, "sync": {"reduce": "reduce_scatter"}}, "sharded"),
    (True, {"embedding": {"shard": True, "min_rows": 1}}, "hooks"),
], ids=["reduce_scatter", "embedding_shard"])
def test_a_sharded_run_ends_with_fabric_ddps_weights_and_losses(tokens: bool, kwargs: dict, mode: str) -> None:
    reference = fabric_ddp(_one_model, tokens)
    ours = launch(static_dist(**kwargs), _one_model, tokens)
    assert ours["mode"] == mode and ours["sharded_embeddings"] is tokens
    assert_same_weights(ours["state"], reference["state"], tol=1e-5)
    torch.testing.assert_close(ours["losses"], reference["losses"], atol=1e-6, rtol=1e-6)


def test_graph_mode_with_the_nonfinite_check_ends_with_fabric_ddps_weights() -> None:
    reference = fabric_ddp(_one_model, False)
    ours = launch(static_dist(sync={"mode": "graph", "nonfinite": "error"},
                              compile={"enabled": True, "backend": "aot_eager"}), _one_model, False)
    assert ours["mode"] == "graph"
    assert_same_weights(ours["state"], reference["state"], tol=1e-5)


def test_two_trainable_models_set_up_one_after_the_other_each_average_their_own_gradients() -> None:
    reference = fabric_ddp(_gan)
    ours = default_static_dist(_gan)
    assert_same_weights(ours["state"], reference["state"], tol=1e-6)
    # each model's own figures: the generator's under static_dist/, the critic's (set up second) under model1/ (the
    # last round of each: the generator's loss, whose backward reaches every parameter of both; each model's fp32
    # gradients, plus a few bytes of the round's own: 1476 parameters in the generator, 97 in the critic)
    figures = ours["metrics"]
    assert figures["static_dist/sync_rounds"] >= STEPS and figures["static_dist/model1/sync_rounds"] >= STEPS
    generator, critic = figures["static_dist/sync_round_bytes"], figures["static_dist/model1/sync_round_bytes"]
    assert 4 * 1476 <= generator < 4 * 1476 + 32 and 4 * 97 <= critic < 4 * 97 + 32, (generator, critic)


# --------------------------------------------------------------- a sharded optimizer state saved and loaded


RESUME_STEPS, SAVED_AT = 5, 2
REDUCE_SCATTER = {"mesh": {"dp_shard": 2}, "sync": {"reduce": "reduce_scatter"}}


def _adam_steps(fabric: L.Fabric, first: int, last: int, load: Any = None, save: Any = None) -> bytes:
    """Steps ``first`` .. ``last`` of an Adam run (the moments matter: a state not loaded shows in the weights); with
    ``load``: a fresh model and optimizer take the checkpoint first; with ``save``: ``fabric.save`` at the end."""
    fabric.seed_everything(11 if load is None else 12)  # a fresh pair starts from other weights: the load must tell
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.seed_everything(11)  # (the sampler's order: the same batches in every run)
    batches = list(fabric.setup_dataloaders(_loader(False)))
    state = {"model": model, "optimizer": optimizer, "step": -1}
    if load is not None:
        fabric.load(load, state)
        assert state["step"] == first, state["step"]
    for x, y in batches[first:last]:
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer, "step": last})
    weights = fabric.strategy.get_module_state_dict(model._forward_module) if hasattr(fabric.strategy, "_models") \
        else model.state_dict()
    return pickle.dumps({"state": {k: v.detach().clone() for k, v in weights.items()}})


def test_a_reduce_scatter_run_saved_and_loaded_into_fresh_processes_ends_as_an_uninterrupted_one(tmp_path: Any) -> None:
    path = tmp_path / "step2.ckpt"
    reference = launch(DDPStrategy, _adam_steps, 0, RESUME_STEPS)
    straight = launch(static_dist(**REDUCE_SCATTER), _adam_steps, 0, RESUME_STEPS)
    launch(static_dist(**REDUCE_SCATTER), _adam_steps, 0, SAVED_AT, None, path)
    resumed = launch(static_dist(**REDUCE_SCATTER), _adam_steps, SAVED_AT, RESUME_STEPS, path)
    assert_same_weights(resumed["state"], straight["state"], tol=1e-6)
    assert_same_weights(resumed["state"], reference["state"], tol=1e-5)


# ------------------------------------------------------------ which models a fabric.backward synchronises


def _nan_in_the_critics_loss(fabric: L.Fabric) -> bytes:
    """The generator's forward, then the critic's on the detached fake: the backward reaches the critic only."""
    fabric.seed_everything(13)
    generator, critic = _mlp(), nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    generator, _ = fabric.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.05))
    critic, _ = fabric.setup(critic, torch.optim.SGD(critic.parameters(), lr=0.05))
    loss = critic(generator(torch.randn(4, 8)).detach()).mean()
    try:
        fabric.backward(loss * float("nan"))
    except FloatingPointError as err:
        return pickle.dumps({"raised": str(err)})
    return pickle.dumps({"raised": None, "nan": [not torch.isfinite(p.grad).all() for p in critic.parameters()]})


def test_the_nonfinite_check_of_a_second_model_sees_the_backwards_gradients() -> None:
    facts = pickle.loads(fabric_launch(static_dist(sync={"nonfinite": "error"}), _nan_in_the_critics_loss, world_size=1))
    assert facts["raised"] is not None, facts  # (before the fix: nothing raised, the critic's gradients NaN)
    assert facts["raised"].startswith("static_dist: rank 0: non-finite gradient at step 0, first offending parameter '0.weight'")


def test_each_model_synchronises_in_the_backward_passes_that_give_it_gradients() -> None:
    # as DDP: the critic in both backward passes of a step (its loss, and the generator's, which reaches it), the
    # generator in its own only (the critic's loss reads a detached fake)
    figures = default_static_dist(_gan)["metrics"]
    assert figures["static_dist/sync_rounds"] == STEPS, figures
    assert figures["static_dist/model1/sync_rounds"] == 2 * STEPS, figures


# --------------------------------------------------------------- two compressed models saved and loaded

TOPK = {"name": "topk", "density": 0.25, "min_numel": 1}  # each rank's error-feedback residual, per model


def _gan_steps(fabric: L.Fabric, first: int, last: int, load: Any = None, save: Any = None,
               load_before_setup: bool = False) -> bytes:
    """Steps ``first`` .. ``last`` of the GAN loop with momentum; ``load``: a fresh pair takes the checkpoint first
    (``load_before_setup``: ``fabric.load`` before ``fabric.setup``); ``save``: ``fabric.save`` at the end."""
    fabric.seed_everything(13 if load is None else 14)  # a fresh pair starts from other weights: the load must tell
    generator, critic = _mlp(), nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    g_opt = torch.optim.SGD(generator.parameters(), lr=0.05, momentum=0.9)
    c_opt = torch.optim.SGD(critic.parameters(), lr=0.05, momentum=0.9)
    state: dict[str, Any] = {"g": generator, "c": critic, "g_opt": g_opt, "c_opt": c_opt, "step": -1}
    remainder = fabric.load(load, state) if load is not None and load_before_setup else None
    generator, g_opt = fabric.setup(generator, g_opt)
    critic, c_opt = fabric.setup(critic, c_opt)
    if load is not None and not load_before_setup:
        state.update(g=generator, c=critic, g_opt=g_opt, c_opt=c_opt)
        remainder = fabric.load(load, state)
    fabric.seed_everything(13)  # (the sampler's order: the same batches in every run)
    batches = list(fabric.setup_dataloaders(_loader(False)))
    assert load is None or state["step"] == first, state["step"]
    for x, y in batches[first:last]:
        _gan_step(fabric, generator, critic, g_opt, c_opt, x, y)
    if save is not None:
        fabric.save(save, {"g": generator, "c": critic, "g_opt": g_opt, "c_opt": c_opt, "step": last})
    weights = {f"g.{k}": v.detach().clone() for k, v in generator.state_dict().items()}
    weights.update({f"c.{k}": v.detach().clone() for k, v in critic.state_dict().items()})
    return pickle.dumps({"state": weights, "remainder": None if remainder is None else sorted(remainder)})


@pytest.fixture(scope="module")
def gan_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    """The uninterrupted 4-step TopK GAN run, and the checkpoint of its first 2 steps (shared by both ways to load)."""
    path = tmp_path_factory.mktemp("gan") / "gan.ckpt"
    straight = launch(static_dist(compression=TOPK), _gan_steps, 0, 4)
    launch(static_dist(compression=TOPK), _gan_steps, 0, 2, None, path)
    return straight, path


@pytest.mark.parametrize("load_before_setup", [False, True], ids=["after_setup", "before_setup"])
def test_two_compressed_models_saved_and_loaded_each_get_their_own_state_back(gan_saved: tuple[dict[str, Any], Any],
                                                                               load_before_setup: bool) -> None:
    straight, path = gan_saved
    saved = torch.load(path, weights_only=True)
    assert sorted(k for k in saved if k.startswith("static_dist")) == [
        "static_dist_compression", "static_dist_model1/static_dist_compression"]
    residuals = [saved[key]["ranks"][0]["state"]["residuals"]["0.weight"]
                 for key in ("static_dist_compression", "static_dist_model1/static_dist_compression")]
    assert residuals[0].numel() == 32 * 8 and residuals[1].numel() == 16 * 4  # the generator's, the critic's
    resumed = launch(static_dist(compression=TOPK), _gan_steps, 2, 4, path, None, load_before_setup)
    assert resumed["remainder"] == []  # (the strategy's entries are not the user's)
    assert_same_weights(resumed["state"], straight["state"], tol=1e-6)
