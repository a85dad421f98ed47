"""``strategy.compression``: the options of gradient compression, beside the compressors they choose.

Example::

    CompressionConfig(name="powersgd", rank=4, start_step=100)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from lightning_static_dist.config.check import check_fields, fail, import_object


#: The built-in compressors of ``strategy.compression.name``; anything else must be a class path.
COMPRESSORS = ("none", "fp16", "bf16", "powersgd", "qsgd", "topk", "auto")


@dataclass
class CompressionConfig:
    """``strategy.compression``: gradient compression applied to each bucket's collective (``sync.mode: hooks``).

    Gradients the compressor does not take travel exact in fp32 (``compressors.py``); options a compressor has no use
    for are ignored by it.

    Example::

        StaticDistStrategy(compression={"name": "powersgd", "rank": 4, "start_step": 100})
    """

    KEY = "strategy.compression"

    name: str = "none"
    """``none``, ``fp16``, ``bf16``, ``powersgd``, ``qsgd``, ``topk``, ``auto`` (after ``start_step``, time exact,
    bf16 and PowerSGD at ``rank`` for ``trial_steps`` steps each and keep the fastest:
    :mod:`lightning_static_dist.trial`), or the class path of a user compressor (``my_pkg.MyCompressor``,
    built without arguments, implementing :class:`~lightning_static_dist.compression.base.Compressor`)."""
    rank: int = 4
    """PowerSGD: rank of the low-rank approximation."""
    warm_start: bool = True
    """PowerSGD: start each step's power iteration from the previous step's Q."""
    min_compression_rate: float = 2.0
    """PowerSGD: compress a matrix only when that sends at least this many times fewer bytes."""
    levels: int = 127
    """QSGD: quantisation levels per sign (2..127: one int8 per value)."""
    density: float = 0.01
    """TopK: fraction of each bucket's entries sent, in (0, 1]."""
    error_feedback: bool = True
    """PowerSGD and TopK: add what compression dropped (each rank its own) to the next step's gradient."""
    start_step: int = 0
    """Synchronised steps reduced exactly before compression starts."""
    min_numel: int = 1024
    """Gradients with fewer elements travel exact."""
    trial_steps: int = 6
    """``auto``: optimizer steps each candidate reduces for (the first is not timed)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.name not in COMPRESSORS:
            if "." not in self.name:
                fail(f"{self.KEY}.name", self.name, f"unknown compressor; allowed: {', '.join(COMPRESSORS)} or a class path")
            import_object(f"{self.KEY}.name", self.name)
        if self.rank < 1:
            fail(f"{self.KEY}.rank", self.rank, "must be an integer >= 1")
        if not 0 < self.density <= 1:
            fail(f"{self.KEY}.density", self.density, "must be a fraction in (0, 1]")
        if not 2 <= self.levels <= 127:
            fail(f"{self.KEY}.levels", self.levels, "must be an integer in [2, 127] (one int8 per value)")
        if not (math.isfinite(self.min_compression_rate) and self.min_compression_rate >= 1):
            fail(f"{self.KEY}.min_compression_rate", self.min_compression_rate, "must be a finite number >= 1")
        if self.start_step < 0:
            fail(f"{self.KEY}.start_step", self.start_step, "must be an integer >= 0")
        if self.min_numel < 1:
            fail(f"{self.KEY}.min_numel", self.min_numel, "must be an integer >= 1")
        if self.trial_steps < 2:
            fail(f"{self.KEY}.trial_steps", self.trial_steps, "must be an integer >= 2 (the first step is not timed)")


class CompressorOptions(Protocol):
    """What building a compressor reads: a :class:`CompressionConfig` as written, or the step plan's
    ``CompressionPlan`` (``plan/features.py``: the same options, frozen). A dataclass: the ``auto`` trial replaces
    ``name``."""

    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def warm_start(self) -> bool: ...
    @property
    def min_compression_rate(self) -> float: ...
    @property
    def levels(self) -> int: ...
    @property
    def density(self) -> float: ...
    @property
    def error_feedback(self) -> bool: ...
    @property
    def start_step(self) -> int: ...
    @property
    def min_numel(self) -> int: ...
    @property
    def trial_steps(self) -> int: ...
