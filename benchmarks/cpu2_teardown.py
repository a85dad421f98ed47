"""Benchmark ``cpu2-teardown``: how long the end of a 2-rank CPU fit takes, Lightning's ``ddp`` against
``static_dist`` (eager, the defaults).

Workload: a 2-layer MLP (32 -> 64 -> 1), 15 steps of batch 8 on 2 Gloo ranks, ``Trainer(accelerator="cpu",
devices=2, strategy=..., max_steps=15)`` with the Trainer's defaults otherwise (its logger and checkpoint
callback included, in a temporary directory). The job is the script itself, started as a user starts one (Lightning
re-runs it for rank 1). Contenders alternate every round (A B, then B A).

Figures per job (wall-clock stamps, one clock: the machine's): ``train_end_to_fit_s``, from ``on_train_end`` to
``fit`` returning (the strategy's teardown inside ``fit``); ``fit_to_exit_s``, from ``fit`` returning to the job's
end (every rank's process gone: the launching process waits for its ranks, the interpreter's exit, atexit
handlers); their sum ``end_s``; and ``wall_s``, the whole job. Per rank: ``fit`` returning and the last atexit
handler. Medians over the rounds.

    python benchmarks/cpu2_teardown.py                  # 5 rounds, writes results/
    python benchmarks/cpu2_teardown.py --rounds 2 --no-record
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from _common import ROOT, worker_env, write_record

CONTENDERS = ("ddp", "static_dist")
STAMP = "cpu2-teardown-stamp "


def _stamp(name: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sys.stderr.write(f"{STAMP}{json.dumps({'rank': rank, 'name': name, 't': time.time(), 'pid': os.getpid()})}\n")
    sys.stderr.flush()


def worker(contender: str, root_dir: str) -> None:
    """One job (every rank runs this): the stamps go to stderr, read by :func:`run_job`."""
    _stamp("started")  # (the pid, for the parent's watch of this process's end)
    atexit.register(_stamp, "last_atexit")  # registered first: runs last of the exit handlers
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    if contender == "static_dist":
        import lightning_static_dist  # noqa: F401  (registers the strategy's name)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(512, 32, generator=g), torch.randn(512, 1, generator=g)),
                              batch_size=8)

    class Stamps(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            _stamp("train_end")

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=contender, max_steps=15, enable_progress_bar=False,
                        default_root_dir=root_dir, callbacks=[Stamps()])
    trainer.fit(Tiny())
    _stamp("fit_returned")
    atexit.register(_stamp, "first_atexit")  # registered last: runs first


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not reaped yet has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _read_stamps(stream: Any, stamps: dict[tuple[int, str], float], pids: dict[int, int], lines: list[str]) -> None:
    for line in stream:
        lines.append(line)
        if line.startswith(STAMP):
            s = json.loads(line[len(STAMP):])
            stamps[(s["rank"], s["name"])] = s["t"]
            pids[s["rank"]] = s["pid"]


def run_job(contender: str) -> dict[str, float]:
    """One fresh job; its figures (seconds). Each rank's end is watched here, every 5 ms, by its pid."""
    stamps: dict[tuple[int, str], float] = {}
    pids: dict[int, int] = {}
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", contender, "--root-dir", tmp]
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(None), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=_read_stamps, args=(proc.stderr, stamps, pids, lines), daemon=True)
        reader.start()
        while reader.is_alive():
            for rank, pid in list(pids.items()):
                if (rank, "gone") not in stamps and _gone(pid):
                    stamps[(rank, "gone")] = time.time()
            time.sleep(0.005)
        ended = time.time()  # stderr closed: every rank (they share it) has ended
        proc.wait()
    if proc.returncode != 0:
        sys.exit(f"{contender} failed (exit {proc.returncode}):\n{''.join(lines)[-3000:]}")
    fit = max(stamps[(r, "fit_returned")] for r in (0, 1))
    train_end = min(stamps[(r, "train_end")] for r in (0, 1))
    figures = {"wall_s": ended - started, "train_end_to_fit_s": fit - train_end, "fit_to_exit_s": ended - fit,
               "end_s": ended - train_end}
    for r in (0, 1):
        figures[f"rank{r}_atexit_s"] = stamps[(r, "last_atexit")] - stamps[(r, "first_atexit")]
        figures[f"rank{r}_after_atexit_s"] = stamps.get((r, "gone"), ended) - stamps[(r, "last_atexit")]
    return {k: round(v, 3) for k, v in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--label", default="", help="a name for this set of rows in the record (e.g. before/after)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", choices=CONTENDERS)
    parser.add_argument("--root-dir")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.root_dir)
        return
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
    for r in range(args.rounds):
        for contender in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:
            runs[contender].append(run_job(contender))
            print(f"round {r + 1}/{args.rounds} {contender:<12} {runs[contender][-1]}", flush=True)
    rows = [{"contender": c, "label": args.label, "rounds": len(recs),
             **{f"{k}_median": round(statistics.median(rec[k] for rec in recs), 3) for k in recs[0]},
             "per_round": recs} for c, recs in runs.items()]
    print(f"\n{'contender':<12} {'label':<8} {'wall s':>8} {'train_end->fit s':>17} {'fit->exit s':>12} {'end s':>8}")
    for row in rows:
        print(f"{row['contender']:<12} {row['label']:<8} {row['wall_s_median']:>8.2f}"
              f" {row['train_end_to_fit_s_median']:>17.3f} {row['fit_to_exit_s_median']:>12.3f} {row['end_s_median']:>8.3f}")
    if not args.no_record:
        record(rows, args.rounds)


def record(rows: list[dict[str, Any]], rounds: int) -> None:
    """Today's record, with the rows of other labels already in it kept (a run before a change, one after it)."""
    path = os.path.join(ROOT, "benchmarks", "results", f"cpu2-teardown-{datetime.date.today().isoformat()}.json")
    labels = {row["label"] for row in rows}
    if os.path.exists(path):
        with open(path) as f:
            rows = [row for row in json.load(f)["rows"] if row["label"] not in labels] + rows
    summary = {}
    for label in dict.fromkeys(row["label"] for row in rows):
        ddp, ours = (next(r for r in rows if r["label"] == label and r["contender"] == c) for c in CONTENDERS)
        suffix = f"_{label}" if label else ""
        summary[f"end_s_static_dist_minus_ddp{suffix}"] = round(ours["end_s_median"] - ddp["end_s_median"], 3)
        summary[f"wall_ratio_static_dist_vs_ddp{suffix}"] = round(ours["wall_s_median"] / ddp["wall_s_median"], 3)
    print(summary)
    write_record("cpu2-teardown", f"python benchmarks/cpu2_teardown.py --rounds {rounds} --label LABEL", rows=rows,
                 summary=summary)


if __name__ == "__main__":
    main()
