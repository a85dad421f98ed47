"""The Fabric front end: :class:`~lightning_static_dist.fabric.strategy.StaticDistFabricStrategy` (the strategy),
:mod:`~lightning_static_dist.fabric.model` (one trainable module's step participants, driven from the user's calls)
and :mod:`~lightning_static_dist.fabric.metrics` (the figures ``strategy.metrics()`` hands out)."""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_static_dist.fabric.strategy import StaticDistFabricStrategy
from lightning_static_dist.processes.launcher import FabricSpawnLauncher as _SpawnLauncher

StaticDistFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["StaticDistFabricStrategy", "_SpawnLauncher"]
