"""What the strategy changes in Lightning's training loop, and why: one device synchronisation per step removed.

Lightning (2.5, 2.6) starts every training step of a multi-process run by broadcasting rank 0's "received SIGTERM"
flag over the training process group and reading it on the host (``_TrainingEpochLoop._broadcast_sigterm_tensor``:
a tensor made on the device, ``broadcast``, ``.item()``). On NCCL that read waits for the GPU to finish everything
queued before it — the whole previous step — so the host loses its lead at every step, and the GPU idles while the
host runs Lightning's loop and launches the next forward. :class:`HostSigtermBroadcast` takes its place on the
strategy's trainer: the same flag, broadcast from the same rank at the same point of the step and acted on the same
way, but as a CPU tensor over a Gloo group: the host waits for the other ranks' hosts, never for a GPU. (A lagged
read, ``lag > 0``, would also spare that host barrier, but Lightning checks each rank's own ``received_sigterm`` at
the end of every batch, so rank 0 would stop ``lag`` steps before the others: ``lag`` stays 0 until the strategy
also holds back that local check.)

Not changed: Lightning's SIGTERM *handler* (``_SignalConnector._sigterm_notifier_fn``) also broadcasts over the
default group, from whichever rank the signal reaches, at whatever point of the step it arrives. That broadcast
used to meet the other ranks' loop broadcast when it arrived between steps; it now meets their next collective on
the default group. (Arriving mid-step, it already met a gradient collective under Lightning's ``ddp``.) Not tested
on NCCL.

Private Lightning API: ``_TrainingEpochLoop._broadcast_sigterm_tensor``, replaced on this trainer's loop instance
only, where it exists. Retire this module when Lightning's loop stops reading the flag through the device.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_static_dist.faults import waiting_in

log = logging.getLogger(__name__)

_PATCHED = "_broadcast_sigterm_tensor"


class HostSigtermBroadcast:
    """Rank 0's SIGTERM flag, broadcast host to host every step; every rank stops together (``lag=0``, the default).

    Each step starts an asynchronous broadcast of rank 0's flag and reads the one started ``lag`` steps earlier,
    which the other ranks have long since joined (a broadcast read in the same step is a host barrier). Not safe with
    Lightning's loop for ``lag > 0``: each rank also checks its own flag at the end of every batch (see the module).

    Example::

        check = HostSigtermBroadcast(trainer, group=dist.new_group(backend="gloo"))
        check()          # raises Lightning's SIGTERMException on every rank, lag steps after rank 0 received SIGTERM
        check.drain()    # at the end of the loop: waits for the broadcasts still in flight
    """

    def __init__(self, trainer: Any, group: Optional[dist.ProcessGroup], lag: int = 0) -> None:
        self._trainer = trainer
        self._group = group
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        self._lag = lag
        self._in_flight: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    def __call__(self) -> None:
        flag = torch.tensor([1 if getattr(self._trainer, "received_sigterm", False) else 0], dtype=torch.int32)
        self._in_flight.append((dist.broadcast(flag, src=self._src, group=self._group, async_op=True), flag))
        if len(self._in_flight) <= self._lag:
            return
        work, oldest = self._in_flight.popleft()
        with waiting_in("the broadcast of rank 0's SIGTERM flag"):
            work.wait()
        if oldest.item() == 1:  # a CPU tensor Gloo wrote: no device involved
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            with contextlib.suppress(Exception):
                self.drain()
                dist.barrier(group=self._group)  # as Lightning does: no rank left waiting in a collective
            raise SIGTERMException()

    def drain(self) -> None:
        """Wait for the broadcasts still in flight (every rank started the same ones); their flags are not acted on."""
        while self._in_flight:
            work, _ = self._in_flight.popleft()
            with waiting_in("the broadcast of rank 0's SIGTERM flag"):
                work.wait()


def host_group(timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroup]:
    """A Gloo group over every rank for host-side flags (the default group itself when it is Gloo), with the
    strategy's collective ``timeout``. Collective: every rank calls it at the same point. ``None`` with a warning
    when no Gloo group can be made here (if that happens on some ranks only, they disagree on the loop: the job
    then stops at the first step's broadcast, as a rank that cannot reach the others would anyway)."""
    if "gloo" in dist.get_backend():  # "gloo", or "cpu:gloo,cuda:nccl": CPU tensors already go through Gloo
        return dist.group.WORLD
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    except Exception as err:  # a cluster where Gloo finds no usable interface: keep Lightning's loop as it is
        log.warning(f"static_dist: no Gloo group for host-side flags ({err}); Lightning's per-step SIGTERM broadcast"
                    " keeps reading through the device (one GPU synchronisation per step)")
        return None


def install(trainer: Any, group: Optional[dist.ProcessGroup]) -> bool:
    """Put :class:`HostSigtermBroadcast` in place of the loop's device broadcast; ``False`` where this Lightning has
    no such method or there is no host group (the loop is left as it is)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if group is None or loop is None or not hasattr(type(loop), _PATCHED):
        return False
    setattr(loop, _PATCHED, HostSigtermBroadcast(trainer, group))
    return True


def uninstall(trainer: Any, drain: bool = True) -> None:
    """Put Lightning's method back; ``drain``: first wait for the broadcasts in flight (not after a failure, where
    a rank that stopped would never join them)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is not None and isinstance(loop.__dict__.get(_PATCHED), HostSigtermBroadcast):
        if drain:
            loop.__dict__[_PATCHED].drain()
        delattr(loop, _PATCHED)
