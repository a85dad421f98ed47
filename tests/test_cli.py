"""The console scripts as a user runs them: ``lsd-train`` (``python -m lightning_static_dist``) and ``lsd-report``.

Bad configs must fail in seconds with exit code 2 and one ``lsd-train: error:`` line, before any process group
exists. One end-to-end test installs the package as a user does (a wheel, not the checkout), trains a tiny model
on 2 CPU ranks from a directory outside the checkout with a shipped config named by name, through the default
``popen`` launcher (Lightning re-runs the same command line for rank 1), and reads the run back with ``lsd-report``.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
import _jobs as jobs
from _dist import fresh_job_env

from lightning_static_dist.cli import report, train_main
from lightning_static_dist.config import ConfigError
from lightning_static_dist.runfile import load_run_config, shipped_config_names

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = "configs/charlm_cpu.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def lsd_train(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``lsd-train ARGS`` from the repository root."""
    return jobs.run("lsd-train", list(args), cwd=str(REPO), env=fresh_job_env(), timeout=timeout)  # (tests/_jobs.py)


def lsd_report(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``lsd-report ARGS``: the installed console script beside this interpreter, else its entry point."""
    script = Path(sys.executable).with_name("lsd-report")
    if script.exists():
        cmd = [str(script), *args]
    else:
        cmd = [sys.executable, "-c", "from lightning_static_dist.cli import report_main; report_main()", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------ lsd-train: errors


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.max_stepz=3", ["trainer.max_stepz", "max_steps"]),
        ("model.n_head=5", ["model", "n_head=5", "n_embd=128"]),  # a constructor's own check, before processes
        ("data.path=/nonexistent", ["data", "/nonexistent"]),
        ("strategy.mesh.dp_shard=3", ["strategy.mesh.dp_shard=3", "does not divide the world size 2"]),
    ],
    ids=["trainer-typo", "model-constructor", "data-path-missing", "mesh-against-the-world"],
)
def test_train_config_error_exits_2_before_any_process_group(override: str, named: list[str]) -> None:
    started = time.monotonic()
    result = lsd_train(CPU_CONFIG, override, timeout=120)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("lsd-train: error:"), result.stderr
    assert result.stderr.strip().splitlines() == [last_line] and result.stdout == "", output  # (no "Seed set to")
    for fragment in named:
        assert fragment in last_line, f"{fragment!r} not in {last_line!r}"
    assert "Traceback" not in output
    assert "Initializing distributed" not in output
    assert elapsed < 60, f"a config error took {elapsed:.0f} s to report"


def test_train_without_arguments_asks_for_the_config_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="2"):
        train_main([])
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == "lsd-train: error: the following arguments are required: config", last_line


def test_train_callback_constructor_error_exits_2() -> None:
    result = lsd_train(CPU_CONFIG, "callbacks.run_summary.warmup_steps=-1", timeout=120)
    assert result.returncode == 2, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("lsd-train: error:") and "callbacks.run_summary.warmup_steps" in last_line


def test_print_config_shows_the_merged_overrides(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # train_main puts the working directory on sys.path
    train_main([CPU_CONFIG, "trainer.max_steps=7", "strategy.sync.bucket_mb=10", "model.n_layer=2", "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_steps"] == 7
    assert printed["trainer"]["devices"] == 2
    assert printed["strategy"]["sync"]["bucket_mb"] == 10.0
    assert printed["model"]["class_path"] == "lightning_static_dist.examples.charlm.CharGPT"
    assert printed["model"]["n_layer"] == 2  # a run file's shape: the arguments beside class_path
    assert printed["callbacks"]["run_summary"] == {"enabled": True, "warmup_steps": 5, "print_every_n_steps": 25}
    # the README's key table names callbacks.model_checkpoint: the printed file has the block to edit, as the run has it
    assert printed["callbacks"]["model_checkpoint"] == {"enabled": True}
    train_main([CPU_CONFIG, "trainer.enable_checkpointing=false", "--print-config"])
    assert yaml.safe_load(capsys.readouterr().out)["callbacks"]["model_checkpoint"] == {"enabled": False}


def test_print_config_output_trains_as_a_run_file(tmp_path: Path) -> None:
    # lsd-train charlm_cpu --print-config > x.yaml && lsd-train x.yaml: the printed file is a run file, taken as it is
    tiny = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "data.block_size=16",
            "data.batch_size=4", "data.max_bytes=20000", "trainer.max_steps=2", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1", "trainer.devices=1", f"trainer.default_root_dir={tmp_path}",
            "callbacks.overlap_monitor.enabled=false", "callbacks.run_summary.warmup_steps=1"]
    printed = lsd_train("charlm_cpu", *tiny, "--print-config", timeout=120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    run_file = tmp_path / "x.yaml"
    run_file.write_text(printed.stdout)
    trained = lsd_train(str(run_file), timeout=240)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-3000:]
    (summary,) = tmp_path.glob("lightning_logs/version_*/summary.json")
    figures = json.loads(summary.read_text())
    assert figures["steps"] == 2
    assert figures["tokens_per_s"] > 0 and "samples_per_s" not in figures  # CharGPT's batches are token ids
    again = lsd_train(str(run_file), "--print-config", timeout=120)  # and it reads back to the same run file
    assert again.stdout == printed.stdout


# ------------------------------------------------------------------------------------ lsd-report

SUMMARY = {
    "strategy": "StaticDistStrategy",
    "world_size": 2,
    "steps": 30,
    "batches": 30,
    "train_loss_last10": 3.25,
    "val_loss": 3.5,
    "val_ppl": 33.1,
    "step_ms_median": 12.5,
    "tokens_per_s": 81920.0,
    "sync_rounds": 30,
    "sync_collectives": 31,
    "bytes_sent_per_rank": 2640000,
    "bytes_per_round": 88000,
    "bucket_plan": "1 bucket [0.08MiB/16p]",
}


def write_run(log_dir: Path, rows: list[dict[str, object]], summary: dict[str, object] | None = None) -> Path:
    """A finished run's log dir as Lightning's CSVLogger and RunSummary leave it."""
    log_dir.mkdir(parents=True)
    with open(log_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", "step", "train_loss", "val_loss"])
        writer.writeheader()
        writer.writerows(rows)
    if summary is not None:
        (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return log_dir


RUN_ROWS = [
    {"epoch": 0, "step": 9, "train_loss": 5.0, "val_loss": ""},
    {"epoch": 0, "step": 14, "train_loss": "", "val_loss": 4.5},
    {"epoch": 0, "step": 19, "train_loss": 4.0, "val_loss": ""},
    {"epoch": 0, "step": 29, "train_loss": 3.0, "val_loss": ""},
    {"epoch": 0, "step": 29, "train_loss": "", "val_loss": 3.5},
]


def _row(lines: list[str], name: str, text: str) -> list[str]:
    rows = [line.split() for line in lines if line.split()[:1] == [name]]
    assert len(rows) == 1, f"no single row for {name!r} in:\n{text}"
    return rows[0]


def metric_row(text: str, metric: str) -> list[str]:
    """``[metric, first, last, min, median, points]`` from the metrics table (above the summary's first rule)."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("---")), len(lines))
    return _row(lines[:end], metric, text)


def summary_row(text: str, key: str) -> list[str]:
    """``[key, value...]`` from the run summary table (below its first rule)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---"))
    return _row(lines[start:], key, text)


def test_report_prints_metrics_and_summary_and_plots(tmp_path: Path) -> None:
    log_dir = write_run(tmp_path / "lightning_logs" / "version_0", RUN_ROWS, SUMMARY)
    text = report(str(tmp_path))
    assert f"run: {log_dir}" in text
    # metric, first, last, min, points
    assert metric_row(text, "train_loss") == ["train_loss", "5", "3", "3", "4", "3"]
    assert metric_row(text, "val_loss") == ["val_loss", "4.5", "3.5", "3.5", "4", "2"]
    assert "lightning-static-dist run summary" in text
    assert summary_row(text, "world_size") == ["world_size", "2"]
    assert summary_row(text, "bytes_sent_per_rank") == ["bytes_sent_per_rank", "2,640,000"]
    assert summary_row(text, "bucket_plan")[1:] == ["1", "bucket", "[0.08MiB/16p]"]
    png = log_dir / "curves.png"
    assert f"plot: {png}" in text
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 1000


def test_report_without_plot_or_summary(tmp_path: Path) -> None:
    log_dir = write_run(tmp_path / "version_0", RUN_ROWS)
    text = report(str(log_dir), plot=False)
    assert metric_row(text, "train_loss")[-1] == "3"
    assert "run summary" not in text and "plot:" not in text
    assert not (log_dir / "curves.png").exists()


def test_report_reads_the_newest_run(tmp_path: Path) -> None:
    old = write_run(tmp_path / "lightning_logs" / "version_0", RUN_ROWS)
    new = write_run(tmp_path / "lightning_logs" / "version_1", [{"epoch": 0, "step": 4, "train_loss": 7.0, "val_loss": ""}])
    os.utime(old / "metrics.csv", (1_000_000, 1_000_000))
    text = report(str(tmp_path), plot=False)
    assert f"run: {new}" in text
    assert metric_row(text, "train_loss") == ["train_loss", "7", "7", "7", "7", "1"]


def test_report_on_an_empty_dir_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    result = lsd_report(str(tmp_path))
    assert result.returncode == 2
    assert "no metrics.csv under" in result.stderr and str(tmp_path) in result.stderr
    assert "Traceback" not in result.stderr


def test_report_on_a_run_that_logged_nothing_names_log_every_n_steps(tmp_path: Path) -> None:
    """A 30-step run under Lightning's default log_every_n_steps=50 leaves its folder and summary, no metrics.csv:
    the message says why (it used to ask whether this was a run's directory at all)."""
    log_dir = tmp_path / "lightning_logs" / "version_0"
    log_dir.mkdir(parents=True)
    (log_dir / "hparams.yaml").write_text("{}\n")
    (log_dir / "summary.json").write_text(json.dumps({"steps": 30}))
    result = lsd_report(str(tmp_path))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "logged no metrics (it ran 30 steps)" in lines[0], result.stderr
    assert "trainer.log_every_n_steps" in lines[0] and str(log_dir) in lines[0]


_LIGHTNING_CLI_SCRIPT = """
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out


LightningCLI(LoggingModel)
"""


@pytest.mark.multiprocess
def test_report_reads_a_run_that_logged_to_tensorboard_only(tmp_path: Path) -> None:
    # the README's LightningCLI file: LightningCLI's default logger is TensorBoard's, which writes no metrics.csv
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### LightningCLI"):]
    start = section.index("```yaml") + len("```yaml")
    (tmp_path / "conf").mkdir()  # (LightningCLI saves the parsed config as ./config.yaml)
    (tmp_path / "conf" / "config.yaml").write_text(section[start:section.index("```", start)])
    (tmp_path / "main.py").write_text(_LIGHTNING_CLI_SCRIPT)
    trained = subprocess.run(
        [sys.executable, "main.py", "fit", "--config", "conf/config.yaml", "--trainer.max_steps=6",
         "--trainer.log_every_n_steps=1", "--trainer.strategy.compile.backend=aot_eager",
         f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.enable_checkpointing=false",
         "--trainer.limit_val_batches=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=fresh_job_env())
    assert trained.returncode == 0, trained.stderr[-3000:]
    log_dir = tmp_path / "run" / "lightning_logs" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*")) and not list(tmp_path.rglob("metrics.csv"))
    result = lsd_report(str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert f"run: {log_dir}" in result.stdout, result.stdout
    assert metric_row(result.stdout, "train_loss")[-1] == "6", result.stdout  # a point per step, as logged
    assert "static_dist/overlap_ratio" in result.stdout and "hp_metric" not in result.stdout, result.stdout
    assert summary_row(result.stdout, "world_size") == ["world_size", "2"]  # RunSummary's summary.json beside them
    assert (log_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC


# ------------------------------------------------------------------------------------ end to end, 2 CPU ranks


def test_a_shipped_config_is_found_by_name_and_a_wrong_name_lists_them() -> None:
    assert shipped_config_names() == ["charlm_cpu", "charlm_gpu"]
    by_name, by_path = load_run_config("charlm_cpu"), load_run_config(str(REPO / CPU_CONFIG))
    assert by_name == by_path and by_name.model.class_path == "lightning_static_dist.examples.charlm.CharGPT"
    with pytest.raises(ConfigError, match=r"^config 'charlm_cpux': no such file, and no shipped config of that name;"
                                          r" shipped: charlm_cpu, charlm_gpu$"):
        load_run_config("charlm_cpux")
    with pytest.raises(ConfigError, match=r"^config file 'nowhere/charlm_cpu.yaml': no such file$"):
        load_run_config("nowhere/charlm_cpu.yaml")


def test_the_wheel_lists_every_package() -> None:
    # pyproject.toml lists the packages (configs/ is mapped into the package): a new subpackage must be listed too
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "lightning_static_dist").rglob("__init__.py")}
    assert found - listed == set(), f"not in pyproject.toml's packages: {sorted(found - listed)}"


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as ``pip install .`` (not editable) puts it: a wheel built from the checkout, installed into a
    folder of its own (the dependencies are this venv's)."""
    import shutil

    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # what the build reads, copied: the build writes build/ and *.egg-info beside it
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "lightning_static_dist", "configs"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(source)],
                   check=True, timeout=300, cwd=root)
    (wheel,) = (root / "dist").glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(root / "site"), str(wheel)], check=True, timeout=300)
    return root / "site"


@pytest.mark.multiprocess
def test_train_two_cpu_ranks_then_report(tmp_path: Path, wheel_install: Path) -> None:
    # from a directory outside the checkout, with the wheel's copy of the package (its example model, its configs)
    env = {**fresh_job_env(), "PYTHONPATH": str(wheel_install)}
    where = subprocess.run([sys.executable, "-c", "import lightning_static_dist as m; print(m.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(wheel_install)), where.stdout + where.stderr
    overrides = [
        "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        "data.block_size=32", "data.batch_size=8", "data.max_bytes=200000",
        "trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
        f"trainer.default_root_dir={tmp_path}", "callbacks.run_summary.warmup_steps=2",
    ]
    # from the checkout's root, whose own lightning_static_dist/ comes first on sys.path (lsd-train puts the working
    # directory there, for a user's class paths): the run file's model still imports
    inside = subprocess.run([str(wheel_install / "bin" / "lsd-train"), CPU_CONFIG, "--print-config"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert inside.returncode == 0, inside.stderr[-2000:]
    result = subprocess.run([str(wheel_install / "bin" / "lsd-train"), "charlm_cpu", *overrides], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in output  # rank 1 really ran

    (summary_path,) = tmp_path.glob("lightning_logs/version_*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["strategy"] == "StaticDistStrategy"
    assert summary["world_size"] == 2
    assert summary["steps"] == 12
    assert summary["sync_rounds"] == 12
    assert summary["bytes_sent_per_rank"] > 0

    with open(summary_path.parent / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train_losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    val_losses = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert train_losses and val_losses
    assert len(val_losses) == 2  # validation at steps 6 and 12

    report_result = lsd_report(str(tmp_path), "--no-plot")
    assert report_result.returncode == 0, report_result.stderr
    assert f"run: {summary_path.parent}" in report_result.stdout
    assert metric_row(report_result.stdout, "val_loss")[-1] == "2"
    assert summary_row(report_result.stdout, "world_size") == ["world_size", "2"]
    assert summary_row(report_result.stdout, "sync_rounds") == ["sync_rounds", "12"]


@pytest.mark.multiprocess
def test_results_go_to_stdout_after_the_progress_bar_and_diagnostics_to_stderr(tmp_path: Path) -> None:
    # lsd-train ... > log.txt keeps the results: progress and validation lines, the summary table and the run's folder;
    # the compile report and Lightning's own messages stay on stderr; the table comes after the bar's last line
    tiny = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.block_size=32",
            "data.batch_size=8", "data.max_bytes=200000", "trainer.max_steps=8", "trainer.val_check_interval=4",
            "trainer.limit_val_batches=2", "trainer.enable_progress_bar=true", f"trainer.default_root_dir={tmp_path}",
            "callbacks.overlap_monitor.enabled=false", "callbacks.run_summary.print_every_n_steps=4",
            "strategy.compile.enabled=true", "strategy.compile.backend=aot_eager"]
    done = lsd_train("charlm_cpu", *tiny, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out, err = done.stdout.replace("\r", "\n"), done.stderr
    for result in ("step 4/8  loss ", "validation at step 8: val_loss ", "lightning-static-dist run summary"):
        assert result in out and result not in err, (result, out[-3000:], err[-3000:])
    assert "compile report (after the first step)" in err and "compile report" not in out, err[-3000:]
    table = out[out.index("lightning-static-dist run summary"):]
    # after the table: its closing rule and the run's folder, no progress bar drawn again below it
    rows = table.splitlines()
    closing = next(i for i in range(2, len(rows)) if rows[i].startswith("---"))
    assert rows[closing + 1:] == [f"run folder: {tmp_path}/lightning_logs/version_0"], table
    assert "Seed set to" not in err


def test_lsd_consolidate_refuses_what_is_not_a_sharded_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_static_dist.cli import consolidate_main

    with pytest.raises(SystemExit) as excinfo:
        consolidate_main([str(tmp_path), str(tmp_path / "out.ckpt")])
    assert excinfo.value.code == 2
    assert "not a sharded checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "out.ckpt").exists()
