"""A bad launch environment — ``MASTER_PORT=abc``, ``WORLD_SIZE=0``, a ``MASTER_PORT`` some other process listens on —
is refused with one line naming the variable, before any rank starts, through ``lsd-train`` and through a plain Trainer
script. Before, each failed later and elsewhere: a ``ValueError`` traceback from Lightning's environment, a store that
never bound, ranks that started for nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from _dist import fresh_job_env, free_port
from tests.processes.test_faults import ROOT, TINY

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process (here: this one) listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_port()))
        listener.listen()
        yield listener.getsockname()[1]


def _launch(how: str, tmp: Any, env: dict[str, str]) -> tuple[int, str]:
    if how == "lsd-train":
        cmd = [os.path.join(os.path.dirname(sys.executable), "lsd-train"),
               os.path.join(ROOT, "configs", "charlm_cpu.yaml"), *TINY, f"trainer.default_root_dir={tmp}"]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "tests", "_env_script.py"), str(tmp)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**fresh_job_env(), **env}, timeout=120)
    return proc.returncode, proc.stderr


_CASES = [  # variable, value, what the line says
    ("MASTER_PORT", "abc", "MASTER_PORT='abc': must be a TCP port number"),
    ("WORLD_SIZE", "0", "WORLD_SIZE='0': must be an integer >= 1"),
    ("MASTER_PORT", "busy", "the port is already in use on this machine"),
]


# every case through lsd-train; through a plain script the first by default, the others (one job each) with -m slow
@pytest.mark.parametrize("variable, value, says, how", [
    pytest.param(*case, how, marks=[pytest.mark.slow] if how == "script" and i else [])
    for i, case in enumerate(_CASES) for how in ("lsd-train", "script")])
def test_a_bad_launch_variable_is_one_line_naming_it_before_any_rank_starts(tmp_path: Any, request: Any, how: str,
                                                                         variable: str, value: str, says: str) -> None:
    if value == "busy":
        value = str(request.getfixturevalue("busy_port"))
    code, err = _launch(how, tmp_path, {variable: value})
    assert code != 0, err[-3000:]
    if how == "lsd-train":
        (line,) = [line for line in err.splitlines() if f"{variable}=" in line]
        assert line.startswith("lsd-train: error: ") and "Traceback" not in err, err[-3000:]
    else:  # a script's uncaught exception: Python's traceback, whose last line is the one line
        line = err.strip().splitlines()[-1]
        assert line.startswith("lightning_static_dist.config.check.ConfigError: "), err[-3000:]
    assert says in line and f"{variable}={value}" in line.replace("'", ""), line
    assert "Initializing distributed" not in err and "GLOBAL_RANK" not in err, err[-3000:]  # no rank started
