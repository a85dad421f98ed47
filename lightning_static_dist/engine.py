"""What both front ends run underneath: the gradient synchroniser built from the ``strategy`` config, each rank's
compression state carried through checkpoints, and the strategy names they register.

The Trainer strategy (:mod:`~lightning_static_dist.strategy`) and the Fabric strategy
(:mod:`~lightning_static_dist.fabric`) own their lifecycles; both build the same synchroniser here and save and
restore the same checkpoint entry, so that a model trained through either gets the same averages, the same
compressed payloads and the same resumed residuals.

Example::

    sync = build_synchronizer(model.named_parameters(), config.sync, config.compression, group=None)
    restore_compression_state(compressing_reducer_of(sync), saved, rank, world_size, device)
    sync.attach()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn import Parameter

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_static_dist.compression import CompressingReducer, LowPrecisionCompressor, build_compressor
from lightning_static_dist.compression.auto import Candidate, CompressionTrial
from lightning_static_dist.compression.base import Compressor
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.sync.config import SyncConfig
from lightning_static_dist.faults import waiting_in
from lightning_static_dist.fingerprint import check_same_on_all_ranks, describe_parameters
from lightning_static_dist.sync import GradientSynchronizer
from lightning_static_dist.sync.reducer import MeanAllReduce
from lightning_static_dist.sync.broadcast import broadcast_tensors
from lightning_static_dist.wording import counted

#: Where a checkpoint keeps every rank's compression state (``{"world_size": N, "ranks": [state of rank 0, ...]}``).
COMPRESSION_KEY = "static_dist_compression"


def start_from_rank_zero(module: torch.nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Check that every rank holds the same parameters (a rank with another model would pair its broadcasts and
    buckets with the wrong tensors: it stops here), then give every rank rank 0's weights and buffers, whatever its
    own initialisation drew. Collective."""
    check_same_on_all_ranks("the model's parameters", describe_parameters(module), group)
    broadcast_tensors(list(module.parameters()) + list(module.buffers()), group=group)


def broadcast_buffers(buffers: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Rank 0's module buffers (BatchNorm statistics ...) to every rank before a training forward
    (``strategy.sync.broadcast_buffers``). Collective."""
    with waiting_in("the broadcast of module buffers"):
        broadcast_tensors(buffers, group=group)


def compile_split(compile: CompileConfig, sync: SyncConfig, world_size: int) -> Optional[tuple[int, int]]:
    """Where the compiled step is cut: the bucket capacities in bytes (first bucket, every later one), or ``None``
    (uncut): at world size 1 (nothing to overlap), for the blocks compiled one by one or the whole step asked for
    uncut (``regional`` true or false), in graph mode (the collectives are inside the graph), and with
    ``sync.schedule: after_backward`` (every bucket is issued once backward ends: a cut would only cost)."""
    if compile.regional != "auto" or world_size < 2 or sync.mode == "graph" or sync.schedule == "after_backward":
        return None
    return sync.capacity.first_bytes, sync.capacity.bytes


def check_same_graphs(report: Any, group: Optional[dist.ProcessGroup]) -> None:
    """Every rank compiled the same graphs (a ``CompileReport``'s structure lines); a difference stops every rank
    with the first one. Collective: after round 1, before the first bucket collective of the plan."""
    check_same_on_all_ranks("what they compiled (graph structures)", report.structure_lines(), group)


def build_synchronizer(named_parameters: Iterable[tuple[str, Parameter]], sync: SyncConfig,
                       compression: Optional[CompressionConfig],
                       group: Optional[dist.ProcessGroup]) -> GradientSynchronizer:
    """The hook-driven synchroniser ``strategy.sync`` describes (``mode: hooks``, ``reduce: all_reduce``), with the
    compressing reducer when ``strategy.compression`` names a compressor (``compression=None``: exact, for a caller
    whose reducer owner installs the compressor, as the Trainer strategy's
    :class:`~lightning_static_dist.participants.compression.CompressionState` does). Not attached yet: restore a
    checkpoint's compression state first (:func:`restore_compression_state`), then call ``attach()``."""
    synchronizer = GradientSynchronizer(
        named_parameters,
        group=group,
        capacity=sync.capacity,
        check_each_collective=sync.check == "collective",
        reduce_dtype=torch.bfloat16 if sync.reduce_dtype == "bf16" else None,
    )
    synchronizer.launch_during_backward = sync.schedule != "after_backward"  # (auto: its trial switches it)
    if compression is None or compression.name == "auto":
        return synchronizer  # exact: the owner installs one, or the trial (compression_trial) picks
    compressor = build_compressor(compression)
    if compressor is not None:
        use_compressor(synchronizer, compressor, compression.start_step)
    return synchronizer


def use_compressor(synchronizer: GradientSynchronizer, compressor: Optional[Compressor], start_step: int = 0) -> None:
    """Reduce the synchroniser's buckets with ``compressor`` from now on (``None``: exact fp32); between rounds."""
    if compressor is None:
        synchronizer.reducer = MeanAllReduce()
        return
    shapes = [p.shape for p in synchronizer.parameters]
    synchronizer.reducer = CompressingReducer(compressor, shapes, start_step, names=synchronizer.parameter_names)


def compression_trial(compression: CompressionConfig, device: torch.device,
                      group: Optional[dist.ProcessGroup]) -> CompressionTrial:
    """``strategy.compression.name: auto``: the trial of exact fp32, bf16 and PowerSGD at ``compression.rank``."""
    powersgd = dataclasses.replace(compression, name="powersgd")
    candidates = [Candidate("none", lambda: None), Candidate("bf16", lambda: LowPrecisionCompressor(torch.bfloat16)),
                  Candidate(f"powersgd(rank={compression.rank})", lambda: build_compressor(powersgd))]
    return CompressionTrial(candidates, compression.start_step, compression.trial_steps, device, group)


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


#: The names ``import lightning_static_dist`` registers, in Lightning's and in Fabric's registry, with the start
#: method each stands for.
STRATEGY_NAMES = (("static_dist", "popen"), ("static_dist_spawn", "spawn"), ("static_dist_notebook", "fork"))


def register_names(registry: _StrategyRegistry, cls: type, description: str) -> None:
    """Register ``cls`` under :data:`STRATEGY_NAMES` in a Lightning or Fabric strategy registry; a name already
    there is left as it is (registering adds names, it never replaces one)."""
    for name, start_method in STRATEGY_NAMES:
        if name in registry:
            continue
        registry.register(name, cls, description=f"{description}, start method '{start_method}'",
                          start_method=start_method)
