"""Faults on the optimizer overlap's path and around ``sync.schedule: auto``'s trial, injected into real 2-rank jobs
(Gloo): a rank killed between two buckets of the optimizer step, a rank that never joins a round's backward-pass
check, a step hook registered after setup, a stop on the trial's last step. Each asserts the exit status, the one line
and that no traceback is printed (issue 46)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from tests.processes.test_faults import failure_lines, lsd_train

pytestmark = pytest.mark.multiprocess

#: the optimizer steps bucket by bucket (the shipped run file clips, which waits for every bucket), in several buckets
BUCKETWISE = ("model.class_path=tests.faulty.BucketwiseCharGPT", "trainer.gradient_clip_val=null",
              "strategy.sync.schedule=after_backward", "strategy.sync.optimizer_overlap=true",
              "strategy.sync.bucket_mb=0.02", "strategy.sync.first_bucket_mb=0.02")


def test_a_rank_killed_between_buckets_of_the_optimizer_step_is_one_line(tmp_path: Any) -> None:
    # rank 1 dies after stepping bucket 0, before waiting for bucket 1. Before (issue 46, 5 runs in 20): Gloo's
    # "Connection reset by peer" traceback from the round's check, which no mark named, and no static_dist line
    code, err, seconds = lsd_train(tmp_path, *BUCKETWISE, "model.fault=kill_between_buckets", "model.fault_rank=1",
                                   "model.fault_step=3")
    assert code == 1, err[-3000:]
    (line,) = failure_lines(err)
    assert re.match(r"static_dist: rank 0: rank 1 stopped participating during .*bucket \d+.* at step [34] \(", line), line
    assert "Traceback" not in err, err[-3000:]
    assert seconds < 60


def _check_without_a_peer(rank: int, world_size: int) -> Any:
    from lightning_static_dist.processes import faults
    from lightning_static_dist.sync.round_check import _RoundCheck

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    seen = None
    if rank == 0:  # rank 1 never joins the check: Gloo's wait fails after the group's timeout
        check = _RoundCheck(own_pass=5, group=group, device=torch.device("cpu"))
        try:
            check.settle("bucket 3")
        except RuntimeError as err:
            seen = (faults.is_collective_failure(err), faults.in_flight())
            faults.forget_failure()
    dist.barrier()  # (the default group: rank 1 waits here until rank 0 has seen its wait fail)
    return seen


def test_the_rounds_backward_pass_check_is_a_marked_collective() -> None:
    # the wait of the round's check (the optimizer step's last, under the overlap) was the one on that path not marked:
    # its Gloo error was not taken for a collective's, and its rank printed a traceback instead of the one line
    seen, _ = run_ranks(_check_without_a_peer)
    assert seen == (True, "the ranks' backward-pass check after bucket 3"), seen


# the two refusals of issue 46 that setup made on every rank, 69-84 lines with a traceback per rank: now the run file
REFUSED = [
    (("strategy.sync.schedule=after_backward", "strategy.sync.optimizer_overlap=true", "trainer.gradient_clip_val=1.0"),
     "lsd-train: error: strategy.sync.optimizer_overlap=True: gradient clipping (trainer.gradient_clip_val=1.0) needs"
     " every bucket's average first; allowed with it: auto (off here), false"),
    (("strategy.compile.enabled=true", "strategy.compile.cudagraphs=true", "trainer.accumulate_grad_batches=2"),
     "lsd-train: error: strategy.compile.cudagraphs=True: trainer.accumulate_grad_batches=2: a micro-batch's gradients"
     " would stay in the graphs' memory"),
]


@pytest.mark.parametrize("overrides, said", REFUSED)
def test_a_refusal_the_trainers_arguments_decide_is_one_line_before_any_rank_starts(
        tmp_path: Any, overrides: tuple[str, ...], said: str) -> None:
    code, err, _ = lsd_train(tmp_path, *overrides)
    assert code == 2, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith(said), line
    assert not (tmp_path / "lightning_logs").exists()  # no logger, no rank: nothing was started


def test_under_the_trainer_api_fit_raises_the_refusal_before_any_rank_starts(tmp_path: Any) -> None:
    import lightning as L

    from lightning_static_dist import StaticDistStrategy
    from lightning_static_dist.config import ConfigError

    class Linear(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

    strategy = StaticDistStrategy(sync={"schedule": "after_backward", "optimizer_overlap": True})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, gradient_clip_val=1.0, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^strategy\.sync\.optimizer_overlap=True: gradient clipping"):
        trainer.fit(Linear(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    assert trainer.strategy.launcher.procs == []  # (rank 1 was never started)


def test_a_step_hook_registered_after_setup_turns_the_overlap_off_in_one_line(tmp_path: Any) -> None:
    # registered in on_train_start, after the check at setup: it ran once per bucket, silently (issue 46: 39 calls in
    # 20 steps). Now the overlap is off from the first step, in one line, and the hook runs once per step
    code, err, _ = lsd_train(tmp_path, *BUCKETWISE, "model.fault=late_step_hook", "trainer.max_steps=4")
    assert code == 0, err[-3000:]
    (line,) = [line for line in err.splitlines() if "optimizer overlap: off" in line]
    assert line.startswith("static_dist: optimizer overlap: off (AdamW has step hooks"), line
    assert line.endswith("found after setup, at step 0)"), line
    calls = dict(re.findall(r"rank (\d) step hook calls (\d+)", err))
    assert calls == {"0": "4", "1": "4"}, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
