"""Persistent contender workers for ``gpuN_gpt2s.py --simulate``: each contender compiles once, then runs a timed
round whenever the driver says, so that many interleaved rounds cost seconds, not a fresh job each.

The driver starts every contender's worker at once (one process each, one GPU between them); each compiles and
warms up, then waits at its gate. A round asks each worker in turn, in an order rotated every round, for
``--round-windows`` windows of ``--window`` steps after ``--pre`` untimed steps that refill the host's lead (the
worker was idle); only the asked worker touches the GPU meanwhile. A window is timed between two device
synchronisations, so the host runs ahead within it as in a user's run, and the worker also reports how long its host
took to issue the window (``host_s``: the time until the last step returned, before the closing synchronisation):
well under the window's time, the step is paced by the GPU; equal to it, by the host.

``--busy-host K``: every contender also runs each round with a loaded host: for that round, the worker's threads
are confined to K cores and K busy-loop processes (``while True: pass``) run pinned to the same cores, so that the
training process gets about K / (K + 1) of them (the driver's own waiting is not counted: it sleeps in a read).
Compilation and the warm-up ran unloaded before.

What a worker does between commands is this module's :class:`RoundTimer` (a Lightning callback, also driven by the
hand-written loop): ``round`` (time), ``profile`` (``torch.profiler`` over some steps, a Chrome trace) and
``finish`` (the monitored tail steps, then the job ends and writes its record). Commands and replies are JSON lines
on two pipes the driver hands the worker (``--gate READ_FD,WRITE_FD``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any, Callable, Optional

# ------------------------------------------------------------------------------------------------- worker side


def steps_needed(warmup: int, rounds: int, pre: int, window: int, windows: int, profile_steps: int, tail: int) -> int:
    """Every training step a gated worker runs: what the driver's commands will ask for, in total."""
    return warmup + rounds * (pre + window * windows) + (pre + profile_steps if profile_steps else 0) + tail


class Gate:
    """The worker's end of the driver's pipes: one JSON object per line each way."""

    def __init__(self, spec: str) -> None:
        read_fd, write_fd = (int(x) for x in spec.split(","))
        self._read = os.fdopen(read_fd, "r")
        self._write = os.fdopen(write_fd, "w")

    def send(self, message: dict[str, Any]) -> None:
        self._write.write(json.dumps(message) + "\n")
        self._write.flush()

    def receive(self) -> dict[str, Any]:
        line = self._read.readline()
        if not line:
            raise SystemExit("benchmark driver went away")
        return json.loads(line)


class RoundTimer:
    """A gated worker's steps: ``warmup`` steps, then the driver's commands one after the other. The hand-written
    loop calls :meth:`start` / :meth:`end` around each step; :func:`lightning_timer` makes it a Lightning callback."""

    def __init__(self, cuda: bool, gate: Gate, warmup: int, pre: int, window: int, windows: int, profile_steps: int,
                 tail: int, trace_prefix: str, on_window: Optional[Callable[[int, bool], None]] = None) -> None:
        self._cuda, self._gate = cuda, gate
        self._warmup, self._pre, self._window, self._windows = warmup, pre, window, windows
        self._profile_steps, self._tail, self._trace_prefix = profile_steps, tail, trace_prefix
        self._on_window = on_window
        self._done = 0
        self._left = 0  # steps left in the command being run
        self._command: Optional[dict[str, Any]] = None
        self._marks: list[float] = []
        self._host: list[float] = []
        self._profiler: Any = None
        self._timed = 0  # timed steps run in this round
        self.last_loss: Any = None
        self.rounds: list[dict[str, Any]] = []

    def _sync(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize()

    def start(self) -> None:
        if self._done < self._warmup or self._left:
            command = self._command
            if command is not None and command["cmd"] == "profile" and self._left == command["steps"] - self._pre:
                self._begin_measured()
            return
        if self._command is None and self._done == self._warmup:
            self._gate.send({"ready": True})
        command = self._gate.receive()
        kind = command["cmd"]
        if kind == "round":
            command["steps"] = self._pre + self._window * self._windows
        elif kind == "profile":
            command["steps"] = self._pre + self._profile_steps
        elif kind == "finish":
            command["steps"] = self._tail
            if self._on_window is not None:
                self._on_window(0, True)  # the monitored tail runs at the last link
        else:
            raise SystemExit(f"unknown command {kind!r}")
        self._command, self._left = command, command["steps"]
        if kind != "finish" and self._pre == 0:
            self._begin_measured()  # (with untimed steps first: a round's first mark is taken at their end, below)

    def _begin_measured(self) -> None:
        assert self._command is not None
        self._sync()
        if self._command["cmd"] == "round":
            self._marks, self._host, self._timed = [time.perf_counter()], [], 0
            if self._on_window is not None:
                self._on_window(0, False)
        else:  # profile (at the first link)
            import torch

            if self._on_window is not None:
                self._on_window(0, False)

            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                                   if self._cuda else [])
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()

    def end(self, loss: Any) -> None:
        self._done += 1
        self.last_loss = loss.detach() if loss is not None else None
        if self._command is None or not self._left:
            return
        self._left -= 1
        measured = self._command["steps"] - self._pre  # steps of the command that are timed or profiled
        if self._command["cmd"] == "round" and self._pre and self._left == measured:
            # the untimed steps are over: the first window starts here, after a step's end, as every later one does
            self._begin_measured()
            return
        if self._command["cmd"] == "round" and self._left < measured:
            self._timed += 1
            if self._timed % self._window == 0:
                self._host.append(time.perf_counter())  # the host issued the window's last step
                self._sync()
                self._marks.append(time.perf_counter())
                windows_done = len(self._marks) - 1
                if self._on_window is not None and windows_done < self._windows:
                    self._on_window(windows_done, False)
        if self._left:
            return
        kind = self._command["cmd"]
        if kind == "round":
            reply = {"window_s": [(b - a) / self._window for a, b in zip(self._marks, self._marks[1:])],
                     "host_s": [(h - a) / self._window for a, h in zip(self._marks, self._host)]}
            self.rounds.append(reply)
            self._gate.send(reply)
        elif kind == "profile":
            self._sync()
            self._profiler.stop()
            path = f"{self._trace_prefix}.json.gz"
            self._profiler.export_chrome_trace(path)
            self._profiler = None
            self._gate.send({"trace": path, "steps": self._profile_steps})

    def timings(self) -> dict[str, Any]:
        """What the job's record keeps (every round's windows were sent already)."""
        final_loss = float(self.last_loss) if self.last_loss is not None else float("nan")
        return {"step_s": [s for r in self.rounds for s in r["window_s"]], "window": self._window,
                "final_loss": final_loss, "rounds_run": len(self.rounds)}


def lightning_timer(timer: RoundTimer) -> Any:
    """``timer`` as a Lightning callback (each training batch one step)."""
    import lightning as L

    class _Callback(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            timer.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            timer.end(outputs["loss"])

    return _Callback()


# ------------------------------------------------------------------------------------------------- driver side


class Worker:
    """One contender's persistent job, started with its gate's pipes."""

    def __init__(self, key: str, cmd: list[str], env: dict[str, str], log_path: str) -> None:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        self.key = key
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd + ["--gate", f"{to_worker_r},{from_worker_w}"], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, pass_fds=(to_worker_r, from_worker_w),
                                     start_new_session=True)
        os.close(to_worker_r)
        os.close(from_worker_w)
        self._send = os.fdopen(to_worker_w, "w")
        self._read_fd = from_worker_r
        self._buffer = b""
        self.started = time.perf_counter()

    def send(self, message: dict[str, Any]) -> None:
        self._send.write(json.dumps(message) + "\n")
        self._send.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """The worker's next reply; a ``RuntimeError`` if it ends or takes longer than ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RuntimeError(f"{self.key}: no reply within {timeout_s:.0f} s")
            ready, _, _ = select.select([self._read_fd], [], [], min(left, 5.0))
            if ready:
                chunk = os.read(self._read_fd, 65536)
                if not chunk:
                    raise RuntimeError(f"{self.key}: the worker ended (exit {self.proc.wait()})")
                self._buffer += chunk
            elif self.proc.poll() is not None:
                raise RuntimeError(f"{self.key}: the worker ended (exit {self.proc.returncode})")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def threads(self) -> list[int]:
        try:
            return [int(t) for t in os.listdir(f"/proc/{self.proc.pid}/task")]
        except FileNotFoundError:
            return []

    def close(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            return self.proc.wait()
        finally:
            self._log.close()


class BusyHost:
    """For one round: a worker's threads confined to ``cores``, and one busy-loop process pinned to each of them."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = cores
        self._loops: list[subprocess.Popen] = []
        self._pinned: Optional[Worker] = None

    def describe(self) -> dict[str, Any]:
        return {"cores": self.cores, "busy_loops": len(self.cores),
                "method": "the training process's threads confined to these cores, one spinning process pinned to"
                          " each of them, for the timed round only (compilation and warm-up unloaded)"}

    def __call__(self, worker: Worker) -> "BusyHost":
        self._pinned = worker
        return self

    def __enter__(self) -> "BusyHost":
        assert self._pinned is not None
        for tid in self._pinned.threads():
            try:
                os.sched_setaffinity(tid, self.cores)
            except OSError:
                pass  # a thread that ended meanwhile
        # one loop pinned to each core (and gone with the driver: a loop whose parent died ends itself)
        code = ("import os, sys; os.sched_setaffinity(0, [int(sys.argv[1])]); parent = os.getppid()\n"
                "while os.getppid() == parent:\n    for _ in range(1_000_000): pass")
        self._loops = [subprocess.Popen([sys.executable, "-c", code, str(core)]) for core in self.cores]
        time.sleep(0.2)  # the loops are spinning before the round starts
        return self

    def __exit__(self, *exc: Any) -> None:
        for loop in self._loops:
            loop.kill()
            loop.wait()
        self._loops = []
        every = sorted(os.sched_getaffinity(0))
        assert self._pinned is not None
        for tid in self._pinned.threads():
            try:
                os.sched_setaffinity(tid, every)
            except OSError:
                pass


def rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` started at position ``r`` (mod its length): round ``r``'s order."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


#: whole rotations run before the timed rounds and discarded: a contender's first round is not the GPU's first
#: minutes of work (in one record the ceiling, first in the first round, ran 3.4 % faster than in its four others)
WARM_ROUNDS = 1


def drive(commands: dict[str, list[str]], env: dict[str, str], rounds: int, busy: Optional[BusyHost], profile: bool,
          timeout_s: float, log_dir: str, on_update: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Start every worker (``commands``: key -> its command line), run :data:`WARM_ROUNDS` discarded rotations and
    ``rounds`` rotated rounds (each key once quiet, and once busy when ``busy`` is given), then one profile each
    (``profile``), then the tails; returns
    ``{"runs": {run key: [round replies]}, "traces": {key: path}, "failed": {key: why}}``. A worker that fails is
    dropped with its reason; the others go on. ``on_update`` gets the results so far after every round."""
    started = time.perf_counter()
    workers = {key: Worker(key, cmd, env, os.path.join(log_dir, f"{key.replace('@', '-')}.log"))
               for key, cmd in commands.items()}
    try:
        return _run(workers, started, rounds, busy, profile, timeout_s, on_update)
    finally:  # (whatever ended the run: no worker outlives the driver)
        for worker in workers.values():
            if worker.proc.poll() is None:
                os.killpg(worker.proc.pid, 9)
                worker.proc.wait()


def _run(workers: dict[str, Worker], started: float, rounds: int, busy: Optional[BusyHost], profile: bool,
         timeout_s: float, on_update: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    failed: dict[str, str] = {}
    for key, worker in workers.items():  # they compiled side by side; the first to finish waits for the others
        try:
            worker.receive(timeout_s)
            print(f"ready: {key} ({time.perf_counter() - started:.0f} s after the start)", flush=True)
        except (RuntimeError, OSError) as err:
            failed[key] = str(err)
            worker.close(1.0)
            print(f"FAILED: {key}: {err}", flush=True)
    conditions = ["quiet"] + (["busy"] if busy is not None else [])
    pairs = [(key, cond) for cond in conditions for key in workers]
    results: dict[str, Any] = {"runs": {}, "traces": {}, "failed": failed}
    for r in range(-WARM_ROUNDS, rounds):  # (the warm rotations' replies are discarded)
        for key, cond in rotated(pairs, r):
            if key in failed:
                continue
            worker = workers[key]
            run_key = key if cond == "quiet" else f"{key}+busy"
            try:
                if cond == "busy":
                    assert busy is not None
                    with busy(worker):
                        worker.send({"cmd": "round"})
                        reply = worker.receive(timeout_s)
                else:
                    worker.send({"cmd": "round"})
                    reply = worker.receive(timeout_s)
            except (RuntimeError, OSError) as err:  # (a worker that died: a broken pipe on the way there)
                failed[key] = str(err)
                worker.close(1.0)
                print(f"FAILED: {key}: {err}", flush=True)
                continue
            if r < 0:
                continue
            results["runs"].setdefault(run_key, []).append({**reply, "round": r})
            windows = sorted(reply["window_s"])
            host = sorted(reply["host_s"])
            print(f"round {r + 1 if r >= 0 else 'warm'}/{rounds} {run_key:<34} step {1e3 * windows[len(windows) // 2]:7.2f} ms,"
                  f" host {1e3 * host[len(host) // 2]:7.2f} ms", flush=True)
        on_update(results)
    for key, worker in workers.items():  # one at a time: a profile or a monitored tail shares the GPU with no one
        if key in failed:
            continue  # (closed when it failed)
        try:
            if profile:
                worker.send({"cmd": "profile"})
                results["traces"][key] = worker.receive(timeout_s)["trace"]
                on_update(results)
            worker.send({"cmd": "finish"})
        except (RuntimeError, OSError) as err:
            failed[key] = str(err)
        code = worker.close(timeout_s if key not in failed else 1.0)
        if code != 0 and key not in failed:
            failed[key] = f"exit {code} (log: {key.replace('@', '-')}.log)"
    on_update(results)
    return results
