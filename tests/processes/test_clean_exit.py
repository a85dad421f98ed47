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
