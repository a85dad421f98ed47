"""``lsd-train`` with Lightning's own ``ddp`` in place of ``static_dist``: the reference the multi-node tests compare
weights against (the same run file, overrides, seed, data and checkpoints; only the strategy differs).

    python tests/_ddp_run.py charlm_cpu trainer.max_steps=6 ...
"""

from __future__ import annotations

import sys

from lightning_static_dist.cli import train_main
from lightning_static_dist.strategy import StaticDistStrategy

if __name__ == "__main__":
    # the run file's strategy block is still checked; Lightning's ddp trains (Lightning's launcher re-runs this file)
    StaticDistStrategy.from_config = classmethod(lambda cls, config, **kwargs: "ddp")  # type: ignore[method-assign]
    train_main(sys.argv[1:])
