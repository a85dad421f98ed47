"""Preemption on real 2-rank Gloo jobs: SIGTERM through a plain Trainer script (``lsd-train``'s cases are in
``tests/processes/test_faults.py``), and SLURM's requeue signal (SIGUSR1, Lightning's auto-requeue) in a fake SLURM environment:
the ranks started as ``srun`` starts them, a stub ``scontrol`` on ``PATH`` that records its calls."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from _dist import fresh_job_env, free_port
from tests.processes.test_faults import ROOT, TINY, stopped_with_checkpoint

pytestmark = pytest.mark.multiprocess


def test_a_sigterm_stops_a_plain_trainer_script_with_a_checkpoint_and_status_143(tmp_path: Any) -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_preempted_script.py"), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env=fresh_job_env(), timeout=150)
    step = stopped_with_checkpoint(proc.returncode, proc.stderr)  # Lightning 2.6 alone: status 0, no checkpoint
    assert 4 <= step <= 6, proc.stderr[-3000:]
    assert time.monotonic() - started < 120


def _slurm_job(tmp_path: Any, *overrides: str, timeout: float = 150) -> tuple[list[int], str]:
    """Both ranks of an ``lsd-train`` job as ``srun`` starts them (job 4242, one node, 2 tasks); (exit codes, stderr of
    both). Each rank in a session of its own, killed when the job ends or times out."""
    port = str(free_port())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    cmd = [os.path.join(os.path.dirname(sys.executable), "lsd-train"), os.path.join(ROOT, "configs", "charlm_cpu.yaml"),
           *TINY, f"trainer.default_root_dir={tmp_path / 'run'}", *overrides]
    procs = []
    for rank in (0, 1):
        env = {**fresh_job_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1",
               "SLURM_NODELIST": "localhost", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
               "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env=env, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        errs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[1] for proc in procs]
        return [proc.returncode for proc in procs], "".join(errs)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def test_slurms_requeue_signal_saves_at_the_agreed_step_and_requeues_once(tmp_path: Any) -> None:
    # SIGUSR1 reaches rank 0 inside training_step and rank 1 inside on_after_backward of step 3. Lightning's handler
    # would write the hpc checkpoint (a collective here) right there, each rank at another point of the step: the
    # ranks' collectives cross and the job hangs. Deferred to the step the ranks agree on, as SIGTERM is: every rank
    # writes it there, rank 0 requeues once (the two signals are one request), and training goes on to its end
    codes, err = _slurm_job(tmp_path, "model.fault=sigusr1", "model.fault_step=3")
    assert codes == [0, 0], err[-4000:]
    (line,) = [line for line in err.splitlines() if line.startswith("static_dist: requeue signal")]
    found = re.match(r"static_dist: requeue signal \(SIGUSR1\): every rank saved (\S+) at step (\d+); job requeued", line)
    assert found, line
    path, step = found[1], int(found[2])
    assert path == str(tmp_path / "run" / "hpc_ckpt_1.ckpt") and 4 <= step <= 6, line
    assert (tmp_path / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == step and state["optimizer_states"]
    # the requeued job: Lightning resumes from the hpc checkpoint by itself, at that step
    codes, err = _slurm_job(tmp_path, "model.fault=print_steps")
    assert codes == [0, 0], err[-4000:]
    assert min(int(s) for s in re.findall(r"rank \d+ starts step (\d+)", err)) == step, err[-4000:]
