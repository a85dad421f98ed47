"""``sync.schedule: measured`` through real Trainers on 2 CPU ranks (Gloo, each rank its own batches), with the probe
asked for (``sync.probe: true``; on CPUs ``auto`` keeps ``overlap`` without probing): the line printed at fit start,
the same choice on every rank, the same weights as Lightning's ``ddp``, and the choice kept across a resume."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning_static_dist.offer import offer_of
from _dist import RankPool
from tests.test_strategy import (Steady, assert_same_weights, ddp, fit, fit_in, rank_reports, static_dist,
                                 write_rank_report)

pytestmark = pytest.mark.multiprocess

PROBED = {"sync": {"probe": True}}


class ChoiceReport(Callback):
    """Writes ``<dir>/rank<N>.json``: the plan's schedule and line, and the measured choice as the offer has it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        choice = offer_of(trainer).measured_schedule()
        plan = trainer.strategy.plan
        facts = {"schedule": plan.sync.schedule, "line": plan.sync.schedule_line,
                 "choice": choice.as_dict() if choice is not None else None}
        write_rank_report(self.directory, trainer.global_rank, facts)


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    with RankPool(2) as pool:
        yield pool


def test_the_probe_prints_its_choice_and_every_rank_trains_as_ddp(tmp_path: Any, capfd: Any) -> None:
    theirs, _ = fit(Steady, ddp(), max_epochs=1, max_steps=-1)
    ours, _ = fit(Steady, static_dist(**PROBED), max_epochs=1, max_steps=-1, callbacks=[ChoiceReport(str(tmp_path))])
    assert_same_weights(ours, theirs)
    reports = rank_reports(tmp_path)
    assert reports[0]["choice"] == reports[1]["choice"]  # the slowest rank's figures: every rank chose alike
    choice = reports[0]["choice"]
    assert choice["source"] == "probe" and choice["world"] == 2 and choice["device_type"] == "cpu"
    assert reports[0]["schedule"] == choice["choice"].split("/")[0] in ("overlap", "after_backward")
    lines = [line for line in capfd.readouterr().err.splitlines() if "sync.schedule measured:" in line]
    assert len(lines) == 1 and lines[0] == f"static_dist: {reports[0]['line']}", lines
    assert lines[0].startswith(f"static_dist: sync.schedule measured: {choice['choice']} (probe ")
    for name in choice["predicted_ms"]:
        assert name in lines[0]  # the evidence: every candidate's prediction


def test_on_cpus_the_default_keeps_overlap_without_a_probe(ranks: RankPool, tmp_path: Any) -> None:
    fit_in(ranks, Steady, "static_dist", {}, max_steps=2, callbacks=[ChoiceReport(str(tmp_path))])
    for report in rank_reports(tmp_path):
        assert report["schedule"] == "overlap" and report["choice"] is None
        assert report["line"].startswith("sync.schedule measured: overlap (CPU ranks:")


def test_a_resumed_run_in_the_same_world_applies_the_saved_choice_without_probing(ranks: RankPool,
                                                                                   tmp_path: Any) -> None:
    straight, _ = fit_in(ranks, Steady, "static_dist", PROBED, max_epochs=2, max_steps=-1)
    fit_in(ranks, Steady, "static_dist", PROBED, max_epochs=1, max_steps=-1, default_root_dir=str(tmp_path / "a"),
           enable_checkpointing=True, callbacks=[ChoiceReport(str(tmp_path / "a"))])
    first = rank_reports(tmp_path / "a")[0]["choice"]
    ckpt = next((tmp_path / "a").rglob("*.ckpt"))
    assert torch.load(ckpt, weights_only=False)["static_dist_sync_schedule_measured"]["choice"] == first["choice"]
    os.makedirs(tmp_path / "b")
    resumed, _ = fit_in(ranks, Steady, "static_dist", PROBED, max_epochs=2, max_steps=-1, ckpt_path=str(ckpt),
                        callbacks=[ChoiceReport(str(tmp_path / "b"))])
    for report in rank_reports(tmp_path / "b"):
        again = report["choice"]
        assert (again["choice"], again["source"], again["probe_s"]) == (first["choice"], "checkpoint", 0.0)
        assert again["predicted_ms"] == first["predicted_ms"]
        assert "from the checkpoint, not probed again" in report["line"]
    assert_same_weights(resumed, straight)  # the schedule changes when the buckets go, never what they average
