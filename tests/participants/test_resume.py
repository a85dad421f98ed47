"""MidEpochResume on real single-device fits: a fit resumed mid-epoch from a loader that keeps no position says so
in one line, at its first batch only; a fit from the start, a loader that keeps its position, and Fabric (no
``Trainer`` loop) say nothing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_static_dist.participants.resume import MidEpochResume, is_resumable

from ._view import Context, Regression, View

DATA = TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)), torch.randn(32, 1))  # 8 batches


class Positioned(DataLoader):
    """A loader that keeps its position (what Lightning tests for: ``state_dict`` and ``load_state_dict``)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Driving(L.Callback):
    """Drives the participant from the Trainer's own hooks, as the strategy's setup and batch start do."""

    def __init__(self, participant: MidEpochResume, view: View) -> None:
        self.participant, self.view = participant, view

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.participant.setup(self.view.enter(Context(global_step=trainer.global_step, trainer_loop=trainer)))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.participant.on_train_batch_start()


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """What rank 0 prints through Lightning's rank-zero logger during the test (``rank_zero_info``)."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero")
    return caplog


def _fit(root: Path, loader: type[DataLoader], max_steps: int, ckpt_path: Optional[Path] = None) -> None:
    """A fit to ``max_steps`` that writes ``mid.ckpt`` at step 3 (batch 3 of the epoch's 8)."""
    model = Regression()
    view = View(model)
    checkpoint = ModelCheckpoint(dirpath=root, filename="mid", every_n_train_steps=3, save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
                        callbacks=[Driving(MidEpochResume(view), view), checkpoint])
    trainer.fit(model, train_dataloaders=loader(DATA, batch_size=4), ckpt_path=ckpt_path)


def _resumed(root: Path, loader: type[DataLoader]) -> None:
    """3 steps with a checkpoint at step 3, and a fit resumed from it to step 5."""
    _fit(root, loader, max_steps=3)
    _fit(root, loader, max_steps=5, ckpt_path=root / "mid.ckpt")


def _said(lines: pytest.LogCaptureFixture) -> list[str]:
    return [line for line in lines.messages if "resumed mid-epoch" in line]


def test_a_mid_epoch_resume_from_a_plain_loader_says_so_once(tmp_path: Path, lines: pytest.LogCaptureFixture) -> None:
    _resumed(tmp_path, DataLoader)
    assert _said(lines) == ["static_dist: resumed mid-epoch (epoch 0, batch 3, step 3) with a training loader that"
                            " keeps no position (DataLoader has no state_dict/load_state_dict): its epoch starts again"
                            " from the first batch, so the run does not continue bit for bit"]


def test_a_loader_that_keeps_its_position_or_a_fit_from_the_start_says_nothing(
        tmp_path: Path, lines: pytest.LogCaptureFixture) -> None:
    _resumed(tmp_path / "positioned", Positioned)
    _fit(tmp_path / "fresh", DataLoader, max_steps=3)
    assert _said(lines) == []


def test_fabric_has_no_loop_to_read_and_says_nothing(lines: pytest.LogCaptureFixture) -> None:
    participant = MidEpochResume(View(Regression()))
    participant.setup(Context(global_step=3))  # Fabric: trainer_loop is None
    participant.on_train_batch_start()
    assert _said(lines) == []


def test_a_loader_is_resumable_with_both_methods_only() -> None:
    assert is_resumable(Positioned(DATA)) and not is_resumable(DataLoader(DATA))

    class SavesOnly(DataLoader):
        def state_dict(self) -> dict[str, Any]:
            return {}

    assert not is_resumable(SavesOnly(DATA))
