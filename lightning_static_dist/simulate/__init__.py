"""The simulated world (``strategy.simulate``): one process as rank 0 of N identical ranks, over free or emulated
links, for dry runs of a multi-GPU configuration and for measuring the world-size-N path on one device.

Correctness tests never use it in place of real ranks: identical ranks cannot show a synchronisation bug.
"""

from lightning_static_dist.simulate.config import LinkConfig, SimulateConfig
from lightning_static_dist.simulate.group import (
    BACKEND,
    SimulatedGroup,
    init_simulated_world,
    is_simulated,
    register,
    set_link,
)

__all__ = ["BACKEND", "LinkConfig", "SimulateConfig", "SimulatedGroup", "init_simulated_world", "is_simulated",
           "register", "set_link"]
