"""lightning-static-dist: statically planned data-parallel training for PyTorch Lightning.

Importing the package registers the strategy names ``static_dist``, ``static_dist_spawn`` and
``static_dist_notebook`` in Lightning's ``StrategyRegistry``, the dynamo backend ``inductor_distributed`` and, with
jsonargparse installed, an instantiator of the package's classes that reports a ``ConfigError`` under LightningCLI
in one line (``lightning_static_dist/config/lightning_cli.py``) — names only: Lightning behaves as without the import until a ``StaticDistStrategy`` is made::

    import lightning as L
    import lightning_static_dist

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="static_dist")
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.config import ConfigError
from lightning_static_dist.config.lightning_cli import report_config_errors_under_jsonargparse, sections_of
from lightning_static_dist.embedding import EmbeddingConfig
from lightning_static_dist.mesh import MeshConfig
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync.config import SyncConfig
from lightning_static_dist.callbacks import GraphReport, RunSummary
from lightning_static_dist.compile import CompileReport, inductor_distributed, register_inductor_distributed
from lightning_static_dist.compression.guard import CompressionGuard
from lightning_static_dist.callbacks.monitor import OverlapMonitor
from lightning_static_dist.fabric import StaticDistFabricStrategy
from lightning_static_dist.offer import StaticDistOffer, offer_of
from lightning_static_dist.runfile import RunConfig, load_run_config
from lightning_static_dist.strategy import StaticDistStrategy
from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer
from lightning_static_dist.sync.plan import DEFAULT_CAPACITY

__version__ = "0.1.0"

__all__ = [
    "CompileConfig",
    "CompressionConfig",
    "ConfigError",
    "CompileReport",
    "EmbeddingConfig",
    "BucketCapacity",
    "GradientSynchronizer",
    "GraphReport",
    "MeshConfig",
    "CompressionGuard",
    "OverlapMonitor",
    "RunConfig",
    "RunSummary",
    "StaticDistFabricStrategy",
    "StaticDistOffer",
    "StaticDistStrategy",
    "StrategyConfig",
    "inductor_distributed",
    "SyncConfig",
    "load_run_config",
    "offer_of",
]

StaticDistStrategy.register_strategies(StrategyRegistry)
register_inductor_distributed(DEFAULT_CAPACITY)  # (compile imports no sync/: the one default comes from here)
# LightningCLI builds these after parsing (the sections too, from a nested key): a bad value is one line there too,
# not jsonargparse's traceback
report_config_errors_under_jsonargparse(StaticDistStrategy, StaticDistFabricStrategy, OverlapMonitor, RunSummary,
                                        GraphReport, CompressionGuard, *sections_of(StrategyConfig))
