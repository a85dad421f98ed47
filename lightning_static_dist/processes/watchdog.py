"""A rank whose peer died while it was blocked where no error can reach it: one line and exit 1, not a SIGKILL.

:class:`PeerWatchdog` is a daemon thread beside the training loop: it writes this rank's heartbeat to the
rendezvous store every second, reads its neighbours', and, once a peer is dead (or a verdict names this rank) and the
main thread has stood still for :attr:`PeerWatchdog.settle_s`, prints a line of
:func:`~lightning_static_dist.agreement.faults.diagnose`'s form and ends the process with status 1. It stops with
:meth:`PeerWatchdog.stop` or when its process group is destroyed. Why it is needed and how a death is told:
docs/internals.md, "processes/watchdog.py".
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Optional

import torch.distributed as dist

from lightning_static_dist.compat import exit_after_failure
from lightning_static_dist.agreement.faults import (STORE_HOST_GONE, VERDICT_KEY, Verdict, failure_line, in_flight,
                                                    posted_verdict, rendezvous_store, stopped_participating,
                                                    store_reachable)

log = logging.getLogger(__name__)

THREAD_NAME = "static_dist-peer-watchdog"

def _alive_key(rank: int) -> str:
    return f"static_dist/alive/{rank}"


def _pid_namespace() -> str:
    """This process's pid namespace on this boot of this machine: containers on one host may share a hostname, not
    their process ids, and the first pid namespace has the same name on every Linux host (the boot id tells them
    apart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _own_client(store: dist.Store, timeout_s: float) -> dist.Store:
    """A store client of the watchdog's own: one client's blocking call (the main thread's rendezvous ``get``
    waiting for a late rank) holds that client until it returns, and a heartbeat queued behind it would stop."""
    clone = getattr(store, "clone", None)
    client = clone() if clone is not None else store
    client.set_timeout(timedelta(seconds=timeout_s))
    return client


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended (a zombie its parent has not reaped yet has ended too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class _Heard(NamedTuple):
    count: int
    since: float  # when this rank first read that count (its own monotonic clock)
    state: str


class PeerWatchdog:
    """Writes this rank's heartbeat to the rendezvous store and reads its neighbours'; when one dies and no error
    reaches this process within :attr:`settle_s`: one line on stderr, and ``os._exit(1)``.

    Example::

        watchdog = PeerWatchdog(rank, world, step=lambda: trainer.global_step, failed=lambda: reporting_a_failure)
        watchdog.start()              # once the process group exists (nothing happens while it runs)
        ...
        watchdog.stop(clean=True)     # at teardown; clean=False after a failure: peers then see this rank's exit
    """

    interval_s = 1.0
    """Seconds between heartbeats."""
    same_host_s = 2.0
    """A neighbour on this host is dead when its heartbeat has not moved for this long and its process is gone."""
    other_host_s = 60.0
    """A neighbour on another host is dead when its heartbeat has not moved for this long: far above any pause of a
    heartbeat thread (only a native call that holds the GIL stops it; a slow step, a compile, a checkpoint do not)."""
    settle_s = 4.0
    """Seconds left to the main thread's own failure path (where a collective fails, it fails at once) before the
    watchdog speaks. Detection plus this stays under the launcher's grace (``StaticDistLauncher.grace_s``)."""
    neighbours = 4
    """Ranks read on each side (r-4 ... r+4, wrapping around), and rank 0, the store's host, by every rank."""
    store_misses = 3
    """Heartbeats in a row the store must refuse before its host, rank 0, counts as gone."""

    def __init__(self, rank: int, world: int, step: Callable[[], int], failed: Callable[[], bool]) -> None:
        """``step``: the training step, for the heartbeat and the line; ``failed``: whether the main thread has
        started reporting a failure itself (both are read from the watchdog's thread)."""
        self.rank = rank
        self._step, self._failed = step, failed
        around = {(rank + d) % world for d in range(-self.neighbours, self.neighbours + 1)}
        self._peers = sorted((around | {0}) - {rank})
        self._host, self._namespace = socket.gethostname(), _pid_namespace()
        self._count = 0
        self._misses = 0
        self._store: Optional[dist.Store] = None
        self._clean = True
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._group: Optional[dist.ProcessGroup] = None  # the process group watched: the thread ends with it

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start heartbeating (nothing happens while it runs), until :meth:`stop` or the end of this process group."""
        if self.running:
            return
        self._stop, self._clean = threading.Event(), True  # an old thread that outlived its join keeps its own event
        self._store = _own_client(rendezvous_store(), timeout_s=2 * self.interval_s)
        self._group = dist.group.WORLD
        self._thread = _HeartbeatThread(self, self._stop)
        self._thread.start()
        # a process that never tears the strategy down (Lightning's own spawn launcher, a script's setup_environment
        # alone) must not reach the interpreter's finalisation with this thread inside a store call: CPython 3.11
        # ends such a daemon thread with pthread_exit, whose unwinding through pybind11's GIL release is
        # std::terminate (SIGABRT, "terminate called without an active exception"). atexit runs before that.
        atexit.register(self._stop_at_exit)

    def stop(self, clean: bool = True) -> None:
        """Stop, quietly (nothing happens when stopped). ``clean``: the last heartbeat says so, and the peers do not
        take this process's exit for a death; after a failure it does not, and a peer blocked behind this rank
        learns of its exit."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        atexit.unregister(self._stop_at_exit)
        self._clean = clean
        self._stop.set()  # from here on the thread neither prints nor exits
        thread.join(timeout=5.0)
        if not thread.is_alive():
            self._store = None  # its own store client closed now, not by the interpreter's finalisation

    def _stop_at_exit(self) -> None:
        """Stopped by the interpreter's exit or by its thread's ``stop()``, not by the strategy's teardown: clean only
        where this rank reported no failure (a rank leaving on an uncaught error must still look gone to its peers)."""
        self.stop(clean=not self._failed())

    def _run(self, stop: threading.Event) -> None:
        heard: dict[int, _Heard] = {}
        while not stop.is_set():
            if dist.group.WORLD is not self._group:
                break  # the group was destroyed (or replaced): nothing left to watch, and no peer's exit is a death
            death = self._quietly(lambda: self._beat(heard))
            if death is not None:
                self._report(stop, death)
                return
            stop.wait(self.interval_s)
        if self._clean:
            self._quietly(lambda: self._write("stopped"))

    def _quietly(self, tick: Callable[[], Any]) -> Any:
        """``tick()``, whose error is logged, not raised: a missed heartbeat is no failure of training."""
        try:
            return tick()
        except Exception as err:
            log.debug(f"static_dist: peer watchdog of rank {self.rank}: {err}")
            return None

    def _write(self, state: str) -> bool:
        """This rank's heartbeat; ``False`` when the store no longer accepts connections (not even asked then: a
        store client whose server is gone prints C++ stack traces)."""
        if not store_reachable():
            return False
        self._count += 1
        beat = {"count": self._count, "state": state, "pid": os.getpid(), "host": self._host, "ns": self._namespace,
                "step": self._step(), "in": in_flight(unmarked="")}
        self._store.set(_alive_key(self.rank), json.dumps(beat))
        return True

    def _beat(self, heard: dict[int, _Heard]) -> Optional[Verdict]:
        """One heartbeat: the verdict on a death seen here or posted by another rank, else ``None``."""
        if not self._write("running"):
            self._misses += 1
            rank_zero = heard.get(0)
            if self._misses < self.store_misses or (rank_zero is not None and rank_zero.state == "stopped"):
                return None  # a moment's refusal, or rank 0 ended its fit cleanly
            return Verdict(who=STORE_HOST_GONE, ranks=(0,), by=self.rank, during=in_flight(), step=self._step(),
                           reason="its store no longer accepts connections")
        self._misses = 0
        store = self._store
        posted = posted_verdict(store)
        if posted is not None:
            return posted
        keys = [_alive_key(peer) for peer in self._peers]
        if not store.check(keys):
            return None  # a neighbour has not started its watchdog yet
        now = time.monotonic()
        for peer, raw in zip(self._peers, store.multi_get(keys)):
            beat = json.loads(raw)
            last = heard.get(peer)
            if last is None or last.count != beat["count"] or last.state != beat["state"]:
                heard[peer] = _Heard(beat["count"], now, beat["state"])
                continue
            reason = self._death(beat, now - last.since)
            if reason is not None:
                seen = Verdict(who=stopped_participating([peer]), ranks=(peer,), by=self.rank,
                               during=in_flight(), step=self._step(), reason=reason)
                post_verdict_to(store, seen)  # the first verdict posted stays: every rank reports that one
                return seen
        return None

    def _death(self, beat: dict[str, Any], quiet_s: float) -> Optional[str]:
        """Why a neighbour whose heartbeat has not moved for ``quiet_s`` is dead (``None``: it is not, or not yet)."""
        if beat["state"] == "stopped":
            return None
        if (beat["host"], beat["ns"]) == (self._host, self._namespace):
            if quiet_s > self.same_host_s and _process_gone(beat["pid"]):
                return "its process is gone"
        elif quiet_s > self.other_host_s:
            doing = f"at step {beat['step']}" + (f", in {beat['in']}" if beat["in"] else "")
            return f"no heartbeat from {beat['host']} for {quiet_s:.0f} s, the last {doing}"
        return None

    def _report(self, stop: threading.Event, verdict: Verdict) -> None:
        """The line and exit 1 — once the main thread has stood still for :attr:`settle_s` without reporting a
        failure itself. A main thread that still runs Python (a long validation, a checkpoint upload) gets to its
        next collective, which fails, and its own failure path speaks; one that stands still is blocked where no
        error reaches it. A rank the verdict names is the one the others gave up on: it ends after one heartbeat's
        pause (the rank that gave up may be killing it), wherever its main thread is."""
        main = threading.main_thread().ident
        if self.rank in verdict.ranks:
            if stop.wait(self.interval_s) or self._failed():
                return
            self._leave(verdict.named_line(self.rank, _place_of(main)))
        where = _frame_of(main)
        while not stop.wait(self.settle_s):
            if self._failed():
                return
            now = _frame_of(main)
            if now == where:
                self._leave(failure_line(self.rank, verdict.who, self._step(),
                                         f"{verdict.reason_for(self.rank)}; this rank was blocked where no error"
                                         " reached it"))
            where = now

    @staticmethod
    def _leave(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        # the main thread is where no exception reaches it: no interpreter teardown to wait for (a launching process
        # still waits for the ranks it started: compat.exit_after_failure)
        exit_after_failure(1)


def post_verdict_to(store: dist.Store, verdict: Verdict) -> None:
    """:func:`~lightning_static_dist.agreement.faults.post_verdict` through the watchdog's own store client."""
    store.compare_set(VERDICT_KEY, "", json.dumps(asdict(verdict)))


def _place_of(thread_id: Optional[int]) -> str:
    """Where a thread's innermost Python frame is, as a person reads it: ``training_step at faulty.py:150``."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return ""
    return f"{frame.f_code.co_name} at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class _HeartbeatThread(threading.Thread):
    """The watchdog's daemon thread, with the ``stop()`` by which Lightning's test suite (and anyone holding the
    thread, in a notebook) ends a daemon thread left behind: the watchdog stopped, clean unless this rank failed."""

    def __init__(self, watchdog: PeerWatchdog, stop: threading.Event) -> None:
        super().__init__(target=watchdog._run, args=(stop,), name=THREAD_NAME, daemon=True)
        self._watchdog = watchdog
        self._stop_event = stop

    def stop(self) -> None:
        if self._watchdog._thread is self:
            self._watchdog._stop_at_exit()
            return
        # a thread the watchdog no longer holds (stopped already, its join timed out; or a newer one runs): end this
        # one alone, by its own event, leaving the watchdog's current thread as it is
        self._stop_event.set()
        self.join(timeout=5.0)


def _frame_of(thread_id: Optional[int]) -> Optional[tuple[int, int]]:
    """Where a thread is: its innermost Python frame's code and line (``None``: not running Python)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    return None if frame is None else (id(frame.f_code), frame.f_lineno)
