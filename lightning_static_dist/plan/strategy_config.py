"""The ``strategy`` block: every feature's section (each defined beside its feature) and the collective timeout,
checked together for the combinations no section can check alone.

Where each section lives::

    strategy.compile       lightning_static_dist.compile.config.CompileConfig
    strategy.mesh          lightning_static_dist.mesh.MeshConfig
    strategy.sync          lightning_static_dist.sync.config.SyncConfig
    strategy.compression   lightning_static_dist.compression.config.CompressionConfig
    strategy.embedding     lightning_static_dist.embedding.EmbeddingConfig
    strategy.checkpoint    lightning_static_dist.checkpoint.CheckpointConfig
    strategy.simulate      lightning_static_dist.simulate.config.SimulateConfig

All but ``CheckpointConfig`` are also importable from the package root
(``from lightning_static_dist import SyncConfig``).

Example::

    cfg = StrategyConfig.from_dict({"sync": {"bucket_mb": 10}, "timeout_s": 600})
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_static_dist.checkpoint import CheckpointConfig
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compile.cudagraphs import hazards
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.config.check import ConfigError, check_value, fail, section_from_dict
from lightning_static_dist.ddp_arguments import START_METHODS, DDPArguments, translate, yield_to
from lightning_static_dist.embedding import EmbeddingConfig
from lightning_static_dist.mesh import MeshConfig
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.sync.config import SyncConfig, check_schedule

__all__ = [
    "CheckpointConfig",
    "CompileConfig",
    "CompressionConfig",
    "EmbeddingConfig",
    "MeshConfig",
    "SimulateConfig",
    "StrategyConfig",
    "SyncConfig",
]


@dataclass
class StrategyConfig:
    """The ``strategy`` block: one field per section plus the collective timeout.

    Example::

        cfg = StrategyConfig.from_dict({"sync": {"bucket_mb": 10}, "timeout_s": 600})
    """

    KEY = "strategy"

    compile: CompileConfig = field(default_factory=CompileConfig)
    """Static compilation."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """The data-parallel DeviceMesh."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Gradient synchronisation."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Gradient compression."""
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    """Sharded embeddings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint format for sharded optimizer state."""
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    """A simulated world: one process as rank 0 of N identical ranks (off by default)."""
    timeout_s: float = 1800.0
    """Timeout of every collective, in seconds (process-group timeout)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "timeout_s":
                setattr(self, f.name, section_from_dict(typing.get_type_hints(StrategyConfig)[f.name], getattr(self, f.name)))
        check_value(f"{self.KEY}.timeout_s", self.timeout_s, float)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            fail(f"{self.KEY}.timeout_s", self.timeout_s, "must be a finite number of seconds > 0")
        self.timeout_s = float(self.timeout_s)
        if self.embedding.shard is not False and self.sync.mode == "graph":
            fail(f"{self.KEY}.embedding.shard", self.embedding.shard,
                  "sharded embeddings need strategy.sync.mode=hooks (mode is 'graph'); allowed with graph: false")
        if self.sync.reduce == "reduce_scatter" or self.mesh.dp_shard != 1:  # -1 may resolve to > 1
            self._check_sharded()
        if self.compression.name != "none" and self.sync.mode == "graph":
            fail(f"{self.KEY}.compression.name", self.compression.name,
                  "compression runs in the synchroniser's buckets; it needs strategy.sync.mode=hooks (mode is 'graph')")
        if self.compression.name != "none" and self.sync.reduce_dtype != "fp32":
            fail(f"{self.KEY}.sync.reduce_dtype", self.sync.reduce_dtype,
                  f"a compressor chooses what goes on the wire (compression.name is {self.compression.name!r});"
                  " allowed with compression: 'fp32'")
        sharded = self.sync.reduce == "reduce_scatter" or (self.sync.reduce == "auto" and self.mesh.dp_shard != 1)
        check_schedule(self.sync, compression=self.compression.name, sharded=sharded,
                       compile_optimizer=self.compile.optimizer)
        if self.compile.cudagraphs is True:  # what the config alone shows; the Trainer's part is checked at setup
            gathers = self.sync.reduce == "reduce_scatter" or self.mesh.dp_shard != 1 or self.embedding.shard is not False
            found = hazards(self.compile, self.sync.mode, gathers, micro_batches=1, automatic_optimization=True)
            if found:
                fail(f"{self.KEY}.compile.cudagraphs", True, f"{found[0]}; allowed with it: auto (off here), false")

    def _check_sharded(self) -> None:
        """What ``reduce_scatter`` cannot be combined with yet, named before any process starts."""
        if self.sync.reduce == "all_reduce":
            return  # a 2-D mesh with all_reduce: plain replication over the whole world
        if self.sync.mode == "graph":
            fail(f"{self.KEY}.sync.reduce", self.sync.reduce,
                  "graph mode traces all-reduces only; with strategy.sync.mode=graph allowed: 'all_reduce'")
        if self.compression.name != "none":
            fail(f"{self.KEY}.compression.name", self.compression.name,
                  "the compressors are written for all_reduce buckets; with strategy.sync.reduce=reduce_scatter"
                  " allowed: 'none'")
        if self.sync.reduce_dtype != "fp32":
            fail(f"{self.KEY}.sync.reduce_dtype", self.sync.reduce_dtype,
                  "reduce_scatter reduces the parameters' own buckets; with strategy.sync.reduce=reduce_scatter"
                  " allowed: 'fp32'")
        if self.embedding.shard is True:
            fail(f"{self.KEY}.embedding.shard", self.embedding.shard,
                  "reduce_scatter already splits every parameter's optimizer state, embeddings included;"
                  " allowed with it: 'auto' (off) or false")

    @classmethod
    def from_dict(cls, data: Any) -> StrategyConfig:
        return section_from_dict(cls, data)

    @classmethod
    def from_arguments(cls, args: DDPArguments, sections: Mapping[str, Any], timeout_s: Optional[float],
                       start_method: str) -> tuple[StrategyConfig, list[str]]:
        """The validated block a strategy's keyword arguments describe, and the lines to say once: DDP's arguments
        merged in (:func:`~lightning_static_dist.ddp_arguments.translate`), the sections and the timeout checked,
        then the start method — each a one-line ``ConfigError`` naming the key. (The process-group backend is checked
        when the processes start: :func:`~lightning_static_dist.ddp_arguments.check_process_group_backend`.)

        Example::

            config, notes = StrategyConfig.from_arguments(DDPArguments(bucket_cap_mb=10),
                                                          {"compression": {"name": "bf16"}}, None, "popen")
        """
        sync, timeout_s, notes = translate(args, sections.get("sync"), timeout_s)
        config = cls(**{**sections, "sync": sync}, timeout_s=1800.0 if timeout_s is None else timeout_s)
        if start_method not in START_METHODS:
            raise ConfigError(f"start_method={start_method!r}: allowed: {', '.join(map(repr, START_METHODS))}")
        return config, notes

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> tuple[StrategyConfig, list[str]]:
        """:meth:`from_arguments` for a front end's ``__init__``, given its keywords by name (its ``locals()``): each
        section, ``timeout_s``, ``start_method`` and whichever of DDP's arguments that front end takes. Both front
        ends build their block here; each keeps its own explicit signature, which LightningCLI reads.

        Example::

            config, notes = StrategyConfig.from_keywords({"sync": {"bucket_mb": 10}, "timeout_s": None,
                                                          "start_method": "popen", "bucket_cap_mb": None})
        """
        ddp = DDPArguments(**{f.name: keywords[f.name] for f in dataclasses.fields(DDPArguments) if f.name in keywords})
        sections = {f.name: keywords.get(f.name) for f in dataclasses.fields(cls) if f.name != "timeout_s"}
        return cls.from_arguments(ddp, sections, keywords.get("timeout_s"), keywords["start_method"])

    def as_keywords(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """A front end's keywords for this block with ``overrides`` winning (a DDP argument over the key it stands
        for: :func:`~lightning_static_dist.ddp_arguments.yield_to`): what ``from_config`` builds the front end with.

        Example::

            StaticDistStrategy(**config.as_keywords({"start_method": "spawn"}))
        """
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**yield_to(sections, overrides), **overrides}
