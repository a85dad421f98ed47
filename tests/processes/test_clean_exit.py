"""A clean exit under Lightning's own multiprocessing launcher (which bypasses ``StaticDistSpawnLauncher`` and its
``os._exit``): nothing the package started — the peer watchdog's thread, the mesh's groups — is alive once the strategy
is torn down, nor at interpreter exit where nothing tears it down (Lightning's ``test_result_reduce_ddp`` calls
``setup_environment`` alone). A daemon thread caught inside a store call at interpreter finalisation aborted such
ranks (SIGABRT, "terminate called without an active exception"): 4 of 6 runs of that Lightning test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from _dist import fresh_job_env

pytestmark = pytest.mark.multiprocess

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the scripts it runs are


def _run(scenario: str, out: Any) -> tuple[int, str]:
    # PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack, which says whose thread it was
    env = {**fresh_job_env(), "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_lightning_spawn.py"), scenario, str(out)],
                          capture_output=True, text=True, env=env, timeout=240)
    return proc.returncode, proc.stderr


# an abort at exit is intermittent: `-m slow` repeats the environment scenario, the default run makes each once
@pytest.mark.parametrize("scenario, runs", [("environment", 1), pytest.param("environment", 2, marks=pytest.mark.slow),
                                            ("fit", 1)])
def test_nothing_of_ours_outlives_a_run_under_lightnings_spawn_launcher(tmp_path: Any, scenario: str,
                                                                      runs: int) -> None:
    for attempt in range(runs):
        out = tmp_path / str(attempt)
        out.mkdir()
        code, err = _run(scenario, out)
        assert code == 0, err[-3000:]  # a rank that aborted: torch's spawn raised ProcessExitedException (SIGABRT)
        for rank in (0, 1):
            alive = json.loads((out / f"rank{rank}.json").read_text())
            assert alive == {"threads": [], "groups": []}, (attempt, rank, alive)


_FREEZE_AT_EXIT = """
import atexit, gc, sys
import torch.distributed as dist
from lightning_static_dist.processes.ending import freeze_heap_at_exit

atexit.register(lambda: print(f"frozen {gc.get_freeze_count()}"))  # registered first: runs last
freeze_heap_at_exit()
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
if sys.argv[1] == "destroyed":
    atexit.register(dist.destroy_process_group)  # registered last (as the strategy's setup does): runs first
"""


@pytest.mark.parametrize("groups, frozen", [("destroyed", True), ("alive", False)])
def test_a_rank_freezes_what_is_alive_at_exit_only_once_its_groups_are_gone(tmp_path: Any, groups: str,
                                                                            frozen: bool) -> None:
    # frozen: the interpreter's finalisation skips its collections over torch's objects (benchmarks/cpu2_teardown.py);
    # with a group still there (after a failure), it collects the group's native objects as it always did
    env = {**fresh_job_env(), "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _FREEZE_AT_EXIT, groups, str(tmp_path / "rendezvous")],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (count,) = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("frozen ")]
    assert (count > 0) == frozen, count
