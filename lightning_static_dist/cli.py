"""Console scripts: ``lsd-train CONFIG.yaml [dotted.key=value ...]`` and ``lsd-report RUN_DIR``.

``lsd-train`` validates the whole run file (and the overrides) before it starts a single process; with the ``popen``
start method Lightning re-runs this same command once per extra rank, and each rank validates again — cheap, and
it keeps every rank's view of the config identical.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
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

    L.seed_everything(cfg.seed, workers=True)
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


def resume_from(cfg: RunConfig) -> Optional[str]:
    """The checkpoint this run resumes from: ``ckpt_path`` resolved (``last``: the newest under the run's folders),
    and under ``torchrun --max-restarts`` a restarted attempt resumes from the newest by itself. Says which, in one
    line on rank 0; ``last`` with nothing to resume from says so and starts from step 0."""
    if RESUME_ENV in os.environ and os.environ.get("LOCAL_RANK", "0") != "0":
        return os.environ[RESUME_ENV] or None  # a rank Lightning's launcher started: rank 0 resolved it already
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    wanted = cfg.ckpt_path if cfg.ckpt_path is not None or restart == 0 else "last"
    path = wanted
    if wanted == "last":
        roots = checkpoint_roots(cfg)
        path = find_last_checkpoint(roots)
        why = f"restart {restart} of torchrun --max-restarts" if cfg.ckpt_path is None else "ckpt_path=last"
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(f"lsd-train: {why}: " + (f"resuming from {path}" if path else
                  f"no checkpoint under {', '.join(roots)}; starting from step 0"), file=sys.stderr, flush=True)
    os.environ[RESUME_ENV] = path or ""
    return path


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
        ckpt_path = resume_from(cfg)
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
    except Exception:
        if getattr(trainer.strategy, "failure", None) is None:
            traceback.print_exc()  # this rank's own error (its peers' line names this rank): its traceback, once
        # a collective failure: the strategy printed the one line that says what happened, no stack trace on top of
        # it. Either way no interpreter shutdown: it would try to tear down process groups whose peers are gone
        exit_after_failure(1)
    # done: Python's exit handlers run, the native teardown (where Gloo threads sometimes abort) does not
    exit_without_native_teardown(0)


def print_run_file(cfg: RunConfig) -> str:
    """``lsd-train --print-config``: the validated run file as YAML that ``lsd-train`` accepts back as it is."""
    import yaml

    header = "# the validated run file (lsd-train --print-config); train with: lsd-train THIS_FILE.yaml\n"
    return header + yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------------- report


def find_run_dirs(root: str) -> list[str]:
    """Lightning log directories (holding ``metrics.csv``) under ``root``, newest last."""
    found = []
    for dirpath, _, filenames in os.walk(root):
        if "metrics.csv" in filenames:
            found.append(dirpath)
    return sorted(found, key=lambda d: os.path.getmtime(os.path.join(d, "metrics.csv")))


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


def report(run_dir: str, plot: bool = True) -> str:
    """The summary table of the newest run under ``run_dir``; writes ``<log_dir>/curves.png`` when ``plot`` and then
    names the constant series the picture lists instead of drawing (``lightning_static_dist/report_plot.py``)."""
    runs = find_run_dirs(run_dir)
    if not runs:
        raise FileNotFoundError(_why_no_metrics(run_dir))
    log_dir = runs[-1]
    series = read_metrics(os.path.join(log_dir, "metrics.csv"))
    if not series:
        raise FileNotFoundError(f"lsd-report: {log_dir}/metrics.csv holds no values yet: did the run log anything?")
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


def _why_no_metrics(run_dir: str) -> str:
    """The one line ``lsd-report`` prints when it finds no ``metrics.csv``: a run that logged nothing (shorter than
    Lightning's ``log_every_n_steps``) is told apart from a directory that holds no run."""
    logged = sorted(os.path.join(d, f) for d, _, files in os.walk(run_dir) for f in files
                    if f in ("summary.json", "hparams.yaml"))
    if not logged:
        return f"lsd-report: no metrics.csv under {run_dir!r}: is it a finished run's directory?"
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
