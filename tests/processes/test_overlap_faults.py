"""Faults on the optimizer overlap's path and around ``sync.schedule: auto``'s trial, injected into real 2-rank jobs
(Gloo): a rank killed between two buckets of the optimizer step, a rank that never joins a round's backward-pass
check, a step hook registered after setup, a stop on the trial's last step. Each asserts the exit status, the one line
and that no traceback is printed (issue 46)."""

from __future__ import annotations

import json
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
    from lightning_static_dist.agreement import faults
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


AUTO = ("strategy.sync.schedule=auto", "strategy.sync.schedule_trial_steps=3")  # 2 candidates on Gloo: steps 0-5


def test_a_rank_killed_inside_the_schedule_trials_decision_is_one_line(tmp_path: Any) -> None:
    code, err, seconds = lsd_train(tmp_path, *AUTO, "model.fault=kill_in_schedule_decision", "model.fault_rank=1")
    assert code == 1, err[-3000:]
    assert "rank 1 dies deciding at step" in err, err[-3000:]
    (line,) = failure_lines(err)
    assert re.match(r"static_dist: rank 0: rank 1 stopped participating during the all-reduce of an auto trial's"
                    r" step times at step [56] \(", line), line
    assert "Traceback" not in err, err[-3000:]
    assert seconds < 60


def _saved_schedule(path: str) -> dict[str, Any]:
    return torch.load(path, weights_only=True)["static_dist_sync_schedule"]


def _stopped_at(err: str) -> tuple[int, str]:
    found = re.findall(r"static_dist: SIGTERM: every rank stopped at step (\d+); checkpoint (.+); exiting", err)
    assert len(found) == 1, err[-4000:]
    return int(found[0][0]), found[0][1]


def test_a_stop_on_the_trials_last_step_keeps_its_choice_and_resumes_as_a_straight_run(tmp_path: Any) -> None:
    # rank 1's SIGTERM at step 3 stops every rank before step 6: the trial's last step (2 candidates x 3) is 5. Before
    # (issue 46) the choice was made at the next batch's start, which the stop never reached: no choice was saved,
    # and the resume timed every candidate again, saying nothing of a choice
    run = (*AUTO, "model.save_every=8", "trainer.max_steps=8")
    code, err, _ = lsd_train(tmp_path / "straight", *run, "model.fault=print_steps")
    assert code == 0, err[-3000:]
    code, err, _ = lsd_train(tmp_path / "resumed", *run, "model.fault=sigterm", "model.fault_rank=1", "model.fault_step=3")
    assert code == 143, err[-3000:]
    step, path = _stopped_at(err)
    assert step == 6 and _saved_schedule(path)["choice"] is not None, (step, err[-3000:])
    assert "weights_only" not in err, err[-3000:]  # (Lightning's log line, once per rank, before the stop's line)
    code, err, _ = lsd_train(tmp_path / "resumed", *run, "model.fault=print_steps", "ckpt_path=last")
    assert code == 0, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("static_dist: sync.schedule auto:")]
    assert re.match(r"static_dist: sync\.schedule auto: \S+, the resumed checkpoint's choice \(not timed again: ", line)
    assert "Traceback" not in err, err[-3000:]
    straight, resumed = (torch.load(tmp_path / run_dir / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
                         for run_dir in ("straight", "resumed"))
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_a_trial_a_stop_interrupted_is_counted_in_the_resumed_runs_cost(tmp_path: Any) -> None:
    # a stop before the trial's last step (2 candidates x 4: steps 0-7) saves what it cost so far; the resumed fit
    # times every candidate again and its summary keeps both trials' costs (before: the second trial's alone)
    run = ("strategy.sync.schedule=auto", "strategy.sync.schedule_trial_steps=4", "trainer.max_steps=14")
    code, err, _ = lsd_train(tmp_path, *run, "model.fault=sigterm", "model.fault_rank=1", "model.fault_step=3")
    step, path = _stopped_at(err)
    saved = _saved_schedule(path)
    assert (code, step, saved["choice"], saved["trial_steps"]) == (143, 6, None, 6), (saved, err[-3000:])
    code, err, _ = lsd_train(tmp_path, *run, "model.fault=print_steps", "ckpt_path=last")
    assert code == 0, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("static_dist: sync.schedule auto:")]
    assert "the trial took 8 steps (2 candidates x 4)" in line and "stopped inside (6 steps" in line, line
    assert ": 14 steps, " in line, line
    (summary,) = tmp_path.glob("lightning_logs/version_1/summary.json")
    facts = json.loads(summary.read_text())
    assert facts["sync_schedule_trial_steps"] == 14 and facts["sync_schedule_trial_s"] > saved["trial_s"], facts
