"""``self.log`` / ``self.log_dict`` inside a compiled ``training_step``: one graph, and the values Lightning's ``ddp``
logs (2 Gloo ranks, real Trainers, CSVLogger) or eager logs (a branch on ``batch_idx``, a torchmetrics object).
What the compile report says about the rest (guards, locations): test_report.py."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from _dist import RankPool, free_port
from lightning.pytorch.strategies import DDPStrategy
from lightning_static_dist import StaticDistStrategy, offer_of


class LoggingModel(L.LightningModule):
    """Logs several tensors and a Python float from its compiled step, with ``prog_bar``, ``sync_dist``, ``on_step``,
    ``on_epoch``, ``reduce_fx``, a positional argument, ``log_dict`` from a helper method, and from validation."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 4)
        self.scale = 0.5  # a Python float, the same every step: a constant of the graph

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        loss = F.mse_loss(out, y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        self.log("scale", self.scale)
        self.log("out_mean", out.mean(), on_step=False, on_epoch=True, sync_dist=True)
        self.log("out_max", out.abs().max(), on_step=True, on_epoch=True, reduce_fx="max")
        self.log("loss_sq", loss.detach() ** 2, True)  # prog_bar, passed by position
        self._log_norms(out)
        return loss

    def _log_norms(self, out: torch.Tensor) -> None:
        self.log_dict({"norm/out": out.norm(), "norm/weight": self.net.weight.norm()}, on_step=True, on_epoch=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self, n: int, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(32, 1)  # each rank its own half (DistributedSampler): 4 steps per epoch

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(16, 2)


class RankMetrics(L.Callback):
    """Each rank writes what it logged: ``callback_metrics`` and ``progress_bar_metrics`` after every step, and what
    compilation came to (``rank<R>.json``)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.steps: list[dict[str, dict[str, float]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append({"callback": _model_metrics(trainer.callback_metrics),
                           "prog_bar": _model_metrics(trainer.progress_bar_metrics)})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = offer.compile_report if (offer := offer_of(trainer)) is not None else None
        facts = {"steps": self.steps, "final": _model_metrics(trainer.callback_metrics)}
        if report is not None:
            facts.update(graph_breaks=report.graph_breaks, recompiles=report.recompiles, fallbacks=report.fallbacks,
                         logged_calls=getattr(report, "logged_calls", None), summary=report.summary())
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(facts, f)


def _model_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """What the model logged (the strategy's own ``static_dist/*`` figures left out)."""
    return {k: float(v) for k, v in metrics.items() if not k.startswith("static_dist/")}


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """The 2 Gloo ranks ddp's fit and ours run on: one start-up for them all."""
    with RankPool(2) as pool:
        yield pool


def _fit(ranks: RankPool, folder: str, options: Optional[dict[str, Any]], user_compiled: bool = False
         ) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Fit on the 2 ranks (the Trainer joins their group) under static_dist with ``options``, or Lightning's own
    ``DDPStrategy`` with None; return each rank's facts and the rows of rank 0's ``metrics.csv``."""
    os.makedirs(folder)
    ranks.run(_fit_on_this_rank, args=(folder, options, user_compiled), timeout=300)
    facts = []
    for rank in range(2):
        with open(os.path.join(folder, f"rank{rank}.json")) as f:
            facts.append(json.load(f))
    return facts, _logged_rows(folder)


def _fit_on_this_rank(rank: int, world: int, folder: str, options: Optional[dict[str, Any]],
                      user_compiled: bool) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
    torch._dynamo.reset()  # (compiled as in a fresh process: nothing cached by an earlier fit on these ranks)
    strategy = DDPStrategy() if options is None else StaticDistStrategy(**options)
    L.seed_everything(0)
    model: Any = LoggingModel()
    if user_compiled:
        model = torch.compile(model, backend="aot_eager")
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=2, log_every_n_steps=1, limit_val_batches=2,
        num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        logger=CSVLogger(folder, name="csv", version=0), callbacks=[RankMetrics(folder)],
    )
    trainer.fit(model)


def _logged_rows(folder: str) -> list[dict[str, str]]:
    """The rows of a run's ``metrics.csv`` with what the model logged: the strategy's own ``static_dist/*`` figures
    (the compile report's counts) left out, and the rows that held only those."""
    with open(os.path.join(folder, "csv", "version_0", "metrics.csv")) as f:
        rows = [{k: v for k, v in row.items() if not k.startswith("static_dist/")} for row in csv.DictReader(f)]
    return [row for row in rows if any(v for k, v in row.items() if k not in ("step", "epoch"))]


def _assert_same_numbers(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), f"{where}: {sorted(set(ours) ^ set(theirs))}"
        for key in theirs:
            _assert_same_numbers(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), f"{where}: {len(ours)} against {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same_numbers(a, b, f"{where}[{i}]")
    elif theirs == "" or ours == "":
        assert ours == theirs, f"{where}: {ours!r} against {theirs!r}"
    else:
        assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6), f"{where}: {ours} against {theirs}"


@pytest.mark.multiprocess
def test_a_training_step_that_logs_is_one_graph_and_logs_what_ddp_logs(ranks: RankPool, tmp_path: Any) -> None:
    ddp_ranks, ddp_csv = _fit(ranks, str(tmp_path / "ddp"), None)
    compiled = {"enabled": True, "backend": "aot_eager"}
    variants = {
        "compile": _fit(ranks, str(tmp_path / "compile"), {"compile": compiled}),
        # the user's torch.compile(model), compiled by the strategy; fullgraph: any graph break is an error
        "torch.compile": _fit(ranks, str(tmp_path / "user"), {"compile": {"fullgraph": True}}, user_compiled=True),
    }
    assert len(ddp_csv) > 8 and "val_loss" in ddp_csv[-1] and ddp_ranks[0]["steps"][0]["prog_bar"], ddp_csv
    # the ranks saw different data: a value logged without sync_dist differs between them, as under ddp
    assert ddp_ranks[0]["steps"][0]["callback"]["out_max_step"] != ddp_ranks[1]["steps"][0]["callback"]["out_max_step"]
    for name, (ranks, rows) in variants.items():
        for rank in (0, 1):
            facts = ranks[rank]
            # one graph: nothing broke it, nothing recompiled, nothing fell back to eager; 6 calls made after it
            assert facts["graph_breaks"] == [] and facts["recompiles"] == [], facts["summary"]
            assert facts["fallbacks"] == {}, facts["summary"]
            assert facts["logged_calls"] == 6 and "self.log: 6 calls per step" in facts["summary"], facts["summary"]
            _assert_same_numbers(facts["steps"], ddp_ranks[rank]["steps"], f"{name} rank {rank}")
            _assert_same_numbers(facts["final"], ddp_ranks[rank]["final"], f"{name} rank {rank} final")
        _assert_same_numbers(rows, ddp_csv, f"{name} metrics.csv")


# ------------------------------------------------------------------------------------------------ one process


class _BatchIdxLogger(L.LightningModule):
    """Logs under a branch on ``batch_idx`` and logs a torchmetrics ``Metric`` object."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.mean_out = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.net(batch)
        loss = out.square().mean()
        self.log("loss", loss)
        if batch_idx % 2 == 0:
            self.log("even_loss", loss, on_step=True, on_epoch=True, reduce_fx="sum")
        self.mean_out.update(out.detach().mean())
        self.log("mean_out", self.mean_out, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(3)), batch_size=2)


def _fit_one(folder: str, strategy: Any) -> tuple[list[dict[str, str]], L.Trainer]:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        logger=CSVLogger(folder, name="csv", version=0))
    try:
        trainer.fit(_BatchIdxLogger())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return _logged_rows(folder), trainer


def test_self_log_under_a_batch_idx_branch_logs_what_eager_logs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # one rank, in this process: its TCP store gets a port of its own
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    eager_rows, _ = _fit_one(str(tmp_path / "eager"), StaticDistStrategy())
    rows, trainer = _fit_one(str(tmp_path / "compiled"),
                             StaticDistStrategy(compile={"enabled": True, "backend": "aot_eager"}))
    _assert_same_numbers(rows, eager_rows, "metrics.csv")
    report = trainer.strategy.offer.compile_report
    # the branch on batch_idx is traced, so a new batch_idx recompiles (until dynamo makes it dynamic and guards on
    # `batch_idx % 2`): every recompile says so; no graph break is Lightning's log (the metric's own update may
    # break: its lines are named)
    assert report.recompiles and all("batch_idx" in r for r in report.recompiles), report.summary()
    assert not any("ResultCollection" in reason for reason, _ in report.graph_breaks), report.summary()
