"""When a peer dies or stops participating: one line naming the missing rank and the collective, not a hang.

Every collective the strategy waits on is marked with :func:`waiting_in` ("all-reduce of bucket 2 at step 17").
A peer killed mid-step closes its sockets, and Gloo fails the survivors' pending collective at once (NCCL may
not: over NVLink or shared memory its kernels can wait on a dead peer until the watchdog's timeout, and a host
blocked in a device read behind them runs no Python code: not yet verified on GPUs); a peer that is alive but stuck
lets them wait until the process group's timeout (``strategy.timeout_s``). Either way the
strategy's ``on_exception`` turns the backend's error into :func:`diagnose`'s single line: which collective was in
flight, and which ranks did not answer a roll call through the rendezvous store (a rank that is gone, or stuck,
cannot answer; if the store itself is gone, rank 0 — its host — is). ``lsd-train`` prints that line and exits 1.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist

_current: list[str] = []
_failed_in: list[str] = []  # the innermost marked collective an exception left (the stack is unwound by then)

#: Substrings of the errors Gloo and NCCL raise when a peer is gone or a collective timed out.
_SIGNATURES = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "nccl", "gloo",
               "peer", "socket")


@contextmanager
def waiting_in(what: str) -> Iterator[None]:
    """Mark the collective being waited on, for the failure message."""
    _current.append(what)
    try:
        yield
    except BaseException:
        if not _failed_in:
            _failed_in.append(what)
        raise
    finally:
        _current.pop()


def in_flight() -> str:
    """The collective that failed (or is being waited on)."""
    if _failed_in:
        return _failed_in[0]
    return _current[-1] if _current else "a collective"


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a communication failure (a peer gone, a collective timed out)."""
    dist_error = getattr(dist, "DistError", ())
    text = str(err).lower()
    return isinstance(err, dist_error) or (isinstance(err, RuntimeError) and any(s in text for s in _SIGNATURES))


def missing_ranks(rank: int, world: int, wait_s: float = 3.0) -> Optional[list[int]]:
    """Ranks that do not answer a roll call in the rendezvous store within ``wait_s`` (``None``: no store)."""
    if rank != 0 and not _store_reachable():
        return None  # do not even ask: a failing store client prints a C++ stack trace
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"static_dist/roll_call/{rank}", "here")
        deadline = time.monotonic() + wait_s
        while True:
            answered = {r for r in range(world) if store.check([f"static_dist/roll_call/{r}"])}
            if len(answered) == world or time.monotonic() > deadline:
                return sorted(set(range(world)) - answered)
            time.sleep(0.05)
    except Exception:  # the store's host (rank 0's process) is gone
        return None


def _store_reachable() -> bool:
    """Whether the rendezvous store's TCP server (in rank 0's process) still accepts connections."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return True  # another rendezvous: let the store client find out
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except OSError:
        return False


def diagnose(err: BaseException, rank: int, world: int, step: int) -> str:
    """One line: which ranks stopped participating, during which collective, and the backend's own reason."""
    missing = missing_ranks(rank, world)
    if missing is None:
        who = "rank 0 (the host of the rendezvous store) is gone"
    elif missing:
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} stopped participating"
    else:
        who = "every rank answered the roll call, yet the collective failed"
    where = in_flight()
    _failed_in.clear()  # the next failure in this process is about its own collective
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    reason = re.sub(r"^\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*", "", reason).split(". ")[0]  # drop the C++ source location
    return f"static_dist: rank {rank}: {who} during {where} at step {step} ({reason[:160]})"
