"""Typed configuration, validated once, at the edge.

- :mod:`~lightning_static_dist.config.check`: the one checker — a value against an annotation, a dataclass against
  its fields — and :class:`ConfigError`, whose message is one line naming the full key, the bad value and what is
  allowed. The callbacks' configs (``RunSummary.Config``, ``OverlapMonitor.Config`` ...) use it too, beside their
  classes.
- :mod:`~lightning_static_dist.config.sections`: the strategy's sections (``strategy.compile``, ``strategy.sync``
  ...) and :class:`StrategyConfig`, which holds them.

The run file (``lsd-train CONFIG.yaml``) is loaded beside the command line, by :mod:`lightning_static_dist.runfile`.

Example::

    from lightning_static_dist.config import StrategyConfig

    cfg = StrategyConfig.from_dict({"sync": {"bucket_mb": 10}, "timeout_s": 600})
"""

from lightning_static_dist.config.check import (
    ConfigError,
    check_fields,
    check_kwargs_against,
    check_value,
    fail,
    import_object,
    section_from_dict,
)
from lightning_static_dist.config.sections import (
    COMPRESSORS,
    CheckpointConfig,
    CompileConfig,
    CompressionConfig,
    EmbeddingConfig,
    MeshConfig,
    StrategyConfig,
    SyncConfig,
)

__all__ = [
    "COMPRESSORS",
    "CheckpointConfig",
    "CompileConfig",
    "CompressionConfig",
    "ConfigError",
    "EmbeddingConfig",
    "MeshConfig",
    "StrategyConfig",
    "SyncConfig",
    "check_fields",
    "check_kwargs_against",
    "check_value",
    "fail",
    "import_object",
    "section_from_dict",
]
