"""``RunSummary``'s console output as a user sees it: one Trainer in this process, no process group.

Progress lines once per optimizer step, timed per optimizer step; the end-of-run table whether or not a progress bar
ran (its bar is closed by then); nothing printed when Lightning's messages are silenced.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_static_dist import callbacks
from lightning_static_dist.callbacks import RunSummary, batch_size_of


class TickingClock:
    """``time`` for the callbacks module: each ``perf_counter()`` call is 5 ms after the previous one, so a
    micro-batch (one call at its start, one at its end) takes exactly 5 ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.005
        return self.now


def fit(tmp_path: Any, progress_bar: bool, **trainer_kwargs: Any) -> None:
    L.seed_everything(0)
    summary = RunSummary(warmup_steps=0, print_every_n_steps=2)
    # Lightning appends its bar after the user's callbacks (as under lsd-train): the bar closes in its on_train_end
    # after the summary's, and the table is printed in on_fit_end, below the bar's last line
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=progress_bar, limit_val_batches=0,
        default_root_dir=str(tmp_path), callbacks=[summary], **trainer_kwargs,
    )
    assert not progress_bar or isinstance(trainer.callbacks[-1], TQDMProgressBar)
    trainer.fit(BoringModel())


@pytest.mark.parametrize("progress_bar", [False, True], ids=["plain", "tqdm"])
def test_progress_lines_once_per_optimizer_step_under_accumulation(
    tmp_path: Any, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch, progress_bar: bool,
) -> None:
    monkeypatch.setattr(callbacks, "time", TickingClock())
    fit(tmp_path, progress_bar, accumulate_grad_batches=2)
    out = "".join(capfd.readouterr()) + caplog.text  # above a TQDM bar: its stream; else Lightning's INFO log
    lines = re.findall(r"step \d+/4  .*? samples/s", out)
    # 8 micro-batches, 4 optimizer steps of 2 x 5 ms each: a line at steps 2 and 4, each printed once
    assert [line.split("  ")[0] for line in lines] == ["step 2/4", "step 4/4"], out
    # BoringModel's batches are rows of 32 floats, not tokens: 2 micro-batches of 1 sample in 10 ms
    assert all("10.0 ms/step" in line and "200 samples/s" in line for line in lines), lines
    assert "samples_per_s" in out and "tokens" not in out, out  # the table too
    # the table printed in on_fit_end, after the progress bar's own on_train_end closed its bar: nothing of the bar after it
    assert "lightning-static-dist run summary" in out, out
    assert "it/s" not in out[out.index("lightning-static-dist run summary"):], out


def test_nothing_is_printed_when_lightnings_messages_are_silenced(
    tmp_path: Any, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # setLevel, not the attribute: it clears the loggers' level caches
    try:
        fit(tmp_path, progress_bar=True)  # the progress lines would go through the open bar
    finally:
        lightning_log.setLevel(level)
    out = "".join(capfd.readouterr()) + caplog.text
    assert "step 2/4" not in out and "run summary" not in out, out


def test_a_batch_is_counted_in_tokens_only_when_it_holds_token_ids() -> None:
    ids = torch.zeros(4, 16, dtype=torch.long)  # (batch, sequence) of token ids
    assert batch_size_of((ids, ids)) == (64, "tokens")
    assert batch_size_of({"input_ids": ids}) == (64, "tokens")
    assert batch_size_of(torch.randn(4, 3, 8, 8)) == (4, "samples")  # images
    assert batch_size_of(torch.zeros(4, 3, 8, 8, dtype=torch.uint8)) == (4, "samples")  # images as bytes
    assert batch_size_of([torch.randn(4, 32), torch.ones(4)]) == (4, "samples")  # feature rows
    assert batch_size_of(torch.arange(4)) == (4, "samples")  # class labels, one per sample
    assert batch_size_of("text") == (0, "samples")
