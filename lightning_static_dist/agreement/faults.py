"""When a peer dies or stops participating: one line naming the missing rank and the collective, not a hang.

Every collective the strategy waits on is marked with :func:`waiting_in`; the strategy's ``on_exception`` turns a
backend error into :func:`diagnose`'s single line (the collective in flight, the ranks that did not answer a roll
call), and ranks agree on the cause through a :class:`Verdict` in the rendezvous store. A failure every rank learnt
of from one collective is an :class:`AgreedFailure`. :func:`record_nccl_flight` has torch's NCCL watchdog write its
flight recorder under the run directory. How faults are told apart: docs/internals.md, "agreement/faults.py".
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lightning_static_dist.ddp_arguments import device_backend

_current: list[str] = []
_failed_in: list[tuple[str, BaseException]] = []  # the innermost marked collective an exception left, and the exception
# (the stack is unwound by then)

#: Who is missing when the rendezvous store no longer answers: the process that hosts it.
STORE_HOST_GONE = "rank 0 (the host of the rendezvous store) is gone"

#: Where torch's collectives, their Python side, live: an error raised there came from communication.
_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep

#: Where the ranks post what they saw of a failure (:class:`Verdict`): the first one posted stays.
VERDICT_KEY = "static_dist/death"


class AgreedFailure(Exception):
    """A failure every rank raises at the same point, having learnt it from a collective that told them all (a
    non-finite average): no peer is missing, so there is no roll call and no traceback. Its message is the one line;
    rank 0 prints it for the job, the other ranks leave with the same status in silence.

    Example::

        class NonfiniteGradientError(AgreedFailure, FloatingPointError): ...
    """


@contextmanager
def waiting_in(what: str) -> Iterator[None]:
    """Mark the collective being waited on, for the failure message (and for :func:`is_collective_failure`: an error
    that leaves this block came from the collective)."""
    _current.append(what)
    try:
        yield
    except BaseException as err:
        if not _failed_in:
            _failed_in.append((what, err))
        raise
    finally:
        _current.pop()


def enter_collective(what: str) -> None:
    """Mark a region whose collectives no Python frame of this package waits on (graph mode's collectives run inside
    the compiled backward): until :func:`leave_collective`, an error is taken for the collective's. A region left
    open by an exception stays open for the failure path to read; the one that entered it closes it."""
    _current.append(what)


def leave_collective(what: str) -> None:
    """Close a region :func:`enter_collective` opened (nothing when it is not open)."""
    if what in _current:
        _current.remove(what)


def in_flight(unmarked: str = "a collective") -> str:
    """The collective that failed (or is being waited on); ``unmarked`` when none is. Also read from the peer
    watchdog's thread: each list is read once (a slice), as the main thread may pop it between a test and an index."""
    failed, current = [what for what, _ in _failed_in[:1]], _current[-1:]
    return (failed or current or [unmarked])[0]


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a communication failure (a peer gone, a collective timed out), told by where it came from,
    never by its words: a ``torch.distributed`` error type (``DistBackendError``, ``DistNetworkError``,
    ``DistStoreError`` ...), or a ``RuntimeError`` (Gloo raises plain ones) that left a marked collective
    (:func:`waiting_in`), raised while a collective region was open (:func:`enter_collective`: graph mode's backward),
    or raised inside ``torch.distributed`` itself (a collective of Lightning's or of the user's code). A user's own
    ``RuntimeError("Timed out ... Connection reset by peer")``, or an out-of-memory error, is not one: its rank
    prints its traceback."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    if not isinstance(err, RuntimeError) or isinstance(err, torch.OutOfMemoryError):
        return False
    return any(failed is err for _, failed in _failed_in[:1]) or bool(_current) or _raised_in_torch_distributed(err)


def collective_failed() -> bool:
    """Whether an exception left a marked collective (:func:`waiting_in`) in this process, not forgotten since: a peer
    may be gone (a front end without an exception hook reads it at teardown: ``fabric/processes.py``)."""
    return bool(_failed_in)


def forget_failure() -> None:
    """A collective's failure handled where it happened (the job stops anyway): no later line names it."""
    _failed_in.clear()


def _raised_in_torch_distributed(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is torch.distributed's Python code (where a native collective
    call raises)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_TORCH_DISTRIBUTED)


def missing_ranks(rank: int, world: int, wait_s: float = 3.0) -> Optional[list[int]]:
    """Ranks that do not answer a roll call in the rendezvous store within ``wait_s`` (``None``: no store)."""
    if rank != 0 and not store_reachable():
        return None  # do not even ask: a failing store client prints a C++ stack trace
    try:
        store = rendezvous_store()
        store.set(f"static_dist/roll_call/{rank}", "here")
        deadline = time.monotonic() + wait_s
        while True:
            answered = {r for r in range(world) if store.check([f"static_dist/roll_call/{r}"])}
            if len(answered) == world or time.monotonic() > deadline:
                return sorted(set(range(world)) - answered)
            time.sleep(0.05)
    except Exception:  # the store's host (rank 0's process) is gone
        return None


def rendezvous_store() -> dist.Store:
    """The default process group's store, which every rank reaches (torch's accessor is private,
    ``distributed_c10d._get_default_store``: kept to this one place)."""
    return dist.distributed_c10d._get_default_store()


def store_reachable() -> bool:
    """Whether the rendezvous store's TCP server (in rank 0's process) still accepts connections."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return True  # another rendezvous: let the store client find out
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except OSError:
        return False


#: How launchers name a process's node (torchrun, Lightning's launcher, SLURM), and how many processes a node runs.
_NODE_VARIABLES = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
_PER_NODE_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def _env_int(names: tuple[str, ...]) -> Optional[int]:
    """The first of ``names`` set, as an integer (SLURM writes ``2(x3)`` for "2 on each of 3 nodes")."""
    value = next((os.environ[name] for name in names if os.environ.get(name)), "")
    digits = re.match(r"\d+", value)
    return int(digits.group()) if digits else None


def node_of(rank: int) -> Optional[int]:
    """The node ``rank`` runs on, where the job spans more than one (``None``: one node, or the launcher does not say).

    This process's own node is its launcher's word for it (``GROUP_RANK``, ``NODE_RANK``, ``SLURM_NODEID``); another
    rank's follows from the processes per node, as torchrun, Lightning and SLURM number the ranks node by node.
    """
    per_node = _env_int(_PER_NODE_VARIABLES)
    world = _env_int(("WORLD_SIZE", "SLURM_NTASKS"))
    if per_node is None or world is None or world <= per_node:
        return None
    own = _env_int(_NODE_VARIABLES) if rank == _env_int(("RANK", "SLURM_PROCID")) else None
    return own if own is not None else rank // per_node


def _named(ranks: list[int]) -> str:
    """``rank 1``, or ``ranks 1, 3``; each with its node where the job spans several: ``rank 1 (node 1)``."""
    nodes = [node_of(r) for r in ranks]
    named = [f"{r}" if node is None else f"{r} (node {node})" for r, node in zip(ranks, nodes)]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(named)}"


def failure_line(rank: int, who: str, step: int, reason: str) -> str:
    """The one line every failure path prints: who stopped, during which collective, at which step, and why."""
    return f"static_dist: {_named([rank])}: {who} during {in_flight()} at step {step} ({reason})"


def stopped_participating(ranks: list[int]) -> str:
    """Who stopped, as :func:`failure_line` takes it: ``rank 1 (node 1) stopped participating``."""
    return f"{_named(ranks)} stopped participating"


@dataclass(frozen=True)
class Verdict:
    """What a rank saw of a failure, posted in the rendezvous store for every rank (:func:`post_verdict`).

    Example::

        Verdict(who="rank 1 stopped participating", ranks=(1,), by=0, during="the gradient collective of bucket 0",
                step=3, reason="Timed out waiting 8000ms for recv operation to complete")
    """

    who: str
    """Who stopped, as a line says it (``rank 1 stopped participating``)."""
    ranks: tuple[int, ...]
    """The ranks it names."""
    by: int
    """The rank that saw it (the named rank itself when its own code raised)."""
    during: str
    """The collective ``by`` waited in ("" when its own code raised)."""
    step: int
    reason: str
    """Why: the backend's words, or what the named rank's own code raised."""

    def reason_for(self, rank: int) -> str:
        """The reason as ``rank`` reports it: who saw it, where that is another rank."""
        return self.reason if self.by == rank or self.by in self.ranks else f"{self.reason}, seen by rank {self.by}"

    def named_line(self, rank: int, where: str = "") -> str:
        """The line of a rank this verdict names (``rank`` in :attr:`ranks`): it is the one the others gave up on.
        ``where``: where its main thread was, if known."""
        at = f"; this rank was at {where}" if where else ""
        return (f"static_dist: {_named([rank])}: this rank stopped participating during {self.during or 'a step'} at"
                f" step {self.step} (rank {self.by} gave up waiting for it: {self.reason}{at})")


def post_verdict(verdict: Verdict) -> None:
    """Post ``verdict`` for every rank, unless one was posted first (that one stays). Nothing when the store is gone
    (its host, rank 0, is; then no verdict reaches anyone)."""
    try:
        if dist.get_rank() != 0 and not store_reachable():
            return  # (a store client whose server is gone prints C++ stack traces)
        rendezvous_store().compare_set(VERDICT_KEY, "", json.dumps(asdict(verdict)))
    except Exception:  # the job is failing anyway: the line this rank prints is what counts
        return


def posted_verdict(store: Optional[dist.Store] = None) -> Optional[Verdict]:
    """The verdict posted first (``None``: none, or no store). ``store``: a client of the caller's own."""
    try:
        if store is None:
            if dist.get_rank() != 0 and not store_reachable():
                return None
            store = rendezvous_store()
        if not store.check([VERDICT_KEY]):
            return None
        fields = json.loads(store.get(VERDICT_KEY))
        return Verdict(**{**fields, "ranks": tuple(fields["ranks"])})
    except Exception:
        return None


def post_own_failure(err: BaseException, rank: int, step: int) -> None:
    """This rank's own code raised ``err`` (not a collective): the others' lines name this rank and say so."""
    kind = type(err)
    raised = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    post_verdict(Verdict(who=stopped_participating([rank]), ranks=(rank,), by=rank, during="", step=step,
                         reason=f"it raised {raised}; its traceback is above"))


def diagnose(err: BaseException, rank: int, world: int, step: int) -> str:
    """One line: which ranks stopped participating, during which collective, and why (the cause a verdict posted for
    them gives, else the backend's words); posted as this rank's verdict. Where a verdict already names this rank
    (the others gave up waiting for it), the line says so instead of blaming the peer that left."""
    missing = missing_ranks(rank, world)
    posted = posted_verdict()
    if posted is not None and rank in posted.ranks and posted.by != rank:
        _failed_in.clear()
        return posted.named_line(rank)
    if missing is None:  # (rank 0 hosts the store: its own client failing does not make it gone)
        who = STORE_HOST_GONE if rank != 0 else "the rendezvous store did not answer"
    elif missing:
        who = stopped_participating(missing)
    else:
        who = "every rank answered the roll call, yet the collective failed"
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    reason = re.sub(r"^\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*", "", reason).split(". ")[0][:160]  # no C++ source location
    text = str(err).lower()
    dump = flight_recorder_file(rank) if "nccl" in text and ("timeout" in text or "timed out" in text) else None
    if dump is not None:
        reason += f"; flight recorder: {dump}"
    if missing:
        post_verdict(Verdict(who=who, ranks=tuple(missing), by=rank, during=in_flight(), step=step, reason=reason))
    if posted is not None and missing and sorted(posted.ranks) == missing:
        reason = posted.reason_for(rank)  # (what the missing rank's own code raised, or what another rank saw)
    line = failure_line(rank, who, step, reason)
    _failed_in.clear()  # the next failure in this process is about its own collective
    return line


#: torch's names for the flight recorder's size and its dump file's prefix (the rank is appended): ``TORCH_FR_*``
#: from torch 2.9 on, which still reads the ``TORCH_NCCL_*`` spellings, with a deprecation warning; older torch
#: reads only those.
_FR_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def record_nccl_flight(backend: str, device: torch.device, directory: str) -> None:
    """Have torch's NCCL watchdog dump its flight recorder to ``<directory>/nccl_flight_recorder_rank<R>`` when a
    collective times out, where ``device`` (this rank's) communicates through NCCL; variables the user set win.

    Call it before the process group exists. Its settings hold for the process (a later fit's dump goes where the
    first one's would). ``directory`` is the run's (the trainer's ``default_root_dir``); a remote one (``s3://...``)
    is replaced by the working directory. Why: docs/internals.md, "agreement/faults.py".
    """
    if dist.is_initialized():
        return  # the process group exists already: torch has read its settings (flight_recorder_file names none)
    if device_backend(backend, device.type) != "nccl":
        return
    spelling = 0 if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 9) else 1
    directory = os.getcwd() if "://" in directory else os.path.abspath(directory)
    if not any(name in os.environ for name in _FR_FILE):
        os.makedirs(directory, exist_ok=True)  # torch's writer opens the file; it does not make the folder
        os.environ[_FR_FILE[spelling]] = os.path.join(directory, "nccl_flight_recorder_rank")
    if not any(name in os.environ for name in _FR_SIZE):
        os.environ[_FR_SIZE[spelling]] = "2000"
    os.environ.setdefault(_DUMP_ON_TIMEOUT, "1")


def flight_recorder_file(rank: int) -> Optional[str]:
    """The file torch's NCCL watchdog dumps this rank's flight recorder to on a timeout (``None``: no dump asked
    for, or none where this project can name it: torch's default location depends on its version)."""
    if os.environ.get(_DUMP_ON_TIMEOUT, "").lower() not in ("1", "y", "yes", "t", "true"):
        return None
    size = next((os.environ[name] for name in _FR_SIZE if os.environ.get(name)), "0")
    if not size.isdigit() or int(size) == 0:
        return None  # a recorder of no entries writes nothing
    prefix = next((os.environ[name] for name in _FR_FILE if os.environ.get(name)), None)  # torch's order
    return f"{prefix}{rank}" if prefix else None
