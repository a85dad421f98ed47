"""Resuming a run from the command line (issue 27, item 1): ``ckpt_path`` in the run file (a path, ``last`` or null),
checkpoints written as ``callbacks.model_checkpoint`` says, and a torchrun restart that resumes by itself.

Every run here is a real 2-rank ``lsd-train`` job on Gloo, as a user starts it. Before this, ``lsd-train`` refused
``ckpt_path`` and ``callbacks.model_checkpoint`` (unknown keys) and a restarted torchrun attempt began at step 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import _jobs as jobs
from _dist import fresh_job_env

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.block_size=32",
        "data.batch_size=8", "data.max_bytes=200000", "trainer.val_check_interval=1000", "trainer.limit_val_batches=0",
        "callbacks.overlap_monitor.enabled=false", "callbacks.run_summary.print_every_n_steps=0",
        "callbacks.run_summary.warmup_steps=0", "callbacks.model_checkpoint.every_n_train_steps=10"]


def lsd_train(root: Path, *args: str, launcher: tuple[str, ...] = (), timeout: float = 240) -> str:
    """A 2-rank ``lsd-train charlm_cpu`` job of the tiny model under ``root``; its output (it must succeed)."""
    job_args = ["charlm_cpu", *TINY, f"trainer.default_root_dir={root}", *args]
    env = {**fresh_job_env(), "PYTHONPATH": f"{REPO}{':'}{REPO / 'tests'}"}
    if launcher:
        done = subprocess.run([sys.executable, *launcher, "lightning_static_dist", *job_args], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout, env=env)
    else:  # (forked: tests/_jobs.py)
        done = jobs.run("lsd-train", job_args, cwd=str(REPO), env=env, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def summaries(root: Path) -> list[dict]:
    """The runs' summaries, oldest first."""
    paths = sorted(root.glob("lightning_logs/version_*/summary.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    return [json.loads(p.read_text()) for p in paths]


@pytest.mark.multiprocess
def test_ckpt_path_last_resumes_from_the_newest_checkpoint_of_any_version_folder(tmp_path: Path) -> None:
    """Lightning's own ``ckpt_path="last"`` looks in the new version's folder only, and starts from scratch: ours finds
    the newest checkpoint of the run, whichever version wrote it, and the resumed run continues from its step."""
    lsd_train(tmp_path, "trainer.max_steps=20")
    first = tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=20.ckpt"
    assert first.exists(), sorted(str(p) for p in tmp_path.rglob("*.ckpt"))
    out = lsd_train(tmp_path, "trainer.max_steps=30", "ckpt_path=last")
    assert f"lsd-train: ckpt_path=last: resuming from {first}" in out
    out = lsd_train(tmp_path, "trainer.max_steps=40", "ckpt_path=last")  # now version_1 holds the newest (step 30)
    assert "lsd-train: ckpt_path=last: resuming from " in out and "version_1/checkpoints/epoch=0-step=30.ckpt" in out
    steps = [(s["steps"], s["batches"]) for s in summaries(tmp_path)]
    assert steps == [(20, 20), (30, 10), (40, 10)]  # each resumed run trained only the steps left


@pytest.mark.multiprocess
@pytest.mark.parametrize(("interval", "written"), [
    ((), {"step=6.ckpt": 6}),
    pytest.param(("callbacks.model_checkpoint.every_n_train_steps=4", "callbacks.model_checkpoint.save_last=true"),
                 {"step=6.ckpt": 6, "last.ckpt": 6}, marks=pytest.mark.slow),  # (an interval inside the run: -m slow)
], ids=["longer-than-the-run", "every-4-steps-with-save-last"])
def test_the_end_of_fit_saves_its_last_step_whatever_the_interval(tmp_path: Path, interval: tuple[str, ...],
                                                                  written: dict[str, int]) -> None:
    """Issue 37: a run shorter than the checkpoint interval left no checkpoint at all (``ckpt_path=last`` then started
    from step 0), and a longer one lost the steps after the last interval. The end of fit writes the last step as
    the ModelCheckpoint writes one at its interval (its ``save_top_k=1`` keeps that one), and a resume goes on from
    it."""
    import torch

    out = lsd_train(tmp_path, "trainer.max_steps=6", *interval)
    assert "static_dist: the fit ended at step 6, which no checkpoint held: saved " in out, out[-3000:]
    saved = {path.name.split("-")[-1]: torch.load(path, weights_only=True)["global_step"]
             for path in tmp_path.rglob("*.ckpt")}  # ("epoch=E-step=6.ckpt": the epoch is the data's)
    assert saved == written, saved
    out = lsd_train(tmp_path, "trainer.max_steps=9", "ckpt_path=last", *interval)
    assert "lsd-train: ckpt_path=last: resuming from " in out and "version_0/checkpoints/" in out, out[-3000:]
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)] == [(6, 6), (9, 3)]


@pytest.mark.multiprocess
def test_ckpt_path_last_without_a_checkpoint_says_so_and_starts_from_step_0(tmp_path: Path) -> None:
    out = lsd_train(tmp_path, "trainer.max_steps=4", "ckpt_path=last")
    assert f"lsd-train: ckpt_path=last: no checkpoint under {tmp_path}; starting from step 0" in out
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)] == [(4, 4)]


@pytest.mark.multiprocess
def test_a_checkpoint_given_by_path_is_resumed(tmp_path: Path) -> None:
    lsd_train(tmp_path, "trainer.max_steps=10")
    (ckpt,) = tmp_path.rglob("*.ckpt")
    lsd_train(tmp_path, "trainer.max_steps=14", f"ckpt_path={ckpt}")
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)] == [(10, 10), (14, 4)]


@pytest.mark.multiprocess
def test_resuming_a_finished_run_says_so_in_one_line_and_how_to_continue(tmp_path: Path) -> None:
    """Lightning restores a checkpoint already at ``max_steps`` and stops at once, silently, leaving an empty
    ``version_1``: the run says so in one line, before any process starts, with the command that continues it."""
    lsd_train(tmp_path, "trainer.max_steps=10")
    ckpt = tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt"
    out = lsd_train(tmp_path, "trainer.max_steps=10", "ckpt_path=last")
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    told, _, command = lines[0].partition("; to continue the run, raise it: ")
    assert told == f"lsd-train: nothing to train: {ckpt} is at step 10, and trainer.max_steps is 10", lines[0]
    assert command.startswith("lsd-train charlm_cpu ") and command.endswith(" ckpt_path=last trainer.max_steps=20")
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]  # no empty version_1
    done = subprocess.run([sys.executable, "-m", "lightning_static_dist", *command.split()[1:]], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env=fresh_job_env())  # the command, as told
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)] == [(10, 10), (20, 10)]


def test_a_run_finished_by_its_epochs_says_so_too(tmp_path: Path) -> None:
    import torch

    from lightning_static_dist.checkpoint import META_FILE
    from lightning_static_dist.cli import finished_already
    from lightning_static_dist.runfile import load_run_config

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    # a real checkpoint of a fit that ran its 2 epochs (Lightning writes it before its epoch counter moves on)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[checkpoints], default_root_dir=tmp_path).fit(BoringModel())
    ckpt = tmp_path / "e.ckpt"
    os.replace(checkpoints.last_model_path, ckpt)
    by_epochs = load_run_config("charlm_cpu", ["trainer.max_steps=-1", "trainer.max_epochs=2"])
    assert finished_already(by_epochs, str(ckpt), ["charlm_cpu", "trainer.max_epochs=2"]) == (
        f"lsd-train: nothing to train: {ckpt} is at 2 epochs done, and trainer.max_epochs is 2; to continue the run,"
        " raise it: lsd-train charlm_cpu trainer.max_epochs=3")
    # a sharded checkpoint's folder keeps Lightning's dict under "lightning" in its meta file (participants/parameter_shards.py)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    rest = {k: v for k, v in torch.load(ckpt, weights_only=False).items() if k != "state_dict"}
    torch.save({"lightning": rest, "param_groups": []}, sharded / META_FILE)
    assert finished_already(by_epochs, str(sharded), ["charlm_cpu"]) is not None
    longer = load_run_config("charlm_cpu", ["trainer.max_steps=-1", "trainer.max_epochs=3"])
    assert finished_already(longer, str(ckpt), ["charlm_cpu"]) is None
    (tmp_path / "torn.ckpt").write_bytes(b"PK\x03\x04 not whole")  # unreadable here: the resume itself says why
    assert finished_already(by_epochs, str(tmp_path / "torn.ckpt"), ["charlm_cpu"]) is None


@pytest.mark.parametrize(("override", "named"), [
    ("ckpt_path=/nonexistent/x.ckpt", ["ckpt_path='/nonexistent/x.ckpt'", "no such file", "'last'"]),
    ("callbacks.model_checkpoint.every_n_train_stepz=3", ["callbacks.model_checkpoint.every_n_train_stepz",
                                                          "did you mean 'every_n_train_steps'"]),
    ("trainer.enable_checkpointing=false", ["callbacks.model_checkpoint.enabled=True", "enable_checkpointing"]),
], ids=["missing-file", "typo", "checkpointing-off"])
def test_resume_keys_are_checked_before_any_process_starts(override: str, named: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "lightning_static_dist", "charlm_cpu",
                           "callbacks.model_checkpoint.enabled=true", override], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=fresh_job_env())
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lsd-train: error: "), done.stderr
    assert all(part in lines[0] for part in named), lines[0]
    assert "Initializing distributed" not in done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(os.environ.get("LSD_TORCHRUN_RESTART_TEST") != "1",
                    reason="a torchrun restart's new attempt sometimes hangs in its process-group start on a loaded"
                           " 2-core machine (Lightning's ddp too): run with LSD_TORCHRUN_RESTART_TEST=1")
def test_a_torchrun_restart_resumes_from_the_last_checkpoint_by_itself(tmp_path: Path) -> None:
    """Rank 0 fails once at step 15 (tests/_crash_once.py); torchrun --max-restarts=1 starts the job again, which
    resumes from the step-10 checkpoint without being told, says so, and trains the 10 steps left."""
    marker = tmp_path / "crashed"
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "-m")
    out = lsd_train(tmp_path, "trainer.max_steps=20", "model.class_path=_crash_once.CrashOnceGPT",
                    f"model.marker={marker}", launcher=launcher, timeout=300)
    assert marker.exists() and "planted failure at step 15" in out
    resumed = tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt"
    assert f"lsd-train: restart 1 of torchrun --max-restarts: resuming from {resumed}" in out
    assert [(s["steps"], s["batches"]) for s in summaries(tmp_path)][-1] == (20, 10)
