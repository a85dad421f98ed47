"""GPU tests (NCCL). Skipped without CUDA; the 2-GPU test is skipped with fewer than 2 GPUs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

import lightning as L
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning_static_dist import StaticDistStrategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class Adam16(BoringModel):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 256), batch_size=8)


def _fit(strategy: Any, devices: int, precision: str, **kwargs: Any) -> dict[str, torch.Tensor]:
    L.seed_everything(3)
    model = Adam16()
    trainer = L.Trainer(
        accelerator="gpu", devices=devices, strategy=strategy, precision=precision, max_steps=12,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )
    trainer.fit(model)
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_one_gpu_matches_single_device_training(precision: str) -> None:
    # world size 1 over NCCL: the synchroniser still plans, fills and writes back every bucket;
    # 16-mixed exercises the AMP scaler unscaling the synchronised gradients before clipping
    ours = _fit(StaticDistStrategy(start_method="spawn"), 1, precision, gradient_clip_val=0.5)
    theirs = _fit(SingleDeviceStrategy(device=torch.device("cuda", 0)), 1, precision, gradient_clip_val=0.5)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_match_ddp_over_nccl() -> None:
    ours = _fit(StaticDistStrategy(start_method="spawn"), 2, "bf16-mixed")
    theirs = _fit(DDPStrategy(start_method="spawn"), 2, "bf16-mixed")
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)
