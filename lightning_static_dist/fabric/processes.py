"""The processes, ranks, mesh and groups of the Fabric strategy, below its step
(:class:`~lightning_static_dist.fabric.strategy.StaticDistFabricStrategy`): Fabric's ``DDPStrategy`` with the
process group started as the Trainer strategy starts it (``strategy.simulate``'s world, ``sync.comm_sms``) and the
data-parallel ``DeviceMesh``, both held by a :class:`~lightning_static_dist.plan.world.DataParallelWorld` as the
Trainer's processes hold theirs; this package's launchers; and what the step participants read of the processes
(:class:`~lightning_static_dist.participants.StrategyView`).

Example::

    processes = FabricProcesses(config, start_method="spawn")
    processes.reduce_scatter()      # sync.reduce resolved against the mesh that started
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from typing import Any, Optional

import torch
from typing_extensions import override

from lightning.fabric.strategies import DDPStrategy

from lightning_static_dist.compat import mark_run_failed
from lightning_static_dist.config.lightning_cli import parse_errors_of
from lightning_static_dist.ddp_arguments import check_process_group_backend
from lightning_static_dist.processes.ending import install_excepthook
from lightning_static_dist.agreement.faults import (AgreedFailure, collective_failed, diagnose, is_collective_failure,
                                                    post_own_failure)
from lightning_static_dist.plan.world import DataParallelWorld, WorldFacts
from lightning_static_dist.processes.launcher import FabricSpawnLauncher, StaticDistLauncher
from lightning_static_dist.plan.strategy_config import StrategyConfig


class FabricProcesses(WorldFacts, DDPStrategy):
    """Fabric's ``DDPStrategy`` with the data-parallel mesh, this package's launchers, the validated ``strategy``
    block, and the process group the Trainer strategy starts (a simulated world: ``Fabric(devices=1)``, this process
    rank 0 of ``simulate.world_size``)."""

    def __init__(self, config: StrategyConfig, **kwargs: Any) -> None:
        super().__init__(timeout=timedelta(seconds=config.timeout_s), **kwargs)
        self._world = DataParallelWorld(config, started="after `fabric.launch()`")
        self._failed = False

    # ------------------------------------------------------------------------------------- processes and ranks

    @property
    def host_group(self) -> Optional[torch.distributed.ProcessGroup]:
        return self.dp_group

    @property
    @override
    def world_size(self) -> int:
        return self._world.world_size(lambda: super(FabricProcesses, self).world_size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:  # (a simulated world's rank 0 reads its own shard)
        return {**super().distributed_sampler_kwargs, "num_replicas": self._ranks_in_world()}

    def has_failed(self) -> bool:
        """Whether this rank failed (the peer watchdog's thread reads it): an exception left one of the package's
        collectives, or teardown or the excepthook said so (:meth:`failed_at_teardown`, :meth:`_explain`)."""
        return self._failed or collective_failed()

    def mark_failed(self) -> None:
        """This rank failed or is out of step: peers may be gone, so nothing after waits for them (the exit's
        teardown of the process groups included)."""
        self._failed = True
        mark_run_failed()

    def failed_at_teardown(self) -> bool:
        """Whether teardown follows a failure. Fabric has no ``on_exception`` hook, so it is read here: an exception
        propagating or handled where teardown is called (``try: ... finally: fabric.strategy.teardown()``), or one
        that left a collective of the package's (``agreement/faults.py``; also when the user's loop caught it)."""
        if sys.exc_info()[0] is not None or collective_failed():
            self.mark_failed()
        return self._failed

    def _steps_taken(self) -> int:
        """Optimizer steps taken, for a failure's line (the strategy above knows its models; -1: unknown here)."""
        return -1

    def _explain(self, error: BaseException) -> bool:
        """A script's uncaught exception (Fabric has no ``on_exception`` hook, so it is read here, as the Trainer
        strategy's ``on_exception`` reads it): a collective's failure is one line naming the rank that stopped, and
        the ranks this process started are killed (a stuck one would outlive the job); this rank's own error gets
        its traceback, and the others' lines name this rank. ``True``: the line is printed."""
        self.mark_failed()
        step = self._steps_taken()
        if isinstance(error, AgreedFailure):  # every rank raised it at the same point: one line for the job
            if self.global_rank == 0:
                print(error, file=sys.stderr, flush=True)
            return True
        if not is_collective_failure(error):
            post_own_failure(error, self.global_rank, step)
            return False
        print(diagnose(error, self.global_rank, self.world_size, step), file=sys.stderr, flush=True)
        if isinstance(self._launcher, StaticDistLauncher):
            self._launcher.kill(signal.SIGKILL)
        return True

    @override
    def _configure_launcher(self) -> None:
        # before any rank starts: a mesh that cannot fit the world, or an unknown backend, is a config error
        with parse_errors_of(self):  # (a strategy jsonargparse built: its command line's error, in one line)
            self._world.check_before_launch(self.num_processes, self.num_nodes, self.parallel_devices,
                                            "Fabric(devices=1, num_nodes=1)")
            check_process_group_backend(self._process_group_backend)
        if self._start_method == "popen":  # the Trainer's: a grace period for a survivor's one line
            self._launcher = StaticDistLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = FabricSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        check_process_group_backend(self._process_group_backend)
        super().setup_environment()
        self._world.build(self, self.root_device, self.world_size, self.num_nodes)

    @override
    def _setup_distributed(self) -> None:
        # DDPStrategy's, with the Trainer strategy's start of the group (a simulated world, NCCL's options)
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = self._world.start(self.cluster_environment, self._get_process_group_backend(),
                                                        self.root_device, os.getcwd())
        if self.world_size > 1 and self.simulation is None:
            install_excepthook(self._explain)
