"""Console scripts: ``lsd-train CONFIG.yaml [dotted.key=value ...]`` and ``lsd-report RUN_DIR``.

``lsd-train`` validates the whole run file (and the overrides) before it starts a single process; with the ``popen``
start method Lightning re-runs this same command once per extra rank, and each rank validates again (why:
docs/internals.md, "cli.py").
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys
import traceback
from collections.abc import Sequence
from typing import Any, Optional

from lightning_static_dist.overlap.intervals import median_of
from lightning_static_dist.config import ConfigError
from lightning_static_dist.runfile import RunConfig, load_run_config
from lightning_static_dist.compat import exit_after_failure, exit_without_native_teardown
from lightning_static_dist.wording import counted


def build_trainer_inputs(cfg: RunConfig) -> tuple[Any, Any, Any]:
    """Instantiate (trainer, model, datamodule) from a validated run config."""
    import lightning as L

    from lightning_static_dist.callbacks import GraphReport
    from lightning_static_dist.strategy import StaticDistStrategy

    L.seed_everything(cfg.seed, workers=True, verbose=False)  # (the run file says it: no line before an error)
    model, datamodule = cfg.model.instantiate("model"), cfg.data.instantiate("data")
    strategy = StaticDistStrategy.from_config(cfg.strategy)
    callbacks = [block.build(name) for name, block in cfg.callbacks.items() if block.enabled]
    if "graph_report" in cfg.callbacks and not cfg.callbacks["graph_report"].enabled:
        # the strategy adds a GraphReport when it compiles and finds none: an inert one keeps it switched off
        callbacks.append(GraphReport(log_metrics=False, print_summary=False))
    trainer_kwargs = dict(cfg.trainer)
    trainer_kwargs.setdefault("logger", default_loggers(trainer_kwargs.get("default_root_dir") or os.getcwd()))
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs)
    return trainer, model, datamodule


#: where rank 0 hands the checkpoint it resolved to the ranks Lightning's launcher starts (they re-run this command)
RESUME_ENV = "LSD_RESUME_FROM"


def find_last_checkpoint(roots: Sequence[str]) -> Optional[str]:
    """The newest checkpoint under any of ``roots`` (searched whole: every ``version_N`` folder, not only the
    newest, which is where Lightning's own ``ckpt_path="last"`` looks): a ``.ckpt`` file or a sharded checkpoint's
    directory, or the ``<name>.ckpt.old`` a save that crashed between its two renames left without a ``<name>.ckpt``;
    the newest by modification time, then by path. ``None`` when there is none."""
    from lightning_static_dist.checkpoint import is_leftover, is_sharded_checkpoint

    def kept(names: list[str], beside: set[str]) -> list[str]:
        # not a write that never finished, nor an old one beside its new one (a file or a folder: the consolidation
        # at the end of fit turns a sharded folder into a file of the same name)
        return [n for n in names if not n.endswith(".tmp") and not is_leftover(n, beside)]

    found: list[tuple[float, str]] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            if is_sharded_checkpoint(dirpath):
                found.append((os.path.getmtime(dirpath), dirpath))
                dirnames[:] = []  # (its .distcp files are not checkpoints of their own)
                continue
            here = set(dirnames) | set(filenames)
            dirnames[:] = kept(dirnames, here)
            found += [(os.path.getmtime(os.path.join(dirpath, f)), os.path.join(dirpath, f))
                      for f in kept(filenames, here) if f.endswith((".ckpt", ".ckpt.old"))]
    return max(found)[1] if found else None


def resume_from(cfg: RunConfig) -> tuple[Optional[str], Optional[str]]:
    """The checkpoint this run resumes from: ``ckpt_path`` resolved (``last``: the newest under the run's folders),
    and under ``torchrun --max-restarts`` a restarted attempt resumes from the newest by itself; with the one line
    rank 0 says about it (``last`` with nothing to resume from: that it starts from step 0), or ``None``."""
    if RESUME_ENV in os.environ and os.environ.get("LOCAL_RANK", "0") != "0":
        return os.environ[RESUME_ENV] or None, None  # a rank Lightning's launcher started: rank 0 resolved it already
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    wanted = cfg.ckpt_path if cfg.ckpt_path is not None or restart == 0 else "last"
    path, line = wanted, None
    if wanted == "last":
        roots = checkpoint_roots(cfg)
        path = find_last_checkpoint(roots)
        why = f"restart {restart} of torchrun --max-restarts" if cfg.ckpt_path is None else "ckpt_path=last"
        line = f"lsd-train: {why}: " + (f"resuming from {path}" if path else
                                        f"no checkpoint under {', '.join(roots)}; starting from step 0")
    os.environ[RESUME_ENV] = path or ""
    return path, line


def finished_already(cfg: RunConfig, ckpt_path: Optional[str], command: Sequence[str]) -> Optional[str]:
    """The one line ``lsd-train`` ends with when the checkpoint it resumes from is already as far as the run goes
    (``trainer.max_steps``, else ``trainer.max_epochs``): Lightning would restore it, stop at once, print nothing and
    leave an empty ``version_N`` folder. It names the limit and the command that continues the run (``command``: the
    config and the overrides given); ``None`` when there is training left, or the checkpoint cannot be read here."""
    from lightning_static_dist.checkpoint import training_progress

    progress = training_progress(ckpt_path) if ckpt_path is not None else None
    if progress is None:
        return None
    step, epochs = progress
    max_steps = cfg.trainer.get("max_steps", -1)
    max_epochs = cfg.trainer.get("max_epochs")
    if max_epochs is None:  # (Lightning's default: 1000 epochs unless max_steps limits the run)
        max_epochs = 1000 if max_steps == -1 else -1
    if max_steps != -1 and step >= max_steps:
        key, at, limit, more = "trainer.max_steps", f"step {step}", max_steps, max(2 * step, step + 1)
    elif max_epochs != -1 and epochs >= max_epochs:
        key, at, limit, more = "trainer.max_epochs", f"{counted(epochs, 'epoch')} done", max_epochs, epochs + 1
    else:
        return None
    kept = [arg for arg in command if not arg.startswith(f"{key}=")]
    return (f"lsd-train: nothing to train: {ckpt_path} is at {at}, and {key} is {limit}; to continue the run, raise"
            f" it: lsd-train {shlex.join(kept)} {key}={more}")


def checkpoint_roots(cfg: RunConfig) -> list[str]:
    """The folders a run's checkpoints are under: ``trainer.default_root_dir`` and ``model_checkpoint.dirpath``."""
    roots = [cfg.trainer.get("default_root_dir") or os.getcwd()]
    dirpath = cfg.callbacks["model_checkpoint"].options.get("dirpath") if "model_checkpoint" in cfg.callbacks else None
    return roots + ([dirpath] if dirpath else [])


def remove_leftovers_at_start(cfg: RunConfig) -> None:
    """Before any process starts (the launching process; under torchrun, rank 0): remove what interrupted saves left
    in the run's folders (``checkpoint.remove_leftovers``), in one line."""
    from lightning_static_dist.checkpoint import remove_leftovers

    if RESUME_ENV in os.environ or int(os.environ.get("RANK", "0") or 0) != 0:
        return  # a rank Lightning's launcher started (rank 0 cleaned up before it), or not rank 0
    removed = remove_leftovers(checkpoint_roots(cfg))
    if removed:
        print(f"lsd-train: removed what interrupted saves left ({counted(len(removed), 'path')}): {', '.join(removed)}",
              file=sys.stderr, flush=True)


def default_loggers(root_dir: str) -> list[Any]:
    """CSV always (``metrics.csv``, read by ``lsd-report``), TensorBoard beside it when installed; one log dir."""
    from importlib.util import find_spec

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    csv_logger = CSVLogger(save_dir=root_dir, name="lightning_logs")
    if find_spec("tensorboard") is None and find_spec("tensorboardX") is None:
        return [csv_logger]
    return [csv_logger, TensorBoardLogger(save_dir=root_dir, name="lightning_logs", version=csv_logger.version)]


def train_main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``lsd-train``: after a training run the process ends here (it is a command, not a library call:
    use :func:`build_trainer_inputs` and ``trainer.fit`` to train inside your own program)."""
    parser = argparse.ArgumentParser(
        prog="lsd-train",
        description="Train a LightningModule with the static_dist strategy from a YAML run file.",
        epilog="Example: lsd-train charlm_cpu trainer.max_steps=100 strategy.sync.bucket_mb=10 (a shipped config by"
               " name, or a run file's path)",
    )
    parser.add_argument("config", help="YAML run file (top level: seed, model, data, trainer, strategy, callbacks, ckpt_path),"
                        " or the name of a shipped one (charlm_cpu, charlm_gpu)")
    # default=[]: without it argparse (before Python 3.13) lists an empty "*" positional as required
    parser.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides, merged over the file")
    parser.add_argument("--print-config", action="store_true",
                        help="print the validated run file (YAML that lsd-train accepts back) and exit")
    args = parser.parse_args(argv)
    # a user's class paths in the run file (my_pkg.models.MyModel) resolve from the working directory, as with
    # `python -m`
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        cfg = load_run_config(args.config, args.overrides)
        if args.print_config:
            print(print_run_file(cfg), end="")
            return
        remove_leftovers_at_start(cfg)
        ckpt_path, resuming = resume_from(cfg)
        # a finished run: one line, before any process, logger or version folder exists
        finished = finished_already(cfg, ckpt_path, [args.config, *args.overrides])
        if (finished or resuming) and int(os.environ.get("RANK", "0") or 0) == 0:
            print(finished or resuming, file=sys.stderr, flush=True)
        if finished is not None:
            return
        trainer, model, datamodule = build_trainer_inputs(cfg)
    except ConfigError as err:
        parser.exit(2, f"lsd-train: error: {err}\n")
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_static_dist.processes.sigterm import SIGTERM_EXIT, is_agreed_stop

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException as stop:
        if not is_agreed_stop(stop):  # Lightning's own stop of this rank alone: its peers may wait in a collective
            exit_after_failure(stop.code or SIGTERM_EXIT)
        # every rank stopped at the step they agreed on and wrote its checkpoint (processes/sigterm.py): not "finished" (status 0)
        exit_without_native_teardown(stop.code or SIGTERM_EXIT)
    except ConfigError as err:
        # a refusal that needed the model (an overridden hook, its optimizer): every rank raised the same at setup;
        # one line for the job, the status of a bad run file
        if getattr(trainer.strategy, "global_rank", 0) == 0:
            print(f"lsd-train: error: {err}", file=sys.stderr, flush=True)
        exit_after_failure(2)
    except Exception:
        if getattr(trainer.strategy, "failure", None) is None:
            traceback.print_exc()  # this rank's own error (its peers' line names this rank): its traceback, once
        # a collective failure: the strategy printed the one line that says what happened, no stack trace on top of
        # it. Either way no interpreter shutdown: it would try to tear down process groups whose peers are gone
        exit_after_failure(1)
    # done: Python's exit handlers run, the native teardown (where Gloo threads sometimes abort) does not
    exit_without_native_teardown(0)


def print_run_file(cfg: RunConfig) -> str:
    """``lsd-train --print-config``: the validated run file as YAML that ``lsd-train`` accepts back as it is. A run
    file without a ``callbacks.model_checkpoint`` block gets it, as the run has it (Lightning's default checkpoint
    callback, or none with ``trainer.enable_checkpointing: false``): the printed file is the one to edit."""
    import yaml

    printed = cfg.to_dict()
    checkpointing = cfg.trainer.get("enable_checkpointing", True) is not False
    printed["callbacks"].setdefault("model_checkpoint", {"enabled": checkpointing})
    header = "# the validated run file (lsd-train --print-config); train with: lsd-train THIS_FILE.yaml\n"
    return header + yaml.safe_dump(printed, sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------------- report


#: the start of a TensorBoard event file's name (``events.out.tfevents.<time>.<host>...``)
EVENTS_FILE = "events.out.tfevents."


def find_run_dirs(root: str) -> list[str]:
    """Lightning log directories under ``root`` (holding ``metrics.csv`` or TensorBoard event files: LightningCLI's
    default logger writes only these), newest last by their newest such file."""
    found = []
    for dirpath, _, filenames in os.walk(root):
        logs = [os.path.join(dirpath, f) for f in filenames if f == "metrics.csv" or f.startswith(EVENTS_FILE)]
        if logs:
            found.append((max(os.path.getmtime(p) for p in logs), dirpath))
    return [d for _, d in sorted(found)]


def read_metrics(path: str) -> dict[str, list[tuple[int, float]]]:
    """``metrics.csv`` as ``{metric: [(step, value), ...]}``."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.get("step") or 0)
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                series.setdefault(key, []).append((step, float(value)))
    return series


def read_event_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in ``log_dir``, as :func:`read_metrics` returns a CSV's, read with
    TensorBoard's own reader (every point kept: its default keeps a sample of 10,000). Lightning's ``epoch`` and its
    hyperparameters' placeholder ``hp_metric`` are left out, as the CSV's ``epoch`` is."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ValueError(f"lsd-report: {log_dir} holds TensorBoard event files and no metrics.csv; reading them needs"
                         " tensorboard (pip install tensorboard)") from None
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if tag not in ("epoch", "hp_metric")}


def read_series(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """A log directory's metrics: its ``metrics.csv`` where there is one, else its TensorBoard event files."""
    csv_path = os.path.join(log_dir, "metrics.csv")
    return read_metrics(csv_path) if os.path.exists(csv_path) else read_event_scalars(log_dir)


def report(run_dir: str, plot: bool = True) -> str:
    """The summary table of the newest run under ``run_dir``; writes ``<log_dir>/curves.png`` when ``plot`` and then
    names the constant series the picture lists instead of drawing (``lightning_static_dist/report_plot.py``)."""
    runs = find_run_dirs(run_dir)
    if not runs:
        raise FileNotFoundError(_why_no_metrics(run_dir))
    log_dir = runs[-1]
    series = read_series(log_dir)
    if not series:  # (a TensorBoard logger writes its event file before any value)
        raise FileNotFoundError(_why_no_metrics(log_dir, empty_log=True))
    width = max(28, *(len(k) for k in series))
    lines = [f"run: {log_dir}", f"{'metric':<{width}} {'first':>12} {'last':>12} {'min':>12} {'median':>12} {'points':>7}"]
    for key in sorted(series):
        values = [v for _, v in series[key]]
        lines.append(
            f"{key:<{width}} {values[0]:>12.5g} {values[-1]:>12.5g} {min(values):>12.5g}"
            f" {median_of(values):>12.5g} {len(values):>7}"
        )
    summary_path = os.path.join(log_dir, "summary.json")
    if os.path.exists(summary_path):
        from lightning_static_dist.callbacks import format_summary

        with open(summary_path) as f:
            lines.append(format_summary(json.load(f)))
    if plot:
        from lightning_static_dist.report_plot import plot_curves

        curves = plot_curves(series, os.path.join(log_dir, "curves.png"))
        lines.append(f"plot: {curves.path}")
        if curves.caption:
            lines.append(curves.caption)
    return "\n".join(lines)


def _why_no_metrics(run_dir: str, empty_log: bool = False) -> str:
    """The one line ``lsd-report`` prints when it finds no metrics (``empty_log``: a log directory with no value in
    it): a run that logged nothing (shorter than Lightning's ``log_every_n_steps``) is told apart from a directory
    that holds no run."""
    logged = sorted(os.path.join(d, f) for d, _, files in os.walk(run_dir) for f in files
                    if f in ("summary.json", "hparams.yaml"))
    if not logged and empty_log:
        return f"lsd-report: {run_dir} holds no values yet: did the run log anything?"
    if not logged:
        return (f"lsd-report: no metrics.csv under {run_dir!r}, nor TensorBoard event files: is it a finished run's"
                " directory?")
    steps = ""
    summary = next((p for p in logged if p.endswith("summary.json")), None)
    if summary is not None:
        with open(summary) as f:
            ran = json.load(f).get("steps")
            steps = f" (it ran {counted(ran, 'step')})" if isinstance(ran, int) else ""
    return (f"lsd-report: the run in {os.path.dirname(logged[-1])!r} logged no metrics{steps}: Lightning writes them"
            " every trainer.log_every_n_steps steps (default 50), so a shorter run writes none; run again with"
            " trainer.log_every_n_steps=1 (or a value below its steps)")


def report_main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``lsd-report``."""
    from lightning_static_dist.sweep_report import is_sweep_record, report_sweep

    parser = argparse.ArgumentParser(
        prog="lsd-report", description="Summarise a finished lsd-train run, or a recorded critical-point sweep.")
    parser.add_argument("run_dir", help="the run's directory (trainer.default_root_dir) or one of its log dirs; or a"
                                        " critical-point record (benchmarks/results/*-critical-point-<date>.json)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    try:
        if is_sweep_record(args.run_dir):
            # drawn in the working directory: the record's own folder may be read-only, or hold the committed plot
            plot_to = None if args.no_plot else os.path.basename(args.run_dir)[: -len(".json")] + ".png"
            print(report_sweep(args.run_dir, plot_to=plot_to))
            return
        print(report(args.run_dir, plot=not args.no_plot))
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"{err}\n")


def consolidate_main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``lsd-consolidate``: a sharded checkpoint directory -> one plain Lightning checkpoint file."""
    from lightning_static_dist.checkpoint import consolidate, is_sharded_checkpoint, reason_of

    parser = argparse.ArgumentParser(
        prog="lsd-consolidate", description="Write the plain Lightning checkpoint of a sharded (reduce_scatter) one.")
    parser.add_argument("checkpoint_dir", help="a sharded checkpoint directory (strategy.checkpoint.format: sharded)")
    parser.add_argument("out", help="the .ckpt file to write (loads in any Lightning Trainer)")
    parser.add_argument("--trust", action="store_true",
                        help="load objects a weights-only load refuses (hyperparameters of your own classes): only for"
                             " a checkpoint you trust, as Trainer.fit(weights_only=False)")
    args = parser.parse_args(argv)
    if not is_sharded_checkpoint(args.checkpoint_dir):
        parser.exit(2, f"{args.checkpoint_dir}: not a sharded checkpoint directory (no lightning_meta.pt in it)\n")
    same = os.path.abspath(args.out) == os.path.abspath(args.checkpoint_dir)
    if os.path.isdir(args.out) and not same:  # (it would be replaced by the file, with what it holds)
        parser.exit(2, f"lsd-consolidate: out={args.out!r} is a folder; allowed: a file's path, or the checkpoint"
                       " directory itself (consolidated in place)\n")
    try:
        consolidate(args.checkpoint_dir, args.out, weights_only=False if args.trust else None)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # a damaged or planted checkpoint (DCP's error is a BaseException): one line
        parser.exit(1, f"lsd-consolidate: cannot consolidate {args.checkpoint_dir}: {reason_of(err, reading=True)}\n")
    print(f"wrote {args.out}")
