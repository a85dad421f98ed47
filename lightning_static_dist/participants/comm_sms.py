"""The SMs a gradient collective may use, switched between rounds by ``sync.schedule: auto``'s trial, and put back.

On NCCL the CTAs (hence SMs) a collective may use, ``max_ctas``, is fixed when a communicator is made: so
:class:`CommSmsSwitch` makes one data-parallel group per SM budget at setup — on every rank, in the same order, as
``new_group`` requires — and the trial points the synchroniser at one of them between rounds; teardown points it back
at the mesh's group and destroys them. In a simulated world the SMs an emulated link holds are one process-wide
setting (``simulate.group.WORLD.sms``): switched in place, and the value found at setup put back at teardown, after
a failure too. Gloo has no such knob (its candidates have the default SMs only).

Example (what :class:`~lightning_static_dist.participants.gradients.SyncSchedule` does)::

    switch = CommSmsSwitch.open("nccl", dp_group, budgets=[8, 4, 2])
    synchronizer.group = switch.group_for(4)     # between rounds
    switch.close(synchronizer)                   # teardown: the mesh's group back, the extra groups destroyed
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import torch.distributed as dist

from lightning_static_dist.processes.data_parallel import nccl_options
from lightning_static_dist.simulate.group import WORLD
from lightning_static_dist.sync.schedule import Transport

log = logging.getLogger(__name__)


class CommSmsSwitch:
    """Applies a candidate's SM budget (``None``: the default the run started with) and undoes every change.

    Args:
        transport: ``"nccl"`` (a group per budget) or ``"simulated"`` (the emulated link's SMs).
        group: the data-parallel group the run reduces over with the default SMs.
        groups: ``budget -> group`` on NCCL (made by :meth:`open`).
    """

    def __init__(self, transport: Transport, group: Optional[dist.ProcessGroup],
                 groups: Optional[dict[int, dist.ProcessGroup]] = None) -> None:
        self.transport = transport
        self._group = group
        self._groups = dict(groups or {})
        self._world_sms = WORLD.sms
        """The simulated world's SMs before the trial switched them: what :meth:`close` puts back."""

    @classmethod
    def open(cls, transport: Transport, group: Optional[dist.ProcessGroup], budgets: Sequence[int]) -> "CommSmsSwitch":
        """The switch for ``budgets``; on NCCL, one communicator per budget over ``group``'s ranks. A collective: every
        rank of the default group calls it with the same budgets (``new_group`` is)."""
        groups: dict[int, dist.ProcessGroup] = {}
        if transport == "nccl":
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            for sms in budgets:
                options = nccl_options("nccl", sms)
                made = dist.new_group(ranks, backend="nccl", **options)
                if made is not None and made is not dist.GroupMember.NON_GROUP_MEMBER:
                    groups[sms] = made
        return cls(transport, group, groups)

    def group_for(self, sms: Optional[int]) -> Optional[dist.ProcessGroup]:
        """The group a round with ``sms`` reduces over (simulated: the default group, its link switched to ``sms``)."""
        if self.transport == "simulated":
            WORLD.sms = self._world_sms if sms is None else sms
            return self._group
        if sms is None or sms not in self._groups:
            return self._group
        return self._groups[sms]

    def close(self, synchronizer: Any) -> None:
        """Undo it all: the hook synchroniser back on the default group, the simulated SMs as found, the groups
        destroyed. Safe to call twice, and after a failure."""
        if synchronizer is not None and synchronizer.group is not self._group:
            synchronizer.group = self._group  # (between rounds: the synchroniser's teardown abandoned any in flight)
        if self.transport == "simulated":
            WORLD.sms = self._world_sms
        groups, self._groups = self._groups, {}
        for group in groups.values():
            try:
                dist.destroy_process_group(group)
            except Exception as err:  # (teardown goes on: the default group's destruction at exit covers it)
                log.debug(f"{type(self).__name__}: destroying an SM group failed: {err}")
