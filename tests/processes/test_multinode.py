"""More than one machine, on this one (issue 27, item 9): two "nodes" on localhost started as a cluster starts them,
by torchrun (``--nnodes 2 --nproc_per_node 1``, c10d rendezvous) and by SLURM (its variables set per process, as
``srun`` sets them, with ``Trainer(num_nodes=2)``), each running ``lsd-train`` on 2 Gloo ranks of one process each.

They train to the weights Lightning's ``ddp`` trains the same run file to; a node's process killed makes the survivor
say which node and rank stopped; a torchrun restart resumes both nodes from the last checkpoint and finishes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from _dist import fresh_job_env, free_port
from tests.test_resume import REPO, TINY, summaries
from tests.test_strategy import assert_same_weights

from lightning_static_dist.agreement.faults import failure_line, stopped_participating

#: 2 nodes of 1 process each, 6 steps, the final checkpoint compared
TWO_NODES = ["trainer.devices=1", "trainer.num_nodes=2", "trainer.max_steps=6", "data.max_bytes=20000",
             "callbacks.model_checkpoint.every_n_train_steps=6"]
RUN = [sys.executable, "-m", "lightning_static_dist", "charlm_cpu", *TINY]


def start_nodes(commands: Sequence[list[str]], envs: Sequence[dict[str, str]], logs: Path,
                timeout: float) -> list[tuple[int, str]]:
    """Start one process per node (each in a session of its own, its output in ``logs/node<N>.log``); wait for all
    of them for at most ``timeout`` seconds together; their exit codes and outputs. A node still running then is
    killed, with what is left of the others, and the test fails: a hang cannot outlive it."""
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for node, (command, env) in enumerate(zip(commands, envs)):
        files.append(open(logs / f"node{node}.log", "w+"))
        procs.append(subprocess.Popen(command, cwd=REPO, stdout=files[-1], stderr=subprocess.STDOUT, text=True,
                                      env={**env, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        codes = [proc.wait(timeout=max(0.1, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    outputs = []
    for f in files:
        f.seek(0)
        outputs.append(f.read())
        f.close()
    assert codes is not None, f"the nodes did not finish within {timeout} s:\n" + "\n".join(o[-2000:] for o in outputs)
    return list(zip(codes, outputs))


def torchrun_nodes(root: Path, *overrides: str, restarts: int = 0, timeout: float = 180) -> list[tuple[int, str]]:
    """``lsd-train`` on two torchrun nodes of this machine (node 0 hosts the c10d rendezvous)."""
    port = free_port()
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--node_rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", "lsd-two-nodes", "--rdzv-conf", f"is_host={int(node == 0)}",
                 "--max-restarts", str(restarts), *RUN[1:], f"trainer.default_root_dir={root}", *overrides]
                for node in (0, 1)]
    return start_nodes(commands, [fresh_job_env()] * 2, root / "logs", timeout)


def slurm_nodes(root: Path, *overrides: str, timeout: float = 180) -> list[tuple[int, str]]:
    """``lsd-train`` as two SLURM tasks on two nodes: each process has the variables ``srun`` gives a task."""
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lsd-two-nodes", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    envs = [{**fresh_job_env(), **job, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"}
            for node in (0, 1)]
    return start_nodes([[*RUN, f"trainer.default_root_dir={root}", *overrides]] * 2, envs, root / "logs", timeout)


def weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    (path,) = root.glob(f"lightning_logs/version_*/checkpoints/*-step={step}.ckpt")
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def assert_finished(nodes: list[tuple[int, str]]) -> None:
    for node, (code, output) in enumerate(nodes):
        assert code == 0, f"node {node} exited {code}:\n{output[-3000:]}"


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same run under Lightning's ddp: 2 ranks of one node (the same ranks, the same data each)."""
    root = tmp_path_factory.mktemp("ddp")
    command = [sys.executable, str(REPO / "tests" / "_ddp_run.py"), "charlm_cpu", *TINY, *TWO_NODES,
               "trainer.devices=2", "trainer.num_nodes=1", f"trainer.default_root_dir={root}"]
    ((code, output),) = start_nodes([command], [fresh_job_env()], root / "logs", timeout=180)
    assert code == 0 and "DDPStrategy" in output, output[-3000:]
    return weights(root, 6)


#: how each cluster starts the two nodes
LAUNCHES = {"torchrun": torchrun_nodes, "slurm": slurm_nodes}


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_two_nodes_train_to_ddps_weights(tmp_path: Path, ddp_weights: dict[str, torch.Tensor], launch: str) -> None:
    nodes = LAUNCHES[launch](tmp_path, *TWO_NODES)
    assert_finished(nodes)
    assert "Starting with 2 processes" in nodes[0][1] + nodes[1][1]
    assert_same_weights(weights(tmp_path, 6), ddp_weights)


@pytest.mark.parametrize(("env", "named"), [
    ({}, "rank 0: rank 1 stopped"),  # Lightning's own launcher: one node as far as the line goes
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "GROUP_RANK": "0"}, "rank 0: rank 1 stopped"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "0", "GROUP_RANK": "0"}, "rank 0 (node 0): rank 1 (node 1)"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "GROUP_RANK": "1"}, "rank 0 (node 1): rank 1 (node 0)"),
    ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "0", "SLURM_NODEID": "0"},
     "rank 0 (node 0): rank 1 (node 0)"),
], ids=["lightning", "torchrun-one-node", "torchrun-two-nodes", "node-from-group-rank", "slurm"])
def test_a_failure_line_names_the_nodes_where_the_job_spans_several(monkeypatch: pytest.MonkeyPatch, env: dict,
                                                                   named: str) -> None:
    """This rank's node is its launcher's word for it (GROUP_RANK wins over the arithmetic); a peer's follows from the
    processes per node; a job of one node keeps the line it always had."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK", "NODE_RANK", *(k for k in os.environ
                                                                                       if k.startswith("SLURM_"))):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = failure_line(0, stopped_participating([1]), 3, "reason")
    assert line.startswith(f"static_dist: {named}"), line


def failure_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("static_dist: rank ")]


@pytest.mark.multiprocess
# SLURM's two processes by default; torchrun's (its agents too) with -m slow: how each names nodes is checked above
@pytest.mark.parametrize("launch", [pytest.param("torchrun", marks=pytest.mark.slow), "slurm"])
def test_a_killed_nodes_process_is_named_by_node_and_rank_on_the_survivor(tmp_path: Path, launch: str) -> None:
    """Node 1's process is SIGKILLed at step 3: node 0's ends with one line naming rank 1 on node 1, and itself."""
    fault = ["model.class_path=tests.faulty.FaultyCharGPT", "model.fault=kill", "model.fault_rank=1",
             "model.fault_step=3", "trainer.max_steps=12"]
    started = time.monotonic()
    (code0, out0), (code1, _) = LAUNCHES[launch](tmp_path, *TWO_NODES, *fault, timeout=120)
    assert code0 != 0 and code1 != 0
    (line,) = failure_lines(out0)
    assert line.startswith("static_dist: rank 0 (node 0): rank 1 (node 1) stopped participating during "), line
    assert "at step 3" in line, line
    assert time.monotonic() - started < 90


@pytest.mark.multiprocess
def test_a_job_of_two_nodes_resumed_with_ckpt_path_last_continues_on_both(tmp_path: Path) -> None:
    """The default-run variant of the restart test below, without torchrun's restart: a SLURM job of two nodes stops at
    step 6; started again with ``ckpt_path=last``, both nodes resume from the step-6 checkpoint of the shared folder."""
    run = [*TWO_NODES, "model.class_path=_crash_once.CrashOnceGPT", "model.crash_at=-1"]
    assert_finished(slurm_nodes(tmp_path, *run))
    nodes = slurm_nodes(tmp_path, *run, "trainer.max_steps=12", "ckpt_path=last")
    assert_finished(nodes)
    assert "rank 0 starts at step 6" in nodes[0][1] and "rank 1 starts at step 6" in nodes[1][1]
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)] == [(6, 6), (12, 6)]


@pytest.mark.multiprocess
@pytest.mark.slow  # about 60 s here, and a torchrun restart's rendezvous can take long on a loaded machine
@pytest.mark.skipif(os.environ.get("LSD_TORCHRUN_RESTART_TEST") != "1",
                    reason="a torchrun restart's new attempt sometimes hangs at its process-group start on a loaded"
                           " 2-core machine (Lightning's ddp too): run with LSD_TORCHRUN_RESTART_TEST=1")
def test_a_torchrun_restart_resumes_both_nodes_from_the_last_checkpoint(tmp_path: Path) -> None:
    """Rank 0 (node 0) fails once at step 15 (tests/_crash_once.py); ``--max-restarts 1`` starts both nodes again, and
    with ``ckpt_path=last`` each resumes from the step-10 checkpoint (found on the shared folder) and trains the 10
    steps left."""
    marker = tmp_path / "crashed"
    nodes = torchrun_nodes(tmp_path, "trainer.devices=1", "trainer.num_nodes=2", "trainer.max_steps=20",
                           "ckpt_path=last", "model.class_path=_crash_once.CrashOnceGPT", f"model.marker={marker}",
                           restarts=1, timeout=240)
    assert_finished(nodes)
    output = nodes[0][1] + nodes[1][1]
    assert marker.exists() and "planted failure at step 15" in output
    resumed = tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt"
    assert f"lsd-train: ckpt_path=last: resuming from {resumed}" in output, output[-3000:]
    assert "rank 0 starts at step 10" in nodes[0][1] and "rank 1 starts at step 10" in nodes[1][1]
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)][-1] == (20, 10)
    assert list(tmp_path.glob("lightning_logs/version_*/checkpoints/*-step=20.ckpt"))
