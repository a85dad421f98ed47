"""Ranks under Lightning's own multiprocessing launcher (which bypasses ``StaticDistSpawnLauncher``): each rank reports,
to ``<out>/rank<R>.json``, the threads and process groups of ours still alive at the point named by the scenario.

    python tests/_lightning_spawn.py fit OUT          # a 2-rank fit; reported after the strategy's teardown
    python tests/_lightning_spawn.py environment OUT  # Lightning's test_result_reduce_ddp: setup_environment and a
                                                      # reduce, no teardown; reported at interpreter exit

The ranks then leave as Lightning's spawned ranks do, through the interpreter's teardown; a rank that aborts there
(SIGABRT) makes torch's spawn raise ``ProcessExitedException`` in this process: exit status 1.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.connectors.logger_connector.result import _Sync

from lightning_static_dist import StaticDistStrategy


def ours_alive() -> dict[str, Any]:
    """Threads named by this package, and process groups besides the default one (which Lightning's DDP keeps after
    ``fit`` too, destroyed at exit)."""
    groups = []
    if dist.is_initialized():
        world = dist.group.WORLD
        groups = sorted(str(dist.get_process_group_ranks(pg)) for pg in dist.distributed_c10d._world.pg_map
                        if pg is not world)
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("static_dist"))
    return {"threads": threads, "groups": groups}


def _write(out: str, rank: int) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(ours_alive(), f)


class LightningSpawnStaticDist(StaticDistStrategy):
    """``static_dist`` whose ranks Lightning's own ``_MultiProcessingLauncher`` starts; each reports after teardown."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(start_method="spawn", **kwargs)
        self.out = out

    def _configure_launcher(self) -> None:
        self._launcher = _MultiProcessingLauncher(self, start_method="spawn")

    def teardown(self) -> None:
        super().teardown()
        _write(self.out, self.global_rank)


def fit(out: str) -> None:
    import lightning as L

    from lightning_static_dist.examples.charlm import CharDataModule, CharGPT

    model = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=16)
    data = CharDataModule(block_size=16, batch_size=4, max_bytes=20000)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=LightningSpawnStaticDist(out), max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=out)
    trainer.fit(model, datamodule=data)


def _reduce_then_report_at_exit(out: str, strategy: StaticDistStrategy) -> None:
    # registered first, so run last: after every atexit handler of the package
    atexit.register(lambda: _write(out, strategy.global_rank))
    strategy.setup_environment()  # what Lightning's test helper does; nothing tears the strategy down
    total = _Sync(strategy.reduce, _should=True, _op="SUM")(torch.tensor([1.0]))
    assert total.item() == dist.get_world_size()


def environment(out: str) -> None:
    strategy = StaticDistStrategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")] * 2,
                                  cluster_environment=LightningEnvironment(), start_method="spawn")
    launcher = _MultiProcessingLauncher(strategy=strategy)
    launcher.launch(partial(_reduce_then_report_at_exit, out), strategy)


if __name__ == "__main__":
    scenario, out = sys.argv[1], sys.argv[2]
    {"fit": fit, "environment": environment}[scenario](out)
