"""``sync.optimizer_overlap`` inside real Lightning Trainers on 2 CPU ranks (Gloo, each rank its own batches), side by
side with Lightning's ``ddp``: the same weights, eager and compiled, and each bucket stepped while the later ones were
still pending; with gradient clipping the step waits for every bucket (off, the reason printed), and still equals ddp.
The fits share one module-scoped pair of ranks, except those of cases that read what the ranks print.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning_static_dist.offer import offer_of
from lightning_static_dist.trainer_context import TrainerContext
from _dist import RankPool
from tests._parts import parts_of, synchronizer_of
from tests.test_strategy import assert_same_weights, ddp, fit, fit_in, rank_reports, static_dist, write_rank_report

pytestmark = pytest.mark.multiprocess

SYNC = {"schedule": "after_backward", "first_bucket_mb": 0.004, "bucket_mb": 0.004}  # 4 KiB: several buckets
PLANNED = 8  # the tower's parameters; the unused layer's two are in no bucket
UNUSED = {"find_unused_parameters": True}  # ddp's options: the tower has a layer no rank calls


class Tower(L.LightningModule):
    """Four linear layers and a layer no rank ever calls, trained with AdamW (weight decay) or SGD (momentum)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer = optimizer
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32),
                                    nn.GELU(), nn.Linear(32, 1))
        self.unused = nn.Linear(4, 4)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)  # the same data for every run; the sampler gives each rank its half
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)


class SubSteps(Callback):
    """Writes ``<dir>/rank<N>.json``: the optimizer-overlap line (as the strategy and the run summary have it), the
    bucket count, and for each call of the real
    optimizer's ``step`` the parameters in its groups, the buckets settled and whether the round was still pending."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.seen: list[tuple[int, int, bool]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # (the real optimizer's step itself, seen through this object's own attribute: a step hook registered here,
        # after setup, would turn the overlap off)
        sync, optimizer = synchronizer_of(trainer.strategy), trainer.optimizers[0]
        step = optimizer.step

        def step_and_see(*args: Any, **kwargs: Any) -> Any:
            self.seen.append((sum(len(g["params"]) for g in optimizer.param_groups), sync.settled_buckets,
                              sync.unsettled))
            return step(*args, **kwargs)

        optimizer.step = step_and_see

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        facts = {"choice": parts_of(trainer.strategy).overlap.choice.describe(), "seen": self.seen,
                 "buckets": len(synchronizer_of(trainer.strategy).plan.buckets),
                 "summary": offer_of(trainer).sync_figures().optimizer_overlap}  # (what RunSummary records)
        write_rank_report(self.directory, trainer.global_rank, facts)


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """The 2 Gloo ranks the module's fits share (``fit_in``): one start-up for ddp's runs and ours."""
    with RankPool(2) as pool:
        yield pool


def fit_tower(ranks: Optional[RankPool], strategy: str, options: Optional[dict[str, Any]] = None,
              optimizer: str = "adamw", tmp_path: Any = None, **trainer_kwargs: Any
              ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Rank 0's weights after 4 optimizer steps under ``"ddp"`` or ``"static_dist"`` with ``options``, and with
    ``tmp_path`` each rank's :class:`SubSteps` facts. On ``ranks`` (test_strategy's ``fit_in``) or, with None, on
    ranks started for this fit alone (a case that reads what the ranks print: the pool's ranks print elsewhere)."""
    callbacks = [SubSteps(str(tmp_path))] if tmp_path is not None else []
    make = functools.partial(Tower, optimizer)
    if ranks is None:
        built = ddp(**(options or {})) if strategy == "ddp" else static_dist(**(options or {}))
        weights, _ = fit(make, built, max_steps=4, callbacks=callbacks, **trainer_kwargs)
    else:
        weights, _ = fit_in(ranks, make, strategy, options, max_steps=4, callbacks=callbacks, **trainer_kwargs)
    return weights, rank_reports(tmp_path)


def assert_stepped_per_bucket(report: dict[str, Any], steps: int) -> None:
    """The first step (its round adopts the parameters into the plan) is one plain step; every later one steps each
    bucket once its average landed, the round still pending, in plan order."""
    buckets = report["buckets"]
    assert buckets >= 3
    assert report["seen"][0] == [PLANNED + 2, 0, False]
    later = report["seen"][1:]
    assert len(later) == buckets * (steps - 1), later
    for step in range(steps - 1):
        subs = later[step * buckets:(step + 1) * buckets]
        assert [settled for _, settled, _ in subs] == list(range(1, buckets + 1))
        assert all(pending for _, _, pending in subs)
        assert sum(n for n, _, _ in subs) == PLANNED


@pytest.fixture(scope="module")
def adamw_ddp(ranks: RankPool) -> dict[str, torch.Tensor]:
    return fit_tower(ranks, "ddp", UNUSED)[0]


@pytest.mark.parametrize("compile", [None, {"enabled": True, "backend": "aot_eager"}], ids=["eager", "compiled"])
def test_adamw_with_an_unused_layer_steps_per_bucket_and_ends_as_ddp(
        ranks: RankPool, adamw_ddp: dict[str, torch.Tensor], compile: Any, tmp_path: Any) -> None:
    ours, reports = fit_tower(ranks, "static_dist", {"sync": SYNC, "compile": compile}, tmp_path=tmp_path)
    assert_same_weights(ours, adamw_ddp)
    for report in reports:
        assert report["choice"] == report["summary"] == (
            "optimizer overlap: on (auto: nothing reads the gradients between backward and the step)")
        assert_stepped_per_bucket(report, steps=4)


def test_sgd_with_momentum_and_accumulation_steps_per_bucket_and_ends_as_ddp(ranks: RankPool, tmp_path: Any) -> None:
    theirs, _ = fit_tower(ranks, "ddp", UNUSED, optimizer="sgd", accumulate_grad_batches=2)
    ours, reports = fit_tower(ranks, "static_dist", {"sync": {**SYNC, "optimizer_overlap": True}}, optimizer="sgd",
                              tmp_path=tmp_path, accumulate_grad_batches=2)
    assert_same_weights(ours, theirs)
    for report in reports:
        assert report["choice"] == "optimizer overlap: on (each bucket's parameters step as its average lands)"
        assert_stepped_per_bucket(report, steps=4)  # (the last micro-batch's round overlaps the step)


def test_gradient_clipping_waits_for_every_bucket_says_why_and_ends_as_ddp(tmp_path: Any, capfd: Any) -> None:
    theirs, _ = fit_tower(None, "ddp", UNUSED, gradient_clip_val=0.05)
    ours, reports = fit_tower(None, "static_dist", {"sync": SYNC}, tmp_path=tmp_path, gradient_clip_val=0.05)
    assert_same_weights(ours, theirs)
    why = "gradient clipping (trainer.gradient_clip_val=0.05) needs every bucket's average first"
    assert f"static_dist: optimizer overlap: off ({why})" in capfd.readouterr().err
    for report in reports:
        assert report["choice"] == report["summary"] == f"optimizer overlap: off ({why})"
        assert report["seen"] == [[PLANNED + 2, 0, False]] * 4  # one plain step each, the round complete



class ReadsGradients(Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        pass


class LogsGradients(Tower):
    def on_after_backward(self) -> None:
        pass


class Alternating(Tower):
    """Steps on odd batches only; on even ones runs the closure (training step and backward) alone, as Lightning's
    docs show for an overridden ``optimizer_step``."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 2 == 1:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


class OwnBackward(Alternating):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)


def test_the_trainers_gradient_readers_are_clipping_and_every_overridden_hook() -> None:
    readers = []
    for model, callbacks, clip in ((Tower(), [], None), (LogsGradients(), [ReadsGradients()], 0.5),
                                   (OwnBackward(), [], None)):
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks, gradient_clip_val=clip,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.strategy.connect(model)
        readers.append(TrainerContext(trainer).gradient_readers)
    assert readers == [[], [
        "gradient clipping (trainer.gradient_clip_val=0.5) needs every bucket's average first",
        "LogsGradients.on_after_backward is overridden and may read the gradients",
        "ReadsGradients.on_before_optimizer_step is overridden and may read the gradients",
    ], [
        "OwnBackward.optimizer_step is overridden and may run a backward without stepping, or read the gradients"
        " before the step",
        "OwnBackward.backward is overridden and may run a backward without stepping, or read the gradients before the"
        " step",
    ]]


def test_an_optimizer_step_that_runs_the_closure_without_stepping_turns_auto_off_and_ends_as_ddp(
        tmp_path: Any, capfd: Any) -> None:
    theirs, _ = fit(lambda: Alternating("sgd"), ddp(find_unused_parameters=True), max_steps=3)
    callbacks = [SubSteps(str(tmp_path))]
    ours, _ = fit(lambda: Alternating("sgd"), static_dist(sync=SYNC), max_steps=3, callbacks=callbacks)
    assert_same_weights(ours, theirs)
    why = ("Alternating.optimizer_step is overridden and may run a backward without stepping, or read the gradients"
           " before the step")
    assert f"static_dist: optimizer overlap: off ({why})" in capfd.readouterr().err
    for rank in range(2):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            assert json.load(f)["summary"] == f"optimizer overlap: off ({why})"


@pytest.mark.parametrize("precision", ["bf16-mixed"])  # (32-true: the tests above)
def test_the_precision_plugins_step_with_the_closure_steps_per_bucket_and_ends_as_ddp(
        ranks: RankPool, tmp_path: Any, precision: str) -> None:
    theirs, _ = fit_tower(ranks, "ddp", UNUSED, optimizer="sgd", precision=precision)
    ours, reports = fit_tower(ranks, "static_dist", {"sync": SYNC}, optimizer="sgd", tmp_path=tmp_path,
                              precision=precision)
    assert_same_weights(ours, theirs)
    for report in reports:
        assert report["choice"] == ("optimizer overlap: on (auto: nothing reads the gradients between backward and"
                                    " the step)")
        assert_stepped_per_bucket(report, steps=4)
