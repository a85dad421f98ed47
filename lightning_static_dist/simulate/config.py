"""``strategy.simulate``: one process standing for rank 0 of N identical ranks, and the link it pretends to use.

Example::

    StaticDistStrategy(simulate={"world_size": 8})                                   # free links
    StaticDistStrategy(simulate={"world_size": 2, "link": {"gbps": 70, "latency_us": 10, "sms": 8}})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_static_dist.config.check import check_fields, fail, section_from_dict


@dataclass
class LinkConfig:
    """``strategy.simulate.link``: an emulated link (CUDA only). Each collective holds ``sms`` SMs on a stream of its
    own for as long as an N-rank ring takes at ``gbps`` and ``latency_us``: an all-reduce 2(N-1)/N * bytes / B +
    2(N-1) * latency, an all-gather or reduce-scatter (N-1)/N * bytes / B + (N-1) * latency, a broadcast bytes / B +
    latency. The compute stream waits for it where it would wait for NCCL's work.

    Example::

        LinkConfig(gbps=308, latency_us=5, sms=16)
    """

    KEY = "strategy.simulate.link"

    gbps: float = 308.0
    """Bandwidth in gigabytes per second, as an all-reduce's bus bandwidth counts it (a 400 Gb/s network: 50)."""
    latency_us: float = 0.0
    """Per ring step, in microseconds."""
    sms: int = 16
    """SMs a collective holds while it runs (NCCL's CTAs); ``strategy.sync.comm_sms``, when set, replaces it."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.gbps <= 1e5:
            fail(f"{self.KEY}.gbps", self.gbps, "must be a bandwidth in GB/s in (0, 100000]")
        if not 0 <= self.latency_us <= 1e6:
            fail(f"{self.KEY}.latency_us", self.latency_us, "must be microseconds in [0, 1000000]")
        if not 1 <= self.sms <= 1024:
            fail(f"{self.KEY}.sms", self.sms, "must be an integer number of SMs in [1, 1024]")

    def describe(self) -> str:
        return f"{self.gbps:g} GB/s, {self.latency_us:g} us, {self.sms} SMs"


@dataclass
class SimulateConfig:
    """``strategy.simulate``: a dry run of a multi-GPU configuration on one device, and the one-GPU measurement of the
    world-size-N path. One process, started with ``Trainer(devices=1)``, is rank 0 of ``world_size`` ranks that all
    hold the same values: every collective returns what that many identical ranks would produce (a registered
    process-group backend, :mod:`~lightning_static_dist.simulate.group`), so the bucket plan, the compile cut, the
    hooks, the round checks, sharding and compression all run as they do at that world size. No data crosses a link.
    Where ranks would hold different values (the shards of ``reduce_scatter`` or of sharded embeddings), every rank is
    taken to hold rank 0's: the run's speed, memory, plan and errors are the world's, its losses are not.

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
    return {"gbps": link.gbps, "latency_us": link.latency_us, "sms": link.sms}
