"""EmbeddingShards on 2 real Gloo ranks: each rank holds its rows only once the optimizers are built; the full weight
is gathered by the forward (prefetched where ``embedding.prefetch`` says), released after the synchronised backward
and after the optimizer step; checkpoints hold the full weight and optimizer state; teardown gives the model its full
parameter back. And when nothing is sharded: world size 1, a validation, ``reduce_scatter``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from torch import nn

import lightning as L

from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.plan.strategy_config import StrategyConfig

from ._view import Context, View

ROWS = 11  # not divisible by 2: rank 1's shard is padded


class Bag(L.LightningModule):
    """An embedding of ``ROWS`` tokens averaged into one linear output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(ROWS, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()


def _sharding(prefetch: str = "after_optimizer", shard: Any = True,
              **sync: Any) -> tuple[Bag, View, EmbeddingShards, PhaseRecording]:
    model = Bag()
    embedding = {"shard": shard, "prefetch": prefetch, "min_rows": ROWS}
    config = StrategyConfig.from_dict({"embedding": embedding, "sync": sync})
    view = View(model, config)
    recording = PhaseRecording()
    return model, view, EmbeddingShards(view, recording), recording


def _weight(model: Bag) -> Any:
    return model.emb.weight  # None while released, the gathered rows while materialised


def _a_step(rank: int, world: int) -> dict[str, Any]:
    model, view, shards, recording = _sharding(prefetch="batch_start")
    full = model.emb.weight.detach().clone()
    shards.before_optimizers(view.enter(Context()))
    seen: dict[str, Any] = {"full": full, "params": dict((n, p.shape) for n, p in model.named_parameters()),
                            "weight_after_sharding": _weight(model), "shard": model.emb.weight_shard.detach().clone()}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)  # holds the shard, not the full weight
    view.optimizers = [optimizer]
    recorder = StepRecorder(torch.device("cpu"))
    recorder.active = True
    recording.attach_recorder(recorder)
    recorder.begin_step(step=0, rank=rank)

    shards.on_train_batch_start()
    seen["in_flight_at_batch_start"] = shards.sharder.weights[0].work is not None
    shards.before_forward()
    seen["gathered"] = _weight(model).detach().clone()
    loss = model.training_step(torch.tensor([[rank, 10 - rank, 5]]), 0)
    loss.backward()
    shards.finish_gradients(accumulating=True)  # a micro-batch that accumulates: gathered once per step, kept
    seen["kept_while_accumulating"] = _weight(model) is not None
    shards.finish_gradients(accumulating=False)
    seen["released_after_backward"] = _weight(model) is None
    seen["extra"] = recorder.end_step().extra
    optimizer.step()
    shards.after_optimizer_step()
    seen["released_after_step"] = _weight(model) is None

    seen["model_state"] = {k: v.clone() for k, v in shards.model_state_dict(model.state_dict()).items()}
    seen["optimizer_state"] = shards.optimizer_state_to_save(optimizer, optimizer.state_dict())
    shards.teardown(failed=False)
    seen["after_teardown"] = dict((n, p.detach().clone()) for n, p in model.named_parameters())
    return seen


def _after_optimizer_prefetch(rank: int, world: int) -> dict[str, Any]:
    model, view, shards, _ = _sharding(prefetch="after_optimizer")
    shards.before_optimizers(view.enter(Context()))
    shards.on_train_batch_start()
    issued_at_batch_start = shards.sharder.weights[0].work is not None
    shards.before_forward()  # nothing prefetched: the gather is issued and waited for here
    gathered = _weight(model) is not None
    shards.finish_gradients(accumulating=False)
    shards.after_optimizer_step()
    issued_after_step = shards.sharder.weights[0].work is not None
    shards.teardown(failed=False)
    return {"at_batch_start": issued_at_batch_start, "gathered": gathered, "after_step": issued_after_step}


def _nothing_sharded(rank: int, world: int) -> dict[str, Any]:
    _, view, shards, _ = _sharding(shard="auto", reduce="reduce_scatter")  # (shard: true is refused with it)
    shards.before_optimizers(view.enter(Context()))
    _, validate_view, validating, _ = _sharding()
    validating.before_optimizers(validate_view.enter(Context(fitting=False)))
    return {"reduce_scatter": shards.sharder is None, "validate": validating.sharder is None}


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    seen = {"step": _a_step(rank, world), "after_optimizer": _after_optimizer_prefetch(rank, world),
            "nothing": _nothing_sharded(rank, world)}
    dist.barrier()
    return seen


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_on_two_ranks, world_size=2, timeout=90)


@pytest.mark.multiprocess
def test_each_rank_holds_its_rows_and_the_forward_gets_the_full_weight(two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(r["step"] for r in two_ranks):
        assert result["params"] == {"emb.weight_shard": torch.Size([6, 4]), "head.weight": torch.Size([1, 4]),
                                    "head.bias": torch.Size([1])}
        padded = torch.cat([result["full"], torch.zeros(1, 4)])
        torch.testing.assert_close(result["shard"], padded[6 * rank : 6 * (rank + 1)], rtol=0, atol=0)
        assert result["weight_after_sharding"] is None  # released until a forward needs it
        assert result["in_flight_at_batch_start"]  # prefetch: batch_start
        torch.testing.assert_close(result["gathered"], result["full"], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_the_full_weight_is_released_after_the_synchronised_backward_and_after_the_step(
        two_ranks: list[dict[str, Any]]) -> None:
    for result in (r["step"] for r in two_ranks):
        assert result["kept_while_accumulating"]
        assert result["released_after_backward"]
        assert result["released_after_step"]
        assert set(result["extra"]) == {"embed_gather_ms", "embed_gather_exposed_ms"}
        assert result["extra"]["embed_gather_ms"] >= 0.0


@pytest.mark.multiprocess
def test_checkpoints_and_the_model_after_teardown_hold_the_full_trained_weight(two_ranks: list[dict[str, Any]]) -> None:
    zero, one = (r["step"] for r in two_ranks)
    for result in (zero, one):
        assert set(result["model_state"]) == {"emb.weight", "head.weight", "head.bias"}
        assert result["model_state"]["emb.weight"].shape == (ROWS, 4)
        assert result["optimizer_state"]["state"][0]["exp_avg"].shape == (ROWS, 4)  # the shard's slot, gathered
        torch.testing.assert_close(result["after_teardown"]["emb.weight"], result["model_state"]["emb.weight"])
    torch.testing.assert_close(zero["model_state"]["emb.weight"], one["model_state"]["emb.weight"])
    assert not torch.equal(zero["model_state"]["emb.weight"], zero["full"])  # it trained: rows 0, 5 and 10 moved


@pytest.mark.multiprocess
def test_after_optimizer_prefetch_issues_the_next_gather_after_the_step(two_ranks: list[dict[str, Any]]) -> None:
    for result in (r["after_optimizer"] for r in two_ranks):
        assert result == {"at_batch_start": False, "gathered": True, "after_step": True}


@pytest.mark.multiprocess
def test_reduce_scatter_and_a_validation_shard_nothing(two_ranks: list[dict[str, Any]]) -> None:
    for result in (r["nothing"] for r in two_ranks):
        assert result == {"reduce_scatter": True, "validate": True}


def test_world_size_one_shards_nothing_and_every_phase_leaves_the_model_alone(one_rank_gloo: None) -> None:
    model, view, shards, _ = _sharding(prefetch="batch_start")
    shards.before_optimizers(view.enter(Context()))
    assert shards.sharder is None
    shards.on_train_batch_start()
    shards.before_forward()
    shards.finish_gradients(accumulating=False)
    shards.after_optimizer_step()
    state = model.state_dict()
    assert shards.model_state_dict(state) is state
    assert isinstance(model.emb.weight, nn.Parameter) and model.emb.weight.shape == (ROWS, 4)
