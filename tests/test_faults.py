"""Faults injected into real 2-rank ``lsd-train`` jobs (Lightning's subprocess launcher, Gloo): a rank killed, a rank
that stops participating, a NaN gradient on one rank, a process killed while saving a checkpoint. Each test bounds
the wall time and asserts the exit code, the one-line message and what is left on disk."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from _dist import fresh_job_env

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "model.class_path=tests.faulty.FaultyCharGPT", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
    "model.block_size=32", "data.block_size=32", "data.batch_size=4", "data.max_bytes=100000",
    "trainer.max_steps=12", "trainer.val_check_interval=null", "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1", "callbacks.overlap_monitor.enabled=false",
]


def lsd_train(tmp: Any, *overrides: str, timeout: float = 120, config: str = "charlm_cpu",
              launch: Sequence[str] = ()) -> tuple[int, str, float]:
    """Run the real console script (or ``launch`` + ``python -m lightning_static_dist``, e.g. torchrun's command) on
    a shipped run file; return (exit code, stderr, seconds). The job runs in a session of its own, killed whole when
    it ends or times out: a rank left behind (a stuck one holds the pipe) cannot outlive the test."""
    script = [*launch, "-m", "lightning_static_dist"] if launch else [os.path.join(os.path.dirname(sys.executable), "lsd-train")]
    cmd = [*script, os.path.join(ROOT, "configs", f"{config}.yaml"), *TINY, f"trainer.default_root_dir={tmp}", *overrides]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=fresh_job_env(), start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err, time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("static_dist: rank ")]


def test_a_killed_rank_stops_the_survivor_with_one_line(tmp_path: Any) -> None:
    code, err, seconds = lsd_train(tmp_path, "model.fault=kill", "model.fault_rank=1", "model.fault_step=3")
    assert code == 1
    (line,) = failure_lines(err)
    assert line.startswith("static_dist: rank 0: rank 1 stopped participating during ") and "at step 3" in line, line
    assert "Traceback" not in err and "Child process" not in err, err[-2000:]  # the launcher's grace period held
    assert seconds < 60


@pytest.mark.slow  # waits out an 8 s collective timeout (the killed-rank cases stay in the default run)
def test_a_rank_that_stops_participating_times_out_with_one_line(tmp_path: Any) -> None:
    code, err, seconds = lsd_train(tmp_path, "model.fault=hang", "model.fault_rank=1", "model.fault_step=3",
                                   "strategy.timeout_s=8")
    assert code != 0
    (line,) = failure_lines(err)
    assert line.startswith("static_dist: rank 0: rank 1 stopped participating during ") and "at step 3" in line, line
    assert "Traceback" not in err, err[-2000:]
    assert 8 <= seconds < 60  # the collective timeout, then a clean exit


def test_killing_rank_zero_stops_rank_one_with_one_line(tmp_path: Any) -> None:
    code, err, seconds = lsd_train(tmp_path, "model.fault=kill", "model.fault_rank=0", "model.fault_step=3")
    assert code == -9  # the launching process itself was killed
    (line,) = failure_lines(err)
    assert line.startswith("static_dist: rank 1: rank 0 (the host of the rendezvous store) is gone during "), line
    assert seconds < 60


@pytest.mark.parametrize("signalled", [0, pytest.param(1, marks=pytest.mark.slow)])  # (both: tests/test_host_syncs.py)
def test_a_sigterm_on_any_rank_stops_every_rank_at_the_same_step(tmp_path: Any, signalled: int) -> None:
    # the ranks' flags combined (their maximum), read LAG steps after the round that carries them: one rank
    # signalled at step 3 (rank 0's handler also forwards the signal to rank 1, as Lightning's does) -> both start
    # the same step last, at most 3 + LAG, and leave through Lightning's SIGTERMException (a SystemExit without a code: exit 0, as
    # under ddp). Before, a rank signalled alone stopped alone at the end of its batch, leaving the other in a collective
    from lightning_static_dist.loop import LAG

    code, err, seconds = lsd_train(tmp_path, "model.fault=sigterm", f"model.fault_rank={signalled}", "model.fault_step=3")
    last = {rank: max(int(line.rsplit(" ", 1)[1]) for line in err.splitlines() if line.startswith(f"rank {rank} starts step "))
            for rank in (0, 1)}
    assert code == 0, err[-2000:]
    # the same step on both; the latest the round started at step 4 allows, or one earlier when the forwarded signal
    # reached a rank still before its step-3 round (the maximum then already carries it)
    assert last[0] == last[1] and 3 + LAG - 1 <= last[0] <= 3 + LAG, last
    assert seconds < 60


def test_a_sigterm_during_validation_stops_every_rank_after_it(tmp_path: Any) -> None:
    # no flag round runs in validation: the ranks agree at its end (the strategy's on_validation_end), and every rank
    # stops before the next training step; Lightning's own check would have stopped rank 1 mid-validation alone
    code, err, seconds = lsd_train(tmp_path, "model.fault=sigterm_in_val", "model.fault_rank=1", "model.fault_step=4",
                                   "trainer.val_check_interval=4", "trainer.limit_val_batches=3")
    last = {rank: max(int(line.rsplit(" ", 1)[1]) for line in err.splitlines() if line.startswith(f"rank {rank} starts step "))
            for rank in (0, 1)}
    assert code == 0, err[-2000:]
    assert last == {0: 3, 1: 3}, last
    assert seconds < 60


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_a_nan_gradient_on_one_rank_is_skipped_or_named_on_every_rank(tmp_path: Any, policy: str) -> None:
    code, err, _ = lsd_train(tmp_path, "model.fault=nan", "model.fault_rank=1", "model.fault_step=3", "model.save_every=12",
                             f"strategy.sync.nonfinite={policy}")
    if policy == "error":
        assert code != 0
        assert "FloatingPointError: static_dist: non-finite gradient at step 3, first offending parameter 'wte.weight'" in err
        return
    assert code == 0, err[-2000:]
    assert "non-finite gradient at step 3 (first: 'wte.weight'); optimizer step skipped on every rank" in err
    state = torch.load(os.path.join(tmp_path, "ckpt", "last.ckpt"), weights_only=True)
    assert state["global_step"] == 12
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path: Any) -> None:
    code, err, seconds = lsd_train(tmp_path, "model.fault=kill_in_save", "model.fault_rank=0", "model.fault_step=4",
                                   "model.save_every=2")
    assert code == -9
    directory = os.path.join(tmp_path, "ckpt")
    assert os.listdir(directory) == ["last.ckpt"]  # no half-written file beside it
    state = torch.load(os.path.join(directory, "last.ckpt"), weights_only=True)
    assert state["global_step"] == 2 and "poison" not in state
    (line,) = failure_lines(err)  # rank 1, left alone, says so
    assert line.startswith("static_dist: rank 1: rank 0 (the host of the rendezvous store) is gone during "), line
    assert seconds < 60
