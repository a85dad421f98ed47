"""Resuming from a mid-epoch checkpoint continues bit for bit (issue 27, item 2): the same weights and the same logged
losses as the run that was never interrupted, on 2 Gloo ranks through ``lsd-train``, each rank with its own data.

Before, the example's loader kept no position: Lightning restarted the resumed epoch from its first batch, and the
curves parted (the same under ``ddp``). A user's plain ``DataLoader`` still does that; the strategy says so in one line.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import fresh_job_env
from tests.test_resume import REPO, TINY, lsd_train

#: an epoch of 8 batches per rank (133 windows of 33 bytes, 67 per rank): 12 steps cross into the second epoch
SHORT_EPOCHS = ["data.max_bytes=4500", "trainer.log_every_n_steps=1", "callbacks.model_checkpoint.every_n_train_steps=6"]


def ddp_train(root: Path, *args: str) -> str:
    """The same job as :func:`lsd_train`'s under Lightning's ``ddp`` (tests/_ddp_run.py); its output."""
    cmd = [sys.executable, str(REPO / "tests" / "_ddp_run.py"), "charlm_cpu", *TINY, f"trainer.default_root_dir={root}",
           *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**fresh_job_env(), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def losses(root: Path) -> dict[int, str]:
    """``train_loss`` by step over every version folder of a run (as written: compared as text, exactly)."""
    found: dict[int, str] = {}
    for path in sorted(root.glob("lightning_logs/version_*/metrics.csv")):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("train_loss"):
                    found[int(row["step"])] = row["train_loss"]
    return found


def final_weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    (path,) = root.glob(f"lightning_logs/version_*/checkpoints/*-step={step}.ckpt")
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("train", [lsd_train, pytest.param(ddp_train, marks=pytest.mark.slow)],
                         ids=["static_dist", "ddp"])
def test_a_run_resumed_mid_epoch_ends_as_the_uninterrupted_run_did(tmp_path: Path, train) -> None:
    """12 steps at once, against 6 steps, then resumed from the step-6 checkpoint (batch 6 of an 8-batch epoch) to 12:
    the same weights, bit for bit, and the same loss at every step, the epoch boundary after the resume included.
    Under Lightning's ddp too: the position is the data module's, whatever the strategy."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(whole, *SHORT_EPOCHS, "trainer.max_steps=12")
    train(parts, *SHORT_EPOCHS, "trainer.max_steps=6")
    out = train(parts, *SHORT_EPOCHS, "trainer.max_steps=12", "ckpt_path=last")
    assert "epoch=0-step=6.ckpt" in out

    expected, resumed = losses(whole), losses(parts)
    assert sorted(expected) == list(range(12)), expected
    assert resumed == expected
    weights, resumed_weights = final_weights(whole, 12), final_weights(parts, 12)
    assert weights.keys() == resumed_weights.keys()
    differ = [name for name in weights if not torch.equal(weights[name], resumed_weights[name])]
    assert not differ, f"weights differ after the resume: {differ}"
    assert "resumed mid-epoch" not in out  # the example's loader keeps its place: nothing to warn of


@pytest.mark.multiprocess
def test_a_mid_epoch_resume_from_a_plain_dataloader_says_it_is_not_exact(tmp_path: Path) -> None:
    plain = ["data.class_path=_plain_loader.PlainLoaderData", *SHORT_EPOCHS]
    lsd_train(tmp_path, *plain, "trainer.max_steps=6")
    out = lsd_train(tmp_path, *plain, "trainer.max_steps=8", "ckpt_path=last")
    lines = [line for line in out.splitlines() if "resumed mid-epoch" in line]
    assert lines == ["static_dist: resumed mid-epoch (epoch 0, batch 6, step 6) with a training loader that keeps no"
                     " position (DataLoader has no state_dict/load_state_dict): its epoch starts again from the first"
                     " batch, so the run does not continue bit for bit"], out[-3000:]


def test_a_position_saved_at_another_world_size_or_batch_size_restarts_the_epoch_and_says_so(
        capfd: pytest.CaptureFixture[str]) -> None:
    # a position in batches names the same samples only in the same geometry: 2 ranks x 4 then, 1 x 4 or 2 x 8 now
    # would repeat or skip samples silently; the epoch starts again instead, with one line
    import torch
    from torch.utils.data import TensorDataset

    from lightning_static_dist.examples.charlm import ResumableLoader, ResumableSampler

    data = TensorDataset(torch.arange(64))

    def loader(replicas: int, batch: int) -> ResumableLoader:
        return ResumableLoader(data, batch_size=batch, sampler=ResumableSampler(data, replicas, 0, seed=3), drop_last=True)

    saved = {**loader(2, 4).state_dict(), "batches": 3}
    same = loader(2, 4)
    same.load_state_dict(saved)
    whole = [b[0].tolist() for b in loader(2, 4)]
    assert [b[0].tolist() for b in same] == whole[3:]  # the same geometry: where it stopped
    for replicas, batch in ((1, 4), (2, 8)):
        other = loader(replicas, batch)
        other.load_state_dict(saved)
        assert len(list(other)) == len(other)  # the whole epoch
        assert "at another world size or batch size (2 x 4 then" in capfd.readouterr().err
