"""``sync.mode: graph`` (:mod:`lightning_static_dist.sync.graph`): the gradient averaging traced into the compiled
graph. Ranks that compiled different graphs stop before any collective, graph mode needs compile and still averages
when a region falls back to eager, identical blocks keep one class, and freezing during fit is refused by name.
(Graph mode against Lightning's ``ddp`` is in test_compile.py, beside the default compile.)"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional

import pytest
import torch
from torch import nn

import lightning as L
from _dist import fit_on_ranks, on_joined_ranks, run_ranks
from lightning.pytorch.strategies import DDPStrategy
# importing test_compile also registers its "lsd_test_failing" backend (here and in every spawned rank)
from tests.compile.test_compile import CompileFacts, nested_gpt
from lightning_static_dist import StaticDistStrategy
from lightning_static_dist.compile import compile_regions
from lightning_static_dist.compile.config import CompileConfig


class RankBranch(L.LightningModule):
    """Rank 0 uses a branch that rank 1 never touches: fine for hooks, not for a static traced graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        h = self.a(batch[0])
        if self.global_rank == 0:
            h = self.b(h)
        return h.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)


def _trainer(strategy: Any, max_steps: int = 3) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _refused_fit(options: dict[str, Any], model_class: type) -> str:
    """This rank's fit of ``model_class()`` under ``static_dist`` with ``options``: what it raised."""
    try:
        _trainer(StaticDistStrategy(**options)).fit(model_class())
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


@pytest.mark.multiprocess
def test_graph_mode_stops_ranks_that_compiled_different_graphs_before_any_collective() -> None:
    options = {"sync": {"mode": "graph"}, "compile": {"enabled": True, "backend": "aot_eager"}, "timeout_s": 60}
    for said in on_joined_ranks(_refused_fit, options, RankBranch):
        assert re.search(r"sync.mode=graph needs every rank to compile the same graphs .* ranks disagree"
                         r" on what they compiled .*strategy.sync.mode=hooks", said), said


class Dense(RankBranch):
    """Both layers on every rank (defined here, so spawned ranks import this module and its test backend)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.b(self.a(batch[0])).square().mean()


@pytest.mark.multiprocess
def test_graph_mode_needs_compile_and_an_eager_fallback_still_averages(tmp_path: Any) -> None:
    for said in on_joined_ranks(_refused_fit, {"sync": {"mode": "graph"}}, Dense):
        assert re.search(r"strategy.sync.mode='graph': .* needs strategy.compile.enabled=true", said), said
    # a backend that cannot compile: the step runs eagerly, each parameter read still averaged (one collective
    # per read), and the compile report says so — slow, never silent
    facts_path = str(tmp_path / "facts.json")
    failing = functools.partial(StaticDistStrategy, sync={"mode": "graph"},
                                compile={"enabled": True, "backend": "lsd_test_failing"})
    ours = fit_on_ranks(_fit_dense, failing, facts_path)
    reference = fit_on_ranks(_fit_dense, DDPStrategy)
    for name, a in reference.items():
        torch.testing.assert_close(ours[name], a, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    with open(facts_path) as f:
        facts = json.load(f)
    assert "cannot compile anything" in facts["fallbacks"]["<training_step>"] and facts["graph_rounds"] == 3


def _fit_dense(make_strategy: Any, facts_path: Optional[str] = None) -> dict[str, torch.Tensor]:
    trainer = _trainer(make_strategy())
    if facts_path is not None:
        trainer.callbacks.append(CompileFacts(facts_path))
    L.seed_everything(0)
    model = Dense()
    trainer.fit(model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _graph_sync_on_blocks(rank: int, world: int) -> dict[str, Any]:
    from lightning_static_dist.sync.graph import GraphSynchronizer

    model = nested_gpt()
    classes = [type(block) for block in model.trunk.h]
    sync = GraphSynchronizer(model)
    sync.attach()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", regional=True))
    model.training_step(next(iter(model.train_dataloader())), 0).backward()
    facts = {"one_class": len({type(block) for block in model.trunk.h}) == 1, "graphs": len(report.graphs),
             "recompiles": report.recompiles, "weight_is_parameter": isinstance(model.head.weight, nn.Parameter)}
    model.unused.requires_grad_(False)  # (through parameters(): `model.unused.weight` is the identity's output)
    try:
        sync.check_trainable()
    except RuntimeError as err:
        facts["frozen"] = str(err)
    sync.detach()
    facts["restored"] = [type(block) for block in model.trunk.h] == classes and isinstance(model.head.weight, nn.Parameter)
    return facts


@pytest.mark.multiprocess
def test_graph_mode_keeps_one_class_per_block_kind_and_refuses_freezing_during_fit() -> None:
    (facts,) = run_ranks(_graph_sync_on_blocks, 1)
    # identical blocks share one swapped class: dynamo compiles them once, with no recompile per block
    assert facts["one_class"] and facts["graphs"] == 1 and facts["recompiles"] == [], facts
    assert not facts["weight_is_parameter"]  # a read goes through the averaging identity
    assert "'unused.weight' was frozen during fit" in facts["frozen"] and facts["restored"], facts
