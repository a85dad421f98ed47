"""The SMs a gradient collective may use, switched between rounds by ``sync.schedule: auto``'s trial, and put back.

On NCCL the CTAs (hence SMs) a collective may use, ``max_ctas``, is fixed when a communicator is made: so
:class:`CommSmsSwitch` makes one data-parallel group per SM budget at setup — on every rank, in the same order, as
``new_group`` requires, with the strategy's start-up timeout (``CollectiveTimeout`` sets ``strategy.timeout_s`` on
them after the first optimizer step, as on the default group) — and the trial points the synchroniser at one of them
between rounds. Once the trial decides (every rank at the same step), the groups not chosen are destroyed
(:meth:`CommSmsSwitch.keep`); a resumed run whose choice is known opens the chosen budget's group only. Teardown
points the synchroniser back at the mesh's group and destroys the rest; after a failure it only drops the references
(why: docs/internals.md, "participants/comm_sms.py"). In a simulated
world the SMs an emulated link holds are one process-wide setting (``simulate.group.WORLD.sms``): switched in place,
and the value found at setup put back at teardown, after a failure too. Gloo has no such knob (its candidates have
the default SMs only).

Example (what :class:`~lightning_static_dist.participants.schedule_trial.ScheduleTrial` does)::

    switch = CommSmsSwitch.open("nccl", dp_group, budgets=[8, 4, 2], timeout=start_up_timeout(config))
    synchronizer.group = switch.group_for(4)     # between rounds
    switch.keep(4)                               # the trial chose 4: the groups of 8 and 2 destroyed
    switch.close(synchronizer, failed=False)     # teardown: the mesh's group back, the extra groups destroyed
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from lightning_static_dist.plan.world import nccl_options
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
    def open(cls, transport: Transport, group: Optional[dist.ProcessGroup], budgets: Sequence[int],
             timeout: Optional[timedelta] = None) -> "CommSmsSwitch":
        """The switch for ``budgets``; on NCCL, one communicator per budget over ``group``'s ranks, whose collectives
        time out after ``timeout`` (``None``: torch's default). A collective: every rank of the default group calls it
        with the same budgets (``new_group`` is). A budget this torch cannot apply (no ``max_ctas``) gets no group."""
        groups: dict[int, dist.ProcessGroup] = {}
        if transport == "nccl":
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            for sms in budgets:
                options = nccl_options("nccl", sms)
                if not options:  # (warned: the group would be the default's twin)
                    continue
                made = dist.new_group(ranks, timeout=timeout, backend="nccl", **options)
                if made is not None and made is not dist.GroupMember.NON_GROUP_MEMBER:
                    groups[sms] = made
        return cls(transport, group, groups)

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups this switch made and has not destroyed yet (NCCL; none in a simulated world)."""
        return list(self._groups.values())

    def group_for(self, sms: Optional[int]) -> Optional[dist.ProcessGroup]:
        """The group a round with ``sms`` reduces over (simulated: the default group, its link switched to ``sms``)."""
        if self.transport == "simulated":
            WORLD.sms = self._world_sms if sms is None else sms
            return self._group
        if sms is None or sms not in self._groups:
            return self._group
        return self._groups[sms]

    def keep(self, sms: Optional[int]) -> None:
        """Destroy every group but ``sms``'s (``None``: the default's, so all of them): the trial chose ``sms``. Every
        rank calls it at the same point, the synchroniser already on the kept group, no collective in flight on the
        others; never after a failure."""
        kept = {sms: self._groups[sms]} if sms in self._groups else {}
        dropped = [group for budget, group in self._groups.items() if budget != sms]
        self._groups = kept
        _destroy(dropped)

    def close(self, synchronizer: Any, failed: bool) -> None:
        """Undo it all: the simulated SMs as found, the hook synchroniser back on the default group, the groups
        destroyed — not after a failure (``failed``): destroying a communicator whose peer died mid-collective can
        hang, so then the groups are only forgotten (left to the exit path). Safe to call twice."""
        if self.transport == "simulated":
            WORLD.sms = self._world_sms
        groups, self._groups = list(self._groups.values()), {}
        try:
            if synchronizer is not None and synchronizer.group is not self._group:
                synchronizer.group = self._group  # (between rounds: the synchroniser's teardown abandoned any in flight)
        except Exception as err:
            if not failed:
                raise
            log.debug(f"{type(self).__name__}: the synchroniser's group was not put back after a failure: {err}")
        finally:
            if not failed:
                _destroy(groups)


def _destroy(groups: Iterable[dist.ProcessGroup]) -> None:
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except Exception as err:  # (teardown goes on: the default group's destruction at exit covers it)
            log.debug(f"CommSmsSwitch: destroying an SM group failed: {err}")
