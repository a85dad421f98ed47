"""What the strategy changes in Lightning's training loop, and why: one device synchronisation per step removed.

Installed on the strategy's trainer, :class:`HostSigtermBroadcast` replaces Lightning's per-step device broadcast of
the SIGTERM flag with an asynchronous all-reduce over a Gloo group, read ``lag`` steps later (2 by default): every
rank stops at the same step, writes ``last-preempted-step=<N>.ckpt`` and ends ``fit`` with exit status 143
(:data:`SIGTERM_EXIT`). SLURM's requeue signal rides the same rounds. How and why: docs/internals.md,
"processes/sigterm.py".

Private Lightning API: ``_TrainingEpochLoop._broadcast_sigterm_tensor`` (replaced on this trainer's loop instance
only, where it exists) and ``Trainer._signal_connector`` (its class swapped, on this trainer only, for a subclass
whose ``received_sigterm`` is a property, whose ``_sigterm_notifier_fn`` does not broadcast and whose
``_slurm_sigusr_handler_fn`` defers; the handlers are registered after the strategy's setup, so they are the
subclass's), ``Trainer._checkpoint_connector.hpc_save_path`` (the hpc checkpoint's name, for the line). Retire this
module when Lightning's loop stops reading the flag through the device.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import sys
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_static_dist.checkpoint import CheckpointError
from lightning_static_dist.agreement.faults import forget_failure, waiting_in
from lightning_static_dist.simulate import is_simulated

log = logging.getLogger(__name__)

_PATCHED = "_broadcast_sigterm_tensor"
#: steps between starting a round of the flags' all-reduce and reading it
LAG = 2
_ROUND = "the all-reduce of the ranks' SIGTERM flags"
#: the exit status of a run stopped by SIGTERM: 128 + the signal's number, what a shell reports for a process the
#: signal ended (Lightning's own ``SIGTERMException`` carries it from Lightning-AI/pytorch-lightning#21623 on; 2.6
#: leaves it ``None``, which Python turns into 0: "finished", to torchrun and to schedulers)
SIGTERM_EXIT = 128 + signal.SIGTERM


def sigterm_exit() -> BaseException:
    """Lightning's ``SIGTERMException`` with :data:`SIGTERM_EXIT` as its exit status, on any Lightning version."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    stop = SIGTERMException()
    if not stop.code:
        stop.code = SIGTERM_EXIT
    stop.static_dist_agreed = True  # type: ignore[attr-defined]  (Lightning's own per-rank stops carry no mark)
    return stop


def is_agreed_stop(exception: BaseException) -> bool:
    """Whether ``exception`` is the stop every rank agreed on (:func:`sigterm_exit`), not a ``SIGTERMException`` that
    Lightning's own per-rank check raised on one rank (validate or test, or a fit without the host group)."""
    return bool(getattr(exception, "static_dist_agreed", False))


@functools.cache
def _agreeing(connector_class: type) -> type:
    """A subclass of Lightning's signal connector whose ``received_sigterm`` is the flag every rank agreed on."""

    class AgreedSigterm(connector_class):  # type: ignore[valid-type, misc]
        agrees_on_sigterm = True

        @property
        def received_sigterm(self) -> bool:
            return self.__dict__.get("_agreed_sigterm", False)

        @received_sigterm.setter
        def received_sigterm(self, value: bool) -> None:  # the signal handler's write (False: Lightning's reset)
            self.__dict__["own_sigterm"] = value
            if not value:
                self.__dict__["_agreed_sigterm"] = False

        def _sigterm_notifier_fn(self, signum: Any, frame: Any) -> None:
            # Lightning's handler without its broadcast over the default group: from a signal handler, at any point
            # of the step, it would pair with whatever collective the other ranks issue next on that group (a
            # gradient bucket, or one of the flag rounds); the per-step round is how the ranks agree
            log.info(f"[rank: {self.trainer.local_rank}] Received SIGTERM: {signum}")
            if not self.__dict__.get("own_sigterm", False):
                launcher = self.trainer.strategy.launcher
                if launcher is not None:
                    launcher.kill(signum)  # the ranks this process started get the signal too, as in Lightning
            self.received_sigterm = True

        def _slurm_sigusr_handler_fn(self, signum: Any, frame: Any) -> None:
            # Lightning's handler saves a checkpoint (a collective here) from inside the signal handler, wherever in
            # the step the signal lands: counted here, and acted on at the step every rank agrees on
            # (HostSigtermBroadcast._requeue runs Lightning's handler there)
            self.__dict__["own_requeues"] = self.__dict__.get("own_requeues", 0) + 1

    AgreedSigterm.__name__ = AgreedSigterm.__qualname__ = f"AgreedSigterm{connector_class.__name__}"
    return AgreedSigterm


class HostSigtermBroadcast:
    """The ranks' SIGTERM flags and SLURM requeue requests, combined host to host every step (their maximum) and read
    ``lag`` steps later; every rank stops (or requeues) at the same step.

    ``checkpoint``: called on every rank at the agreed stop, before ``SIGTERMException`` (exit status
    :data:`SIGTERM_EXIT`) is raised; it writes a checkpoint (a collective) and returns its path. ``requeue``: called on
    every rank at the agreed step after a requeue signal (``SIGUSR1`` under SLURM with auto-requeue); it writes the
    hpc checkpoint and requeues the job (rank 0) and returns the checkpoint's path.

    Example::

        check = HostSigtermBroadcast(trainer, group=dist.new_group(backend="gloo"))
        check()          # raises Lightning's SIGTERMException on every rank, lag steps after any rank received SIGTERM
        check.close()    # at the end of fit: waits for the rounds in flight, gives back the connector's flag
    """

    def __init__(self, trainer: Any, group: Optional[dist.ProcessGroup], lag: int = LAG,
                 checkpoint: Optional[Callable[[], str]] = None, requeue: Optional[Callable[[], str]] = None) -> None:
        self._group = group
        self._lag = lag
        self._checkpoint, self._requeue = checkpoint, requeue
        self._requeued = 0  # the requeue requests acted on (a count: the rounds in flight after one still carry it)
        self._stop_pending = False  # agreed, waiting for the end of the accumulation window
        self._trainer = trainer
        self._step = (lambda: trainer.global_step) if hasattr(trainer, "global_step") else (lambda: -1)
        self._in_flight: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._connector = trainer._signal_connector
        self._connector_class = type(self._connector)
        while getattr(self._connector_class, "agrees_on_sigterm", False):  # left installed by a fit that crashed
            self._connector_class = self._connector_class.__mro__[1]
        own = self._connector.__dict__.pop("received_sigterm", False)
        self._connector.__class__ = _agreeing(self._connector_class)
        self._connector.received_sigterm = own

    def _own_flags(self) -> torch.Tensor:
        """This rank's flags, as one round carries them: [SIGTERM received, requeue requests received]."""
        state = self._connector.__dict__
        return torch.tensor([1 if state.get("own_sigterm", False) else 0, state.get("own_requeues", 0)],
                            dtype=torch.int32)

    def _agreed(self, flags: torch.Tensor) -> bool:
        """A completed round's verdict: whether it carried a SIGTERM (acted on at the next window's start,
        :meth:`_stop`). A requeue request it carries, not acted on yet, is acted on first (every rank reads the same
        round at the same point)."""
        sigterm, requeues = flags.tolist()  # a CPU tensor Gloo wrote: no device involved
        if requeues > self._requeued:
            self._requeued = requeues
            if self._requeue is not None:
                path = self._requeue()
                _say(f"static_dist: requeue signal (SIGUSR1): every rank saved {path} at step {self._step()}; job"
                     " requeued, training goes on until the scheduler stops it")
        return sigterm == 1

    def _stop(self) -> BaseException:
        """The agreed stop: the checkpoint written on every rank, one line, and the exception that ends ``fit``."""
        # from here on the connector answers the agreed flag (not before: Lightning's own end-of-batch check would
        # stop this rank mid-window, without the checkpoint)
        self._connector.__dict__["_agreed_sigterm"] = True
        try:
            path = self._checkpoint() if self._checkpoint is not None else None
            saved = f"; checkpoint {path}" if path else ""
        except CheckpointError as err:  # (agreed on every rank: each gets here) still a preemption, said as one
            saved = f"; the checkpoint could not be written ({err})"
        _say(f"static_dist: SIGTERM: every rank stopped at step {self._step()}{saved}; exiting with status"
             f" {SIGTERM_EXIT}")
        return sigterm_exit()

    def _between_windows(self) -> bool:
        """Whether the batch about to start opens a gradient-accumulation window (every batch does without
        accumulation): a stop anywhere else would save a step whose micro-batches' gradients are not in the
        checkpoint. The same on every rank (the same batches, the same ``accumulate_grad_batches``)."""
        every = getattr(self._trainer, "accumulate_grad_batches", 1) or 1
        progress = getattr(_epoch_loop(self._trainer), "batch_progress", None)
        return every <= 1 or progress is None or progress.current.completed % every == 0

    def __call__(self) -> None:
        flags = self._own_flags()
        self._in_flight.append((dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flags))
        if len(self._in_flight) > self._lag:
            work, oldest = self._in_flight.popleft()
            with waiting_in(_ROUND):
                work.wait()
            self._stop_pending = self._agreed(oldest) or self._stop_pending
        if self._stop_pending and self._between_windows():
            try:
                self._drain()
                dist.barrier(group=self._group)  # as Lightning does: no rank left waiting in a collective
            except Exception:
                forget_failure()  # (a peer gone as the job stops: the stop goes on, and no later line names it)
            raise self._stop()

    def agree(self) -> None:
        """One blocking round now (collective: every rank calls it at the same point, e.g. at the end of a
        validation); a SIGTERM on any rank stops every rank here, after the checkpoint."""
        flags = self._own_flags()
        with waiting_in(_ROUND):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        self._stop_pending = self._agreed(flags) or self._stop_pending
        if self._stop_pending and self._between_windows():
            self._drain()  # (every rank started the same rounds: none is left waiting in one)
            raise self._stop()

    def _drain(self) -> None:
        while self._in_flight:
            work, _ = self._in_flight.popleft()
            with waiting_in(_ROUND):
                work.wait()

    def close(self, drain: bool = True) -> None:
        """Wait for the rounds in flight (every rank started the same ones; their flags are not acted on) and
        put the connector back (``received_sigterm``: this rank's own flag again). ``drain=False`` after a failure:
        a rank that stopped would never join them."""
        if drain:
            self._drain()
        self._in_flight.clear()
        own = self._connector.__dict__.pop("own_sigterm", False)
        self._connector.__dict__.pop("_agreed_sigterm", None)
        self._connector.__dict__.pop("own_requeues", None)
        self._connector.__class__ = self._connector_class
        self._connector.received_sigterm = own


def _say(line: str) -> None:
    """A line for the job, from global rank 0 (every rank reached the same point)."""
    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def save_at_stop(trainer: Any) -> str:
    """Write the checkpoint of an agreed SIGTERM stop (collective: every rank calls it at the same step) and return
    its path: ``last-preempted-step=<N>.ckpt`` in the run's checkpoint folder (the ``ModelCheckpoint``'s
    ``dirpath``), else in ``default_root_dir``. ``lsd-train ckpt_path=last`` resumes from it, and so does Lightning's
    own ``fit(ckpt_path="last")``, which takes the newest file whose name starts with ``last``."""
    callback = trainer.checkpoint_callback
    folder = getattr(callback, "dirpath", None) or trainer.default_root_dir
    path = os.path.join(folder, f"last-preempted-step={trainer.global_step}.ckpt")
    # a whole checkpoint (optimizer states, loops, callbacks: a resume goes on from it), said so: left unsaid,
    # Lightning's checkpoint connector logs "`weights_only` was not set" on every rank before the stop's one line
    trainer.save_checkpoint(path, weights_only=False)
    return path


def requeue_at_agreed_step(trainer: Any, connector_class: type) -> str:
    """Lightning's SLURM auto-requeue handler (``_SignalConnector._slurm_sigusr_handler_fn``: loggers finalised, the
    hpc checkpoint written on every rank, ``scontrol requeue`` from rank 0), run at a step every rank agreed on instead
    of inside the signal handler. Returns the checkpoint's path."""
    path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
    connector_class._slurm_sigusr_handler_fn(trainer._signal_connector, signal.SIGUSR1, None)
    return path


def host_group(timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroup]:
    """A Gloo group over every rank for host-side flags (the default group itself when it is Gloo), with the
    strategy's collective ``timeout``. Collective: every rank calls it at the same point. ``None`` with a warning
    when no Gloo group can be made here (if that happens on some ranks only, they disagree on the loop: the job
    then stops at the first step's broadcast, as a rank that cannot reach the others would anyway)."""
    if "gloo" in dist.get_backend():  # "gloo", or "cpu:gloo,cuda:nccl": CPU tensors already go through Gloo
        return dist.group.WORLD
    if is_simulated():  # the simulated world's group serves host tensors too (a Gloo group would wait for N ranks)
        return dist.group.WORLD
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    except Exception as err:  # a cluster where Gloo finds no usable interface: keep Lightning's loop as it is
        log.warning(f"static_dist: no Gloo group for host-side flags ({err}); Lightning's per-step SIGTERM broadcast"
                    " keeps reading through the device (one GPU synchronisation per step)")
        return None


def _epoch_loop(trainer: Any) -> Any:
    return getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)


def _installed(trainer: Any) -> Optional[HostSigtermBroadcast]:
    check = getattr(_epoch_loop(trainer), "__dict__", {}).get(_PATCHED)
    return check if isinstance(check, HostSigtermBroadcast) else None


def install(trainer: Any, group: Optional[dist.ProcessGroup]) -> bool:
    """Put :class:`HostSigtermBroadcast` in place of the loop's device broadcast, with the checkpoint of an agreed
    stop and the deferred SLURM requeue; ``False`` where this Lightning has no such method or there is no host group
    (the loop is left as it is)."""
    loop = _epoch_loop(trainer)
    if group is None or loop is None or not hasattr(type(loop), _PATCHED):
        return False
    check = HostSigtermBroadcast(trainer, group, checkpoint=lambda: save_at_stop(trainer),
                                 requeue=lambda: requeue_at_agreed_step(trainer, check._connector_class))
    setattr(loop, _PATCHED, check)
    return True


def agree(trainer: Any) -> None:
    """:meth:`HostSigtermBroadcast.agree` where installed (at the end of a validation inside ``fit``)."""
    check = _installed(trainer)
    if check is not None:
        check.agree()


def uninstall(trainer: Any, drain: bool = True) -> None:
    """Put Lightning's method and flag back (:meth:`HostSigtermBroadcast.close`)."""
    check = _installed(trainer)
    if check is not None:
        del _epoch_loop(trainer).__dict__[_PATCHED]
        check.close(drain=drain)
