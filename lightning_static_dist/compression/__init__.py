"""Gradient compression: compressors (``compressors``), the protocol (``base``), the synchroniser's compressing
reducer (``reducer``) and the guard that backs off when compression starts to hurt (``guard``)."""

from __future__ import annotations

from typing import Optional

import torch

from lightning_static_dist.compression.base import Compressor
from lightning_static_dist.compression.compressors import (
    LowPrecisionCompressor,
    PowerSGDCompressor,
    QSGDCompressor,
    TopKCompressor,
)
from lightning_static_dist.compression.guard import CompressionGuard
from lightning_static_dist.compression.compressing_reducer import CompressingReducer, PhasedReduction
from lightning_static_dist.compression.config import CompressionConfig, CompressorOptions
from lightning_static_dist.config import ConfigError, import_object

__all__ = [
    "CompressingReducer",
    "CompressionGuard",
    "Compressor",
    "LowPrecisionCompressor",
    "PhasedReduction",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "TopKCompressor",
    "build_compressor",
]


def build_compressor(config: CompressorOptions, seed: int = 0) -> Optional[Compressor]:
    """The compressor ``strategy.compression`` names (``None`` for ``none``).

    Example::

        compressor = build_compressor(CompressionConfig(name="topk", density=0.01))
    """
    name = config.name
    if name == "none":
        return None
    if name in ("fp16", "bf16"):
        return LowPrecisionCompressor(torch.float16 if name == "fp16" else torch.bfloat16)
    if name == "powersgd":
        return PowerSGDCompressor(config.rank, config.warm_start, config.min_compression_rate, config.error_feedback,
                                  config.min_numel, seed)
    if name == "topk":
        return TopKCompressor(config.density, config.error_feedback, config.min_numel)
    if name == "qsgd":
        return QSGDCompressor(config.levels, min_numel=config.min_numel, seed=seed)
    compressor = import_object(f"{CompressionConfig.KEY}.name", name)()
    if not isinstance(compressor, Compressor):
        raise ConfigError(
            f"{CompressionConfig.KEY}.name={name!r}: {type(compressor).__name__} does not implement the Compressor"
            " protocol (name, takes, payload_bytes, phases, state_dict, load_state_dict, safer)"
        )
    return compressor
