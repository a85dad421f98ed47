"""What the strategy changes in Lightning's training loop, and why: one device synchronisation per step removed.

Lightning (2.5, 2.6) starts every training step of a multi-process run by broadcasting rank 0's "received SIGTERM"
flag over the training process group and reading it on the host (``_TrainingEpochLoop._broadcast_sigterm_tensor``:
a tensor made on the device, ``broadcast``, ``.item()``). On NCCL that read waits for the GPU to finish everything
queued before it — the whole previous step — so the host loses its lead at every step, and the GPU idles while the
host runs Lightning's loop and launches the next forward. :class:`HostSigtermBroadcast` takes its place on the
strategy's trainer: the same flag, broadcast from the same rank at the same point of the step and acted on the same
way, but as a CPU tensor over a Gloo group — the host waits for the other ranks' hosts (they are in lockstep anyway),
never for a GPU.

Not changed: Lightning's SIGTERM *handler* (``_SignalConnector._sigterm_notifier_fn``) also broadcasts over the
default group, from whichever rank the signal reaches, at whatever point of the step it arrives. That broadcast
used to meet the other ranks' loop broadcast when it arrived between steps; it now meets their next collective on
the default group. (Arriving mid-step, it already met a gradient collective under Lightning's ``ddp``.) Not tested
on NCCL.

Private Lightning API: ``_TrainingEpochLoop._broadcast_sigterm_tensor``, replaced on this trainer's loop instance
only, where it exists. Retire this module when Lightning's loop stops reading the flag through the device.
"""

from __future__ import annotations

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
    """Rank 0's SIGTERM flag, broadcast host to host every step; every rank stops together when it is set.

    Example::

        check = HostSigtermBroadcast(trainer, group=dist.new_group(backend="gloo"))
        check()          # raises Lightning's SIGTERMException on every rank once rank 0 received SIGTERM
    """

    def __init__(self, trainer: Any, group: Optional[dist.ProcessGroup]) -> None:
        self._trainer = trainer
        self._group = group
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    def __call__(self) -> None:
        flag = torch.tensor([1 if getattr(self._trainer, "received_sigterm", False) else 0], dtype=torch.int32)
        with waiting_in("the broadcast of rank 0's SIGTERM flag"):
            dist.broadcast(flag, src=self._src, group=self._group)
        if flag.item() == 1:  # a CPU tensor Gloo wrote: no device involved
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            with contextlib.suppress(Exception):
                dist.barrier(group=self._group)  # as Lightning does: no rank left waiting in a collective
            raise SIGTERMException()


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


def uninstall(trainer: Any) -> None:
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is not None and isinstance(loop.__dict__.get(_PATCHED), HostSigtermBroadcast):
        delattr(loop, _PATCHED)
