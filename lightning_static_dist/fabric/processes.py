"""The processes, ranks, mesh and groups of the Fabric strategy, below its step
(:class:`~lightning_static_dist.fabric.strategy.StaticDistFabricStrategy`): Fabric's ``DDPStrategy`` starts the
process group; this adds the data-parallel ``DeviceMesh``, this package's launchers, and what the step
participants read of the processes (:class:`~lightning_static_dist.participants.StrategyView`).

Example::

    processes = FabricProcesses(config, start_method="spawn")
    processes.reduce_scatter()      # sync.reduce resolved against the mesh that started
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.distributed import group as _group

from lightning_static_dist.config import ConfigError
from lightning_static_dist.ddp_arguments import check_process_group_backend
from lightning_static_dist.processes.launcher import FabricSpawnLauncher
from lightning_static_dist.mesh import build_dp_mesh, reduces_by_scatter, resolve_mesh_shape
from lightning_static_dist.strategy_config import StrategyConfig


def refuse_process_group_settings(config: StrategyConfig) -> None:
    """``simulate`` and ``sync.comm_sms`` shape the process group, which Fabric's ``DDPStrategy`` starts here."""
    for hit, key, value in ((config.simulate.enabled, "simulate.world_size", config.simulate.world_size),
                            (config.sync.comm_sms is not None, "sync.comm_sms", config.sync.comm_sms)):
        if hit:
            raise ConfigError(f"strategy.{key}={value!r}: set where the process group starts, which under Fabric is"
                              " Fabric's DDPStrategy (use the Trainer's StaticDistStrategy); allowed under Fabric: null")


class FabricProcesses(DDPStrategy):
    """Fabric's ``DDPStrategy`` with the data-parallel mesh, this package's launchers and the validated ``strategy``
    block (``simulate`` and ``sync.comm_sms`` refused: :func:`refuse_process_group_settings`)."""

    def __init__(self, config: StrategyConfig, **kwargs: Any) -> None:
        refuse_process_group_settings(config)
        super().__init__(timeout=timedelta(seconds=config.timeout_s), **kwargs)
        self._config = config
        self._mesh: Optional[DeviceMesh] = None

    @property
    def config(self) -> StrategyConfig:
        return self._config

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh is built when the processes start: access it after `fabric.launch()`.")
        return self._mesh

    # ------------------------------------------------------------------------------------- processes and ranks

    @property
    def dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        return _group.WORLD if self._mesh is not None else None

    @property
    def host_group(self) -> Optional[torch.distributed.ProcessGroup]:
        return self.dp_group

    @property
    def simulation(self) -> None:
        return None

    def reduce_scatter(self) -> bool:
        """``sync.reduce`` resolved against the mesh (``auto``: reduce_scatter if dp_shard > 1)."""
        return reduces_by_scatter(self._config.sync.reduce, self._mesh, self.world_size)

    @override
    def _configure_launcher(self) -> None:
        # before any rank starts: a mesh that cannot fit the world, or an unknown backend, is a config error
        resolve_mesh_shape(self._config.mesh, self.num_nodes * self.num_processes)
        check_process_group_backend(self._process_group_backend)
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = FabricSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        check_process_group_backend(self._process_group_backend)
        super().setup_environment()
        self._mesh = build_dp_mesh(self.root_device.type, self._config.mesh)
