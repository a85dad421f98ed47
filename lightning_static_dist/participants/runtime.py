"""The participants that watch the processes rather than the step: the peer watchdog, the collectives' timeout, and
the ranks' agreement on SIGTERM through Lightning's patched loop (:mod:`~lightning_static_dist.processes.sigterm` says
why the loop is patched).

Example (the strategy builds these in its ``__init__``)::

    watch = PeerWatch(strategy, failed=strategy.has_failed)
    watch.setup_distributed()       # heartbeats start; a dead neighbour ends this rank with one line
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_static_dist.compat import set_collective_timeout
from lightning_static_dist.processes import sigterm as loop_patches
from lightning_static_dist.participants.base import (RanksView, StepContext, StepParticipant, TrialView, WorldView, global_step, syncs_gradients)
from lightning_static_dist.processes.watchdog import PeerWatchdog


class PeerWatch(StepParticipant):
    """A watchdog thread on every rank of a multi-rank run: a dead peer ends this rank even where it cannot raise
    (blocked in a collective no error reaches). ``failed``: whether this rank is reporting a failure itself."""

    def __init__(self, view: TrialView, failed: Callable[[], bool]) -> None:
        self._view = view
        self._failed = failed
        self._watchdog: Optional[PeerWatchdog] = None

    def setup_distributed(self) -> None:
        view = self._view
        if view.world_size == 1 or view.simulation is not None or self._watchdog is not None:
            return  # (a simulated world's other ranks never heartbeat: they are not there)
        self._watchdog = PeerWatchdog(view.global_rank, view.world_size, failed=self._failed,
                                      step=lambda: global_step(view))
        self._watchdog.start()

    def teardown(self, failed: bool) -> None:
        if self._watchdog is not None:
            self._watchdog.stop(clean=not failed)
            self._watchdog = None


class CollectiveTimeout(StepParticipant):
    """``strategy.timeout_s`` from the first optimizer step on: the groups start with a longer timeout
    (``plan/step_plan.py``'s ``start_up_timeout``), since ranks wait for each other far longer while they start and
    compile than a running job's collective should. The default and host groups are set once; the groups a fit opens
    for itself (``groups``: ``sync.schedule: auto``'s SM budgets) after that fit's first optimizer step."""

    def __init__(self, view: WorldView, groups: Optional[Callable[[], Iterable[dist.ProcessGroup]]] = None) -> None:
        self._view = view
        self._groups = groups
        self._set = False
        self._fit_set = False

    def after_optimizer_step(self) -> None:
        view = self._view
        if self._fit_set or view.world_size == 1 or view.simulation is not None or not dist.is_initialized():
            return
        self._fit_set = True
        timeout = view.plan.timeout
        if not self._set:
            self._set = True
            set_collective_timeout(timeout)
            if view.host_group is not None and view.host_group is not dist.group.WORLD:
                set_collective_timeout(timeout, view.host_group)
        for group in self._groups() if self._groups is not None else ():
            set_collective_timeout(timeout, group)

    def teardown(self, failed: bool) -> None:
        self._fit_set = False  # (the next fit's own groups: set after its first step)


SIMULATED_KEY = "static_dist_simulated"  # a checkpoint written in a simulated world: {"world_size": N, "link": ...}


class SimulationMark(StepParticipant):
    """``strategy.simulate``: a checkpoint written in a simulated world says so, and a run that is not the same
    simulation warns when it resumes from one (its weights are one rank's, its sharded state rank 0's only)."""

    def __init__(self, view: RanksView) -> None:
        self._view = view

    def state_dict(self) -> dict[str, Any]:
        simulation = self._view.simulation
        if simulation is None:
            return {}
        return {SIMULATED_KEY: {"world_size": simulation.world_size,
                                "link": simulation.link.describe() if simulation.link is not None else None}}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.pop(SIMULATED_KEY, None)
        simulation = self._view.simulation
        if saved is not None and (simulation is None or simulation.world_size != saved["world_size"]):
            rank_zero_warn(f"static_dist: this checkpoint was written in a simulated world of {saved['world_size']}"
                           " identical ranks (strategy.simulate): a dry run's weights, and of sharded state rank 0's"
                           " shards only; resuming from it as if from a real run")


class SigtermAgreement(StepParticipant):
    """Lightning's per-step SIGTERM broadcast, host to host instead of through the device: the loop patch is
    installed for a multi-rank fit, and the ranks agree at the end of each validation inside it."""

    def __init__(self, view: RanksView) -> None:
        self._view = view
        self._patched: Any = None  # the Trainer whose loop is patched

    def after_setup(self, context: StepContext) -> None:
        trainer = context.trainer_loop
        if trainer is not None and syncs_gradients(context, self._view):
            self._patched = trainer if loop_patches.install(trainer, self._view.host_group) else None

    def on_validation_end(self) -> None:
        if self._patched is not None:  # validation inside fit: the ranks agree on SIGTERM here
            loop_patches.agree(self._patched)

    def teardown(self, failed: bool) -> None:
        if self._patched is not None:
            loop_patches.uninstall(self._patched, drain=not failed)
            self._patched = None
