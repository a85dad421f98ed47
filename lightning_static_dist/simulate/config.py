"""``strategy.simulate``: one process standing for rank 0 of N identical ranks, and the link it pretends to use.

Example::

    StaticDistStrategy(simulate={"world_size": 8})                                   # free links
    StaticDistStrategy(simulate={"world_size": 2, "link": {"gbps": 70, "latency_us": 10, "sms": 8}})
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from lightning_static_dist.config.check import check_fields, fail, section_from_dict


@dataclass
class LinkConfig:
    """``strategy.simulate.link``: an emulated link (CUDA only). Each collective holds ``sms`` SMs on a stream of its
    own for as long as an N-rank ring takes, at ``gbps`` beside compute and ``idle_gbps`` while the compute stream is
    blocked on a collective (NCCL on an idle GPU runs at full speed, beside GEMMs it does not); ``sm_gbps`` makes
    fewer SMs a slower link. The model, its calibration and its error: docs/simulated-link.md.

    Example::

        LinkConfig(gbps=70, idle_gbps=308, latency_us=5, sms=16, sm_gbps=65)
    """

    KEY = "strategy.simulate.link"

    gbps: float = 308.0
    """Bandwidth in gigabytes per second, as an all-reduce's bus bandwidth counts it (a 400 Gb/s network: 50), while
    compute runs beside the collective (every time, with ``idle_gbps`` unset)."""
    latency_us: float = 0.0
    """Per ring step, in microseconds."""
    sms: int = 16
    """SMs a collective holds while it runs (NCCL's CTAs); ``strategy.sync.comm_sms``, when set, replaces it."""
    idle_gbps: Optional[float] = None
    """Bandwidth while the compute stream waits for a collective (the GPU otherwise idle); ``None``: ``gbps``."""
    sm_gbps: Optional[float] = None
    """Bandwidth one held SM can move (NCCL's per-CTA share); ``None``: the SMs held do not limit the bandwidth."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.gbps <= 1e5:
            fail(f"{self.KEY}.gbps", self.gbps, "must be a bandwidth in GB/s in (0, 100000]")
        if not 0 <= self.latency_us <= 1e6:
            fail(f"{self.KEY}.latency_us", self.latency_us, "must be microseconds in [0, 1000000]")
        if not 1 <= self.sms <= 1024:
            fail(f"{self.KEY}.sms", self.sms, "must be an integer number of SMs in [1, 1024]")
        for name in ("idle_gbps", "sm_gbps"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1e5:
                fail(f"{self.KEY}.{name}", value, "must be a bandwidth in GB/s in (0, 100000], or null")

    def rates(self, sms: int) -> tuple[float, float]:
        """(busy, idle) bandwidth in GB/s of a collective holding ``sms`` SMs.

        Example::

            >>> LinkConfig(gbps=70, idle_gbps=308, sms=16, sm_gbps=65).rates(2)
            (29.545454545454543, 130.0)
        """
        idle = self.gbps if self.idle_gbps is None else self.idle_gbps
        if self.sm_gbps is None:
            return self.gbps, idle
        scale = min(idle, sms * self.sm_gbps) / min(idle, self.sms * self.sm_gbps)
        return self.gbps * scale, idle * scale

    @property
    def two_regimes(self) -> bool:
        """Whether the collective's pace depends on what the compute stream does."""
        return self.idle_gbps is not None and self.idle_gbps != self.gbps

    def describe(self) -> str:
        idle = f" ({self.idle_gbps:g} GB/s idle)" if self.idle_gbps is not None else ""
        per_sm = f", {self.sm_gbps:g} GB/s per SM" if self.sm_gbps is not None else ""
        return f"{self.gbps:g} GB/s{idle}, {self.latency_us:g} us, {self.sms} SMs{per_sm}"


@dataclass
class SimulateConfig:
    """``strategy.simulate``: a dry run of a multi-GPU configuration on one device, and the one-GPU measurement of the
    world-size-N path. One process, started with ``Trainer(devices=1)``, is rank 0 of ``world_size`` ranks that all
    hold the same values (``group.py``), so everything runs as at that world size; the run's speed, memory, plan and
    errors are the world's, its losses are not (docs/how-it-works.md: Simulated world).

    Example::

        StaticDistStrategy(simulate={"world_size": 4})
    """

    KEY = "strategy.simulate"

    world_size: Optional[int] = None
    """Ranks to stand for (>= 2); ``None``: no simulation."""
    link: Optional[LinkConfig] = None
    """``None``: collectives cost nothing (the world's own machinery alone); else an emulated link (CUDA)."""

    def __post_init__(self) -> None:
        if self.link is not None:
            self.link = section_from_dict(LinkConfig, self.link)
        check_fields(self)
        if self.world_size is not None and not 2 <= self.world_size <= 65536:
            fail(f"{self.KEY}.world_size", self.world_size, "must be an integer in [2, 65536] (ranks to simulate)")
        if self.world_size is None and self.link is not None:
            fail(f"{self.KEY}.link", _plain(self.link), "a link needs strategy.simulate.world_size; allowed without a"
                 " world: null")

    @property
    def enabled(self) -> bool:
        return self.world_size is not None


def _plain(link: LinkConfig) -> dict[str, Any]:
    return dataclasses.asdict(link)
