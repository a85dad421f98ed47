"""A console script's job (``lsd-train ...``) for a test, as ``subprocess`` starts it, minus the interpreter's start.

The job's first process is forked from the fork server that ``tests/_dist.py``'s ranks come from (torch, Lightning
and this package imported once per pytest process), then made what a shell would have started: the caller's
environment, working directory and file descriptors, its own session if asked, ``sys.argv`` as the console script
sees it. It runs the script's entry point in its main thread, and leaves as an interpreter does: non-daemon threads
joined, ``atexit`` handlers run, the entry point's exit status (``SystemExit``'s rules). The ranks it launches are
started by the job itself, as always (Lightning re-runs ``sys.argv`` for rank 1: a real interpreter).

For the cases that read how a job ends; a case about the interpreter itself (the installed wheel, a script file the
user runs with ``python``) keeps ``subprocess``.

    job = ForkedJob("lsd-train", ["configs/charlm_cpu.yaml", "trainer.max_steps=4"], cwd=REPO, env=fresh_job_env(),
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    _, err = job.communicate(timeout=120)
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Optional

from _dist import HandedFd, _context

ENTRY_POINTS = {
    "lsd-train": "lightning_static_dist.cli:train_main",
    "lsd-report": "lightning_static_dist.cli:report_main",
    "lsd-consolidate": "lightning_static_dist.cli:consolidate_main",
}


def _exit_status(code: Any) -> int:
    """What the interpreter makes of ``SystemExit(code)``: ``None`` is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_job(stdio: tuple[int, int], entry: str, argv: list[str], cwd: str, environ: dict[str, str],
             session: bool) -> None:
    multiprocessing.set_start_method(None, force=True)  # (the platform's default again, as in a fresh interpreter)
    if session:
        os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # (stdout and stderr arrived already: HandedFd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = argv
    module, name = ENTRY_POINTS[entry].split(":")
    try:
        status = _exit_status(getattr(importlib.import_module(module), name)())  # (the script: sys.exit(main()))
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # (the interpreter dies by the signal, as it does)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())  # (the one the package installed, if it did)
        status = 1
    threading._shutdown()  # (what the interpreter does at exit, in its order: threads, then atexit)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class ForkedJob:
    """``subprocess.Popen([script, *args], ...)`` for one of this package's console scripts (``ENTRY_POINTS``),
    started from the fork server: ``pid``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``kill``, and ``stdout``/``stderr`` as text pipes where ``subprocess.PIPE`` was asked."""

    def __init__(self, script: str, args: list[str], cwd: str, env: dict[str, str], stdout: Any = subprocess.PIPE,
                 stderr: Any = subprocess.PIPE, start_new_session: bool = False) -> None:
        reads: list[Optional[int]] = []
        writes: list[Optional[int]] = []
        for wanted in (stdout, stderr):
            if wanted == subprocess.PIPE:
                read, write = os.pipe()
                reads.append(read)
                writes.append(write)
            elif wanted == subprocess.DEVNULL:
                reads.append(None)
                writes.append(None)
            else:
                raise ValueError(f"ForkedJob: stdout/stderr={wanted!r}: allowed: subprocess.PIPE, subprocess.DEVNULL")
        argv = [os.path.join(os.path.dirname(sys.executable), script), *args]
        self._process = _context().Process(target=_run_job, args=(
            (HandedFd(writes[0], onto=1), HandedFd(writes[1], onto=2)), script, argv, str(cwd), dict(env),
            start_new_session))
        self._process.start()
        for fd in writes:
            if fd is not None:
                os.close(fd)
        self.stdout, self.stderr = (None if fd is None else open(fd, encoding="utf-8", errors="replace")
                                    for fd in reads)
        self.pid: int = self._process.pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[Optional[str], Optional[str]]:
        """Read both pipes to their end and wait; ``TimeoutExpired`` if the job is not over within ``timeout``."""
        texts: dict[str, str] = {}
        readers = [threading.Thread(target=lambda name=name, pipe=pipe: texts.__setitem__(name, pipe.read()),
                                    daemon=True) for name, pipe in (("out", self.stdout), ("err", self.stderr))
                   if pipe is not None]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self._process.name, timeout)
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()
        self.wait(timeout)
        return texts.get("out"), texts.get("err")

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self._process.kill()


def run(script: str, args: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``, forked."""
    job = ForkedJob(script, args, cwd, env)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    return subprocess.CompletedProcess([script, *args], job.returncode, out, err)
