"""The Trainer strategy's step participants under Fabric, on 2 CPU ranks (Gloo), each ending with Fabric ``ddp``'s
results: ``reduce_scatter`` over a 2-way shard group, a sharded embedding, ``sync.mode: graph`` with the non-finite
check, and two trainable models set up one after the other (a GAN's loop). Each rank reads its own batches (Fabric's
``DistributedSampler``)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from tests.fabric.test_fabric import _ReferenceDDP, assert_same_weights, static_dist

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
        fake = generator(x)
        fabric.backward((critic(fake.detach()) - critic(y)).mean())
        c_opt.step()
        c_opt.zero_grad()
        fabric.backward(-critic(generator(x)).mean())
        g_opt.step()
        g_opt.zero_grad()
        critic.zero_grad()
    state = {f"g.{k}": v.detach().clone() for k, v in generator.state_dict().items()}
    state.update({f"c.{k}": v.detach().clone() for k, v in critic.state_dict().items()})
    metrics = fabric.strategy.metrics() if hasattr(fabric.strategy, "metrics") else {}
    return pickle.dumps({"state": state, "metrics": metrics})


def launch(strategy: Any, fn: Any, *args: Any) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    return pickle.loads(fabric.launch(fn, *args))


@pytest.mark.parametrize(("tokens", "kwargs", "mode"), [
    (False, {"mesh": {"dp_shard": 2}, "sync": {"reduce": "reduce_scatter"}}, "sharded"),
    (True, {"embedding": {"shard": True, "min_rows": 1}}, "hooks"),
], ids=["reduce_scatter", "embedding_shard"])
def test_a_sharded_run_ends_with_fabric_ddps_weights_and_losses(tokens: bool, kwargs: dict, mode: str) -> None:
    reference = launch(_ReferenceDDP(), _one_model, tokens)
    ours = launch(static_dist(**kwargs), _one_model, tokens)
    assert ours["mode"] == mode and ours["sharded_embeddings"] is tokens
    assert_same_weights(ours["state"], reference["state"], tol=1e-5)
    torch.testing.assert_close(ours["losses"], reference["losses"], atol=1e-6, rtol=1e-6)


def test_graph_mode_with_the_nonfinite_check_ends_with_fabric_ddps_weights() -> None:
    reference = launch(_ReferenceDDP(), _one_model, False)
    ours = launch(static_dist(sync={"mode": "graph", "nonfinite": "error"},
                              compile={"enabled": True, "backend": "aot_eager"}), _one_model, False)
    assert ours["mode"] == "graph"
    assert_same_weights(ours["state"], reference["state"], tol=1e-5)


def test_two_trainable_models_set_up_one_after_the_other_each_average_their_own_gradients() -> None:
    reference = launch(_ReferenceDDP(), _gan)
    ours = launch(static_dist(), _gan)
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
    reference = launch(_ReferenceDDP(), _adam_steps, 0, RESUME_STEPS)
    straight = launch(static_dist(**REDUCE_SCATTER), _adam_steps, 0, RESUME_STEPS)
    launch(static_dist(**REDUCE_SCATTER), _adam_steps, 0, SAVED_AT, None, path)
    resumed = launch(static_dist(**REDUCE_SCATTER), _adam_steps, SAVED_AT, RESUME_STEPS, path)
    assert_same_weights(resumed["state"], straight["state"], tol=1e-6)
    assert_same_weights(resumed["state"], reference["state"], tol=1e-5)
