"""Run a function on N real processes joined by a real Gloo process group; collect each rank's result.

No mocked collectives: every test that uses this starts ``world_size`` processes, initialises ``torch.distributed``
with Gloo over localhost, and returns what each rank returned (picklable values). A rank that raises fails the test
with its traceback; a rank that hangs fails it after ``timeout`` seconds.

The ranks are new processes forked from a fork server that imported torch, Lightning and this package once per
pytest process (``forkserver`` with a preload list): a rank starts in a fraction of a second instead of importing
for seconds, as a spawned one does. Each rank still begins clean (nothing of the test process's state but the
environment, which the rank takes over from the caller at the call) and unpickles the function it runs.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_static_dist.processes.launcher import StaticDistSpawnLauncher


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                    "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def fresh_job_env() -> dict[str, str]:
    """os.environ without the launch variables, for a job started as a user starts it from a shell.

    With LOCAL_RANK set, Lightning waits for ranks that someone else starts (torchrun's contract) instead of
    starting them: a test run under a launcher, or a leak from an in-process test, would hang the job.
    """
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a rank's fork server has imported before it forks a rank (so that no rank imports it again; the test helpers
# themselves are imported by each rank, cheaply: the server's sys.path is not pytest's)
_PRELOAD = ["torch._inductor.compile_fx", "lightning.pytorch", "lightning_static_dist"]


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # (read when the server starts: the first rank of the pytest process)
    return ctx


class HandedFd:
    """One of the caller's file descriptors, handed to a process forked from the fork server as it starts (that child
    would write to the server's descriptors, whichever test's capture they were). In the child it arrives
    duplicated onto ``onto`` (1, 2: its stdout, stderr) when given, and unpickles to the descriptor; ``fd=None``
    hands over /dev/null. Give it before any other argument, so that an error unpickling them prints where the test
    reads."""

    def __init__(self, fd: Optional[int], onto: Optional[int] = None) -> None:
        self.fd, self.onto = fd, onto

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction  # (DupFd: only while the child's process object is pickled to start it)

        return _arrive, (None if self.fd is None else reduction.DupFd(self.fd), self.onto)


def _arrive(handed: Any, onto: Optional[int]) -> int:
    fd = os.open(os.devnull, os.O_RDWR) if handed is None else handed.detach()
    if onto is not None:
        os.dup2(fd, onto)
    return fd


def _callers_stdio() -> tuple[HandedFd, HandedFd]:
    """The caller's stdout and stderr for a rank: its output goes where the test reads it, as a spawned one's."""
    return HandedFd(1, onto=1), HandedFd(2, onto=2)


def _enter(rank: int, world_size: int, port: int, environ: dict[str, str]) -> None:
    """A rank takes the caller's environment (a fork server's child inherits the server's, from its start)."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)


def _worker(stdio: tuple[int, int], job: bytes, rank: int, world_size: int, port: int, queue: Any,
            environ: dict[str, str]) -> None:
    # (stdio first: an error unpickling what follows prints where the test reads; the function and its arguments are
    # unpickled only here, after the caller's environment is in place, so that a test module's import reads it)
    _enter(rank, world_size, port, environ)
    try:
        fn, args = pickle.loads(job)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # plain pickle (by value): torch's queue would share tensors through file descriptors that die with us
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return the results ordered by rank."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    job = pickle.dumps((fn, args))
    procs = [ctx.Process(target=_worker, args=(_callers_stdio(), job, r, world_size, port, queue, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    failed = True
    try:
        results = _collect(queue, world_size, timeout)
        failed = False
    finally:
        for p in procs:
            p.join(timeout=0.5 if failed else 5)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def _collect(outbox: Any, world_size: int, timeout: float) -> list[Any]:
    """Each rank's result from ``outbox``, ordered by rank; ``AssertionError`` with the first failing rank's traceback,
    or naming the ranks that sent nothing within ``timeout`` (hung, or died without reporting)."""
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, value = outbox.get(timeout=timeout)
            if status != "ok":  # (the other ranks are likely blocked in a collective now: not waited for)
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    except AssertionError:
        raise
    except Exception as err:  # queue.Empty
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"no result from ranks {missing} within {timeout}s ({err!r})") from None
    return [results[r] for r in range(world_size)]


def _pool_worker(stdio: tuple[int, int], rank: int, world_size: int, port: int, inbox: Any, outbox: Any,
                 environ: dict[str, str]) -> None:
    _enter(rank, world_size, port, environ)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:  # (a port taken since it was probed): the first call fails naming it, not by its timeout
        outbox.put((rank, "error", traceback.format_exc()))
        return
    try:
        while (job := inbox.get()) is not None:
            fn, args = job
            try:
                outbox.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
            except BaseException:
                outbox.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` ranks joined by one real Gloo group, kept for several functions: one start-up for a module's cases.

    ``pool.run(fn, args)`` is :func:`run_ranks` on ranks that already exist: each rank runs ``fn(rank, world_size,
    *args)`` in the default group and hands back its result. A rank that raises or hangs fails the call as in
    :func:`run_ranks` and ends the ranks (the others may be blocked in a collective); the next call starts new ones.
    Only for functions that leave the default group as they found it.

        @pytest.fixture(scope="module")
        def ranks() -> Iterator[RankPool]:
            with RankPool(2) as pool:
                yield pool
    """

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        environ = dict(os.environ)
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_pool_worker,
                                   args=(_callers_stdio(), r, self.world_size, port, self._inboxes[r], self._outbox,
                                         environ))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], args: tuple = (), timeout: float = 120.0) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results ordered by rank."""
        if not self._procs:
            self._start()
        for inbox in self._inboxes:
            inbox.put((fn, args))
        try:
            return _collect(self._outbox, self.world_size, timeout)
        except AssertionError:
            self.close(grace=0.5)
            raise

    def close(self, grace: float = 5.0) -> None:
        for inbox, p in zip(self._inboxes if self._procs else [], self._procs):
            if grace > 1 and p.is_alive():
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _joined(rank: int, world_size: int, fn: Callable[..., Any], args: tuple) -> Any:
    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: the front end joins it instead of launching
    return fn(*args)


def on_joined_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> list[Any]:
    """``fn(*args)`` (a function that builds a Trainer, or Fabric, of ``devices=world_size`` and runs it) on fresh ranks
    that :func:`run_ranks` started: each rank's result. The front end finds the ranks' group and joins it, as under
    torchrun; build the strategy inside ``fn`` with the default start method (one made for ``spawn`` would start ranks
    of its own). Only for cases that do not check how the ranks start or end (the launchers)."""
    return run_ranks(_joined, world_size, args=(fn, args), timeout=300)


def fit_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> Any:
    """:func:`on_joined_ranks`, rank 0's result (a Trainer's fit: every rank ends with the same weights)."""
    return on_joined_ranks(fn, *args, world_size=world_size)[0]


def _fabric_launch(make_strategy: Callable[[], Any], fn: Callable[..., Any], args: tuple, world_size: int) -> Any:
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=world_size, strategy=make_strategy()).launch(fn, *args)


def fabric_launch(make_strategy: Callable[[], Any], fn: Callable[..., Any], *args: Any, world_size: int = 2) -> Any:
    """``Fabric(accelerator="cpu", devices=world_size, strategy=make_strategy()).launch(fn, *args)`` on joined ranks
    (:func:`on_joined_ranks`): rank 0's result. ``make_strategy`` (a class, or a ``functools.partial`` of one) builds
    the strategy on each rank."""
    return fit_on_ranks(_fabric_launch, make_strategy, fn, args, world_size, world_size=world_size)


class ReferenceDDP(DDPStrategy):
    """Lightning's own ``DDPStrategy`` — the reference the tests compare against — started with ``spawn``.

    Its ranks are started by :class:`~lightning_static_dist.processes.launcher.StaticDistSpawnLauncher` (Lightning's spawn
    launcher whose ranks leave with ``os._exit`` after ``fit``): with torch 2.13 + Gloo a finished rank sometimes
    aborts in the interpreter's teardown (SIGABRT, "terminate called without an active exception"), which would
    fail a comparison for a reason that is not the comparison's. DDP's training is untouched.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(start_method="spawn", **kwargs)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = StaticDistSpawnLauncher(self, start_method="spawn")


def reference_ddp(**kwargs: Any) -> ReferenceDDP:
    return ReferenceDDP(**kwargs)
