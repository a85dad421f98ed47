"""Models as users bring them (tiny GPT-2, BERT with padded masked batches, Llama, a BatchNorm CNN: ``tests/_user_models.py``),
a loader that leaves a short last batch and, for text, a sequence length that varies by batch and by rank: static_dist
trains what Lightning's ``ddp`` trains. Eager: the same weights to the bit; compiled with the defaults (aot_eager): the
weights of ``ddp`` + ``torch.compile`` with the same backend, within 1e-5, with at most two graphs for the varying
length (the static one and the dynamic one) and one for the short last batch."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
from _dist import fit_on_ranks
from _user_models import UserModel, state
from lightning.pytorch.strategies import DDPStrategy

from lightning_static_dist import StaticDistStrategy

RUNS = {
    "ddp": (DDPStrategy, False),
    "static_dist": (StaticDistStrategy, False),  # the default on a CPU: not compiled
    "ddp + torch.compile": (DDPStrategy, True),
    "static_dist compiled": (functools.partial(StaticDistStrategy, compile={"enabled": True, "backend": "aot_eager"}), False),
}


def _fits(kind: str) -> dict[str, Any]:
    """On each rank, the four fits of one model, 2 epochs of 3 steps each: the final weights, and what static_dist's
    compile report says."""
    out: dict[str, Any] = {}
    for name, (strategy, user_compiles) in RUNS.items():
        torch._dynamo.reset()  # (each compiled fit as in a fresh process: dynamo remembers sizes per code object)
        model = UserModel(kind)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy(), max_epochs=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(torch.compile(model, backend="aot_eager") if user_compiles else model)
        assert trainer.global_step == 6, f"{name}: {trainer.global_step} steps (a batch was dropped?)"
        out[name] = state(model)
        report = trainer.strategy.offer.compile_report if name == "static_dist compiled" else None
        if report is not None:
            out["facts"] = {"graphs": report.graph_count(), "tail": report.graph_count(tail=True),
                            "dynamic": report.graph_count(dynamic=True), "recompiles": report.recompiles,
                            "eager": report.eager_calls, "summary": report.summary()}
    return out


@pytest.fixture(scope="module", params=["gpt2", "bert", "llama", "cnn"])
def fits(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, fit_on_ranks(_fits, request.param)


@pytest.mark.multiprocess
def test_models_users_bring_train_as_under_ddp_eager_and_compiled(fits: tuple[str, dict[str, Any]]) -> None:
    kind, runs = fits
    for key, theirs in runs["ddp"].items():
        assert torch.equal(runs["static_dist"][key], theirs), f"{kind} eager, {key}: differs from ddp's"
        torch.testing.assert_close(runs["static_dist compiled"][key], runs["ddp + torch.compile"][key], atol=1e-5,
                                   rtol=1e-5, msg=lambda m, key=key: f"{kind} compiled, {key}: {m}")
    facts = runs["facts"]
    # the short last batch: one graph of its own, not a recompile; nothing ran eagerly
    assert facts["tail"] == 1 and facts["eager"] == {}, facts["summary"]
    assert "the short last batch (2 rows) runs its own graph" in facts["summary"]
    if kind == "cnn":  # one image size: the full batches' graph and the tail's, static
        assert facts["graphs"] == 2 and facts["dynamic"] == 0 and facts["recompiles"] == [], facts["summary"]
    else:  # the sequence length varies: the static graph, then one dynamic in it (and the tail's)
        assert facts["graphs"] - facts["tail"] <= 2 and len(facts["recompiles"]) <= 1, facts["summary"]
        # the ranks' first batches are padded to other lengths: said, and the graph check lets the run go on
        assert "the ranks compiled their step for different input shapes (rank 0: (4, 12)" in facts["summary"]
