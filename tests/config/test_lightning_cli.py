"""Every value the package refuses under LightningCLI ends a user's script in one line on stderr with status 2.

A user's own ``LightningCLI(BoringModel)`` script runs in a subprocess, as a user runs it: one case per kind of check
the package makes (a range, a choice, a class path, a check across a section's fields or across sections, a nested
section, the strategy's and DDP's arguments, a callback's options, the world the Trainer gives, the environment, a
YAML file), and the checks that can only run once the ranks exist. The checks made before any rank starts share one
interpreter (one start-up instead of fourteen), each case a fresh ``LightningCLI`` with its own argv and environment;
one of them also runs alone, to see the process end with status 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Optional

import pytest

from _dist import fresh_job_env

pytestmark = pytest.mark.multiprocess

_SCRIPT = """
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

if __name__ == "__main__":  # (start_method=spawn re-imports this file in each rank)
    cli = LightningCLI(BoringModel)
    print("BUILT", type(cli.trainer.strategy).__name__)
"""

_STRATEGY = ["--trainer.strategy=lightning_static_dist.StaticDistStrategy", "--trainer.strategy.timeout_s=600"]
_MONITOR = ["--trainer.callbacks+=lightning_static_dist.OverlapMonitor"]

_YAML = """
trainer:
  strategy:
    class_path: lightning_static_dist.StaticDistStrategy
    init_args:
      compression:
        name: zip
"""


def _write_files(tmp_path: Any) -> None:
    (tmp_path / "main.py").write_text(_SCRIPT)
    (tmp_path / "conf").mkdir(exist_ok=True)  # (LightningCLI saves the parsed config as ./config.yaml)
    (tmp_path / "conf" / "config.yaml").write_text(_YAML)


def _run(tmp_path: Any, args: list[str], env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    _write_files(tmp_path)
    return subprocess.run([sys.executable, "main.py", "fit", "--trainer.accelerator=cpu", "--trainer.logger=false",
                           *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**fresh_job_env(), **(env or {})})


# Each case as its own script would meet it: argv, environment and stderr its own; what the process's exit would show
# (the SystemExit status, an escaping exception's traceback) recorded instead, one JSON line per case.
_CASES_SCRIPT = """
import contextlib, io, json, os, sys, tempfile, traceback, warnings
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

if __name__ == "__main__":
    base, filters = dict(os.environ), list(warnings.filters)
    for args, env in json.loads(sys.argv[1]):
        os.environ.clear()
        os.environ.update({**base, **(env or {})})
        warnings.resetwarnings()  # (every warning shows once per case, as in a script of its own)
        warnings.filters[:] = filters
        sys.argv = ["main.py", "fit", "--trainer.accelerator=cpu", "--trainer.logger=false", *args]
        err, code, built = io.StringIO(), 0, False
        # what reaches file descriptor 2 too: Lightning's log handlers hold the stderr of import time
        with tempfile.TemporaryFile("w+") as raw:
            sys.__stderr__.flush()
            kept = os.dup(2)
            os.dup2(raw.fileno(), 2)
            try:
                with contextlib.redirect_stderr(err):
                    try:
                        LightningCLI(BoringModel)
                        built = True
                    except SystemExit as stop:
                        code = stop.code
                    except BaseException:
                        code = 1
                        traceback.print_exc()
            finally:
                sys.__stderr__.flush()
                os.dup2(kept, 2)
                os.close(kept)
            raw.seek(0)
            printed = raw.read()
        print("CASE " + json.dumps({"code": code, "stderr": printed + err.getvalue(), "built": built}), flush=True)
"""


# (arguments, environment, what the one line names): one case per kind of check made before any rank starts
_REFUSED: list[tuple[list[str], Optional[dict[str, str]], str]] = [
    ([*_STRATEGY, "--trainer.strategy.sync.bucket_mb=-1"], None,
     "strategy.sync.bucket_mb=-1.0: must be a number of MiB in (0, 4096]"),
    ([*_STRATEGY, "--trainer.strategy.compression.name=zip"], None,
     "strategy.compression.name='zip': unknown compressor; allowed: none, fp16, bf16"),
    ([*_STRATEGY, "--trainer.strategy.sync.reduce_dtype=fp64"], None,
     "strategy.sync.reduce_dtype='fp64': expected 'fp32' | 'bf16' | 'auto'"),
    ([*_STRATEGY, "--trainer.strategy.compression.name=no_such_pkg.Compressor"], None,
     "strategy.compression.name='no_such_pkg.Compressor': cannot import module 'no_such_pkg'"),
    ([*_STRATEGY, "--trainer.strategy.compile.backend=aot_eager", "--trainer.strategy.compile.mode=max-autotune"],
     None, "strategy.compile.mode='max-autotune': a mode needs backend 'inductor'"),
    ([*_STRATEGY, "--trainer.strategy.sync.mode=graph", "--trainer.strategy.compression.name=bf16"], None,
     "strategy.compression.name='bf16': compression runs in the synchroniser's buckets"),
    ([*_STRATEGY, "--trainer.strategy.simulate.world_size=2", "--trainer.strategy.simulate.link.gbps=0"], None,
     "strategy.simulate.link.gbps=0.0: must be a bandwidth"),
    (["--trainer.strategy=lightning_static_dist.StaticDistStrategy", "--trainer.strategy.timeout_s=-1"], None,
     "strategy.timeout_s=-1.0: must be a finite number of seconds > 0"),
    ([*_STRATEGY, "--trainer.strategy.bucket_cap_mb=5", "--trainer.strategy.sync.bucket_mb=3"], None,
     "bucket_cap_mb=5.0: given twice (also as strategy.sync.bucket_mb)"),
    ([*_STRATEGY, "--trainer.devices=2", "--trainer.strategy.mesh.dp_shard=3"], None,
     "strategy.mesh.dp_shard=3: does not divide the world size 2"),
    ([*_STRATEGY, *_MONITOR, "--trainer.callbacks.every_n_steps=0"], None,
     "callbacks.overlap_monitor.every_n_steps=0: must be an integer >= 1"),
    ([*_STRATEGY, *_MONITOR, '--trainer.callbacks.profiler={"active": 0}'], None,
     "callbacks.overlap_monitor.profiler.active=0: must be an integer >= 1"),
    ([*_STRATEGY, "--trainer.devices=2"], {"MASTER_PORT": "abc"}, "MASTER_PORT='abc': must be a TCP port number"),
    (["--config", "conf/config.yaml"], None, "strategy.compression.name='zip': unknown compressor"),
    (["--trainer.strategy=lightning_static_dist.StaticDistStrategy", "--trainer.strategy.sync.bucket_mbb=5"], None,
     "strategy.sync.bucket_mbb: unknown key; did you mean 'bucket_mb'?"),
    (["--trainer.strategy=lightning_static_dist.StaticDistStrategy", "--trainer.strategy.sync.bucket_mb=abc"], None,
     "strategy.sync.bucket_mb='abc': expected float"),
]
_REFUSED_IDS = ["range", "choice", "literal", "class-path", "within-a-section", "across-sections", "nested-section",
                "strategy-argument", "ddp-argument", "against-the-world", "callback-option", "callback-nested-option",
                "environment", "yaml-file", "misspelt-field", "invalid-field"]


def test_a_refused_value_under_lightning_cli_is_one_line_and_status_2(tmp_path: Any) -> None:
    _write_files(tmp_path)
    (tmp_path / "cases.py").write_text(_CASES_SCRIPT)
    done = subprocess.run([sys.executable, "cases.py", json.dumps([[args, env] for args, env, _ in _REFUSED])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=fresh_job_env())
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    results = [json.loads(line[len("CASE "):]) for line in done.stdout.splitlines() if line.startswith("CASE ")]
    assert len(results) == len(_REFUSED), done.stdout[-3000:]
    for case_id, (_, _, named), result in zip(_REFUSED_IDS, _REFUSED, results):
        lines = result["stderr"].strip().splitlines()
        assert result["code"] == 2, (case_id, result["stderr"][-3000:])
        assert len(lines) <= 4 and "Traceback" not in result["stderr"], (case_id, result["stderr"][-3000:])
        assert lines[-1].startswith("main.py: error: ") and named in lines[-1], (case_id, lines)
        assert not result["built"], case_id


def test_a_refused_value_ends_the_users_script_with_status_2(tmp_path: Any) -> None:
    # the interpreter's own end, which the shared run above stands in for: status 2, one line, no traceback
    args, env, named = _REFUSED[0]
    done = _run(tmp_path, args, env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) <= 4 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("main.py: error: ") and named in lines[-1], lines
    assert "BUILT" not in done.stdout


@pytest.mark.parametrize(("args", "named"), [
    (["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_on_exception=true"],
     "ModelCheckpoint(save_on_exception=True): under static_dist a save is a collective"),
    (["--trainer.strategy.sync.mode=graph"], "strategy.sync.mode='graph': the collectives live in the compiled graph"),
    # the spawn launcher pickles the strategy into each rank: the rank's copy must still know where it came from
    (["--trainer.strategy.sync.mode=graph", "--trainer.strategy.start_method=spawn"],
     "strategy.sync.mode='graph': the collectives live in the compiled graph"),
], ids=["a-callback-of-lightning", "needs-the-model", "needs-the-model-spawned"])
def test_a_value_refused_once_the_ranks_run_is_one_line_and_status_2(tmp_path: Any, args: list[str],
                                                                      named: str) -> None:
    # checked where the Trainer's callbacks and the model are known, after Lightning's launcher started both ranks
    # (and printed its banner): every rank stops, rank 0 alone says why, no traceback
    done = _run(tmp_path, [*_STRATEGY, "--trainer.devices=2", "--trainer.max_steps=1", *args])
    errors = [line for line in done.stderr.splitlines() if line.startswith("main.py: error: ")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(errors) == 1 and named in errors[0], done.stderr[-3000:]
