"""Every value the package refuses under LightningCLI ends a user's script in one line on stderr with status 2.

Each case runs a user's own ``LightningCLI(BoringModel)`` script in a subprocess, as a user runs it: one case per kind
of check the package makes (a range, a choice, a class path, a check across a section's fields or across sections, a
nested section, the strategy's and DDP's arguments, a callback's options, the world the Trainer gives, the
environment, a YAML file), and the checks that can only run once the ranks exist.
"""

from __future__ import annotations

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


def _run(tmp_path: Any, args: list[str], env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    (tmp_path / "main.py").write_text(_SCRIPT)
    (tmp_path / "conf").mkdir(exist_ok=True)  # (LightningCLI saves the parsed config as ./config.yaml)
    (tmp_path / "conf" / "config.yaml").write_text(_YAML)
    return subprocess.run([sys.executable, "main.py", "fit", "--trainer.accelerator=cpu", "--trainer.logger=false",
                           *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**fresh_job_env(), **(env or {})})


@pytest.mark.parametrize(("args", "env", "named"), [
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
], ids=["range", "choice", "literal", "class-path", "within-a-section", "across-sections", "nested-section",
        "strategy-argument", "ddp-argument", "against-the-world", "callback-option", "callback-nested-option",
        "environment", "yaml-file"])
def test_a_refused_value_under_lightning_cli_is_one_line_and_status_2(tmp_path: Any, args: list[str],
                                                                       env: Optional[dict[str, str]],
                                                                       named: str) -> None:
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
