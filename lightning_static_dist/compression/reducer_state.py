"""Each rank's compression state: the compressing reducer a synchroniser reduces with, swapped between rounds, and
its state carried through checkpoints (each rank its own error-feedback residual).

Example::

    use_compressor(sync, build_compressor(config))
    saved = gather_compression_state(compressing_reducer_of(sync), group, world_size)   # on rank 0; None elsewhere
    restore_compression_state(compressing_reducer_of(sync), saved, rank, world_size, device)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_static_dist.compression import build_compressor
from lightning_static_dist.trial import Candidate, StepTrial
from lightning_static_dist.compression.base import Compressor
from lightning_static_dist.compression.compressors import LowPrecisionCompressor
from lightning_static_dist.compression.config import CompressorOptions
from lightning_static_dist.compression.compressing_reducer import CompressingReducer
from lightning_static_dist.sync import GradientSynchronizer
from lightning_static_dist.sync.bucket_reducer import MeanAllReduce
from lightning_static_dist.wording import counted

#: Where a checkpoint keeps every rank's compression state (``{"world_size": N, "ranks": [state of rank 0, ...]}``).
COMPRESSION_KEY = "static_dist_compression"


def use_compressor(synchronizer: GradientSynchronizer, compressor: Optional[Compressor], start_step: int = 0) -> None:
    """Reduce the synchroniser's buckets with ``compressor`` from now on (``None``: exact fp32); between rounds."""
    if compressor is None:
        synchronizer.reducer = MeanAllReduce()
        return
    shapes = [p.shape for p in synchronizer.parameters]
    synchronizer.reducer = CompressingReducer(compressor, shapes, start_step, names=synchronizer.parameter_names)


def compression_trial(compression: CompressorOptions, device: torch.device,
                      group: Optional[dist.ProcessGroup]) -> StepTrial:
    """``strategy.compression.name: auto``: the trial of exact fp32, bf16 and PowerSGD at ``compression.rank``."""
    powersgd = dataclasses.replace(compression, name="powersgd")
    candidates = [Candidate("none", lambda: None), Candidate("bf16", lambda: LowPrecisionCompressor(torch.bfloat16)),
                  Candidate(f"powersgd(rank={compression.rank})", lambda: build_compressor(powersgd))]
    return StepTrial(candidates, compression.start_step, compression.trial_steps, device, group)


def compressing_reducer_of(synchronizer: Optional[GradientSynchronizer]) -> Optional[CompressingReducer]:
    """The synchroniser's compressing reducer (``None`` without compression, or without a synchroniser)."""
    reducer = synchronizer.reducer if synchronizer is not None else None
    return reducer if isinstance(reducer, CompressingReducer) else None


def gather_compression_state(reducer: CompressingReducer, group: Optional[dist.ProcessGroup],
                             world_size: int) -> Optional[dict[str, Any]]:
    """Every rank's compression state on the group's first rank, which writes the checkpoint (``None`` on the
    others). Collective: every rank calls it. Each rank keeps its own error-feedback residual, so that a resumed
    rank gets its own back, not rank 0's; gathered to one rank only, since every residual is the size of a gradient.
    """
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    states: Optional[list[Any]] = [None] * world_size if dist.get_rank() == dst else None
    dist.gather_object(reducer.state_dict(), states, dst=dst, group=group)
    return {"world_size": world_size, "ranks": states} if states is not None else None


def restore_compression_state(reducer: CompressingReducer, saved: dict[str, Any], rank: int, world_size: int,
                              device: torch.device) -> None:
    """Give this rank its own saved compression state; from another world size only the round count (with a
    warning: residuals and warm-start matrices start from zero)."""
    if saved["world_size"] != world_size:
        rank_zero_warn(
            f"static_dist: the checkpoint's compression state is from {counted(saved['world_size'], 'rank')} and this run has"
            f" {world_size}: error-feedback residuals and warm-start matrices start from zero"
        )
        reducer.rounds = saved["ranks"][0].get("rounds", 0)
        return
    reducer.load_state_dict(saved["ranks"][rank], device)
