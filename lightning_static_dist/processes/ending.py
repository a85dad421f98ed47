"""How the processes of a multi-rank job end: after a failure, each rank says what happened once (one line, or its own
traceback) and leaves with status 1; the process that started the other local ranks leaves only after them, with the
worst status of all.

A rank's exception that nobody catches goes to :func:`install_excepthook`'s hook. The front end explains it first
(the Trainer strategy's ``on_exception`` has printed the failure's one line already; Fabric has no such hook, so its
strategy diagnoses here): an explained exception prints no traceback on top of its line, any other prints its
traceback once. Either way the process then leaves without the interpreter's teardown, which could wait for a peer
that is gone (``compat.exit_after_failure``).

The launching process (rank 0 of Lightning's ``popen`` launcher, and ``lsd-train``) hosts the rendezvous store and
started the other ranks of its node. :class:`LocalRanks` waits for them when it leaves (``compat.before_leaving``,
and ``atexit`` for a script that ends normally): a rank that fails after the last collective (an exception in
``on_train_end``) still reaches the exit status, no rank outlives the command, and one that does not end within
:attr:`LocalRanks.finish_s` (:attr:`LocalRanks.grace_s` once any rank failed) is killed, with a line that says so.

Example (what ``StaticDistLauncher.launch`` does once it started the other ranks)::

    ranks = LocalRanks(launcher.procs, first_rank=1, stop_watching=observer.stop)
    ranks.register()        # every exit of this process waits for them and takes the worst status
"""

from __future__ import annotations

import atexit
import functools
import gc
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Callable, Optional

import torch.distributed as dist

from lightning_static_dist.compat import before_leaving, exit_after_failure


@functools.cache
def freeze_heap_at_exit() -> None:
    """At this process's exit, after the package's own last collection (``compat.destroy_process_groups_at_exit``,
    registered later, runs earlier), move every object still alive into the collector's permanent generation
    (``gc.freeze``), once per process.

    Why, and what it skips: docs/internals.md, "processes/ending.py: freeze_heap_at_exit".
    Nothing is frozen while a process group is still there (after a failure, or where the groups' destruction was
    registered first): the finalisation collects the groups' native objects then, as without this."""
    atexit.register(_freeze_once_groups_are_gone)


def _freeze_once_groups_are_gone() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        gc.freeze()


#: The front end's explanation of an uncaught exception: ``True`` when the one line that says what happened was
#: printed (no traceback then). The latest strategy set up in this process is the one asked.
Explain = Callable[[BaseException], bool]

_explain: list[Explain] = []


def install_excepthook(explain: Explain) -> None:
    """Let ``explain`` see this process's uncaught exceptions first (once per process; a later call replaces the
    front end asked). An ``Exception`` it explains prints no traceback; any other prints its traceback through the
    previous hook. Then the process leaves with status 1, without the interpreter's teardown. ``KeyboardInterrupt``
    and the like go to the previous hook alone."""
    if not _explain:
        previous = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException, trace: Optional[TracebackType]) -> None:
            if not isinstance(error, Exception):
                previous(kind, error, trace)
                return
            try:
                explained = _explain[-1](error)
            except Exception:  # (a failure while explaining one: the traceback still says what happened)
                explained = False
            if not explained:
                previous(kind, error, trace)
            exit_after_failure(1)

        sys.excepthook = hook
        _explain.append(explain)
    _explain[-1] = explain


def in_chain(error: BaseException, reported: Optional[BaseException]) -> bool:
    """Whether ``reported`` is ``error`` or what it was raised from or while handling (a script that wraps the
    strategy's exception in its own)."""
    seen: Optional[BaseException] = error
    while seen is not None and reported is not None:
        if seen is reported:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def exit_status(returncode: Optional[int]) -> int:
    """A child's status as a shell reports it: a signal's death as 128 + its number (SIGKILL: 137)."""
    if returncode is None:
        return 0
    return 128 - returncode if returncode < 0 else returncode


class LocalRanks:
    """The ranks a launching process started on its node, waited for when it leaves.

    Args:
        procs: the started processes, in rank order (Lightning's ``_SubprocessScriptLauncher.procs``).
        first_rank: the global rank of ``procs[0]``.
        stop_watching: stops the launcher's own watcher, which would kill this process while it waits.
    """

    finish_s = 60.0
    """Seconds the ranks get to end after this one, when nothing failed (they finished the same last step)."""
    grace_s = 10.0
    """Seconds they get once any rank failed: a rank blocked behind the failed one ends through its peer watchdog
    (a heartbeat, then ``PeerWatchdog.settle_s``), with a line naming it."""

    def __init__(self, procs: Sequence[subprocess.Popen], first_rank: int, stop_watching: Callable[[], None]) -> None:
        self._procs = procs
        self._first_rank = first_rank
        self._stop_watching = stop_watching
        self._status: Optional[int] = None

    def register(self) -> None:
        """Wait for the ranks at every exit of this process: ``os._exit`` through ``compat`` and a normal one."""
        before_leaving(self.end)
        atexit.register(self._end_at_exit)

    def end(self, code: int) -> int:
        """Wait for every rank started here to end (killing those that outstay the bound), and return the status to
        leave with: ``code`` where it says this process failed, else the first failed rank's (once per process: a
        second call returns the first answer)."""
        if self._status is not None:
            return self._status
        self._stop_watching()
        started = failed_at = time.monotonic()
        failed = code != 0
        while True:
            running = [proc for proc in self._procs if proc.poll() is None]
            if not running:
                break
            if not failed and any(proc.returncode for proc in self._procs):
                failed, failed_at = True, time.monotonic()
            waited = time.monotonic() - (failed_at if failed else started)
            if waited > (self.grace_s if failed else self.finish_s):
                self._kill(running, waited)
                break
            time.sleep(0.01)  # (a rank's end is seen within 10 ms: the job's end waits on it)
        statuses = [exit_status(proc.returncode) for proc in self._procs]
        self._status = code or next((status for status in statuses if status), 0)
        return self._status

    def _kill(self, running: list[subprocess.Popen], waited: float) -> None:
        for proc in running:
            rank = self._first_rank + list(self._procs).index(proc)
            print(f"static_dist: rank {rank} had not ended {waited:.0f} s after this launching process; killed",
                  file=sys.stderr, flush=True)
            proc.send_signal(signal.SIGKILL)
        for proc in running:
            proc.wait()

    def _end_at_exit(self) -> None:
        """A script's normal exit (its own status unknown here): where a rank it started failed, leave with that
        rank's status instead of 0."""
        if self._status is not None:
            return
        status = self.end(0)
        if status != 0:
            exit_after_failure(status)
