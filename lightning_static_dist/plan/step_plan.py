"""The step plan: what the ``strategy`` block means in the world that started, resolved once at setup.

The config says what the user asked (``sync.schedule: measured``, ``sync.reduce: auto``, ``bucket_mb`` in MiB);
the world (its size, device type, nodes and mesh) decides what that becomes. :func:`resolve_plan` makes that decision
once, when the processes have started and the mesh is built (``plan/world.py``'s ``DataParallelWorld.build``,
for both front ends), and the participants read the frozen result as ``view.plan``: none re-reads or re-converts the
config at phase time. One decision waits for the model: ``measured`` stays pending until the link probe at setup,
which settles it through :meth:`StepPlan.settled` (a new frozen plan) before any participant acts on the schedule.

Example::

    plan = resolve_plan(StrategyConfig(), world_size=2, device_type="cpu", num_nodes=1, mesh=None)
    plan.schedule                 # 'overlap' (measured, without a probe, on CPUs)
    plan.capacity.bytes           # 104857600 (sync.bucket_mb's 100 MiB)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_static_dist.checkpoint import CheckpointConfig
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.embedding import EmbeddingConfig
from lightning_static_dist.mesh import reduces_by_scatter
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync.config import SyncConfig, launches_during_backward, reduce_torch_dtype
from lightning_static_dist.sync.plan import BucketCapacity
from lightning_static_dist.sync.schedule_choice import MeasuredChoice

SyncMode = Literal["hooks", "graph", "sharded"]
"""How a multi-rank fit averages: bucket hooks, collectives inside the compiled backward, or reduce-scatter shards."""

Schedule = Literal["overlap", "after_backward", "auto", "measured"]
"""``sync.schedule`` once the world is known (``measured``: pending, until the probe at setup settles it)."""

START_UP_S = 600.0
"""Seconds the collectives may wait until the first optimizer step is over, when ``strategy.timeout_s`` is shorter:
the ranks of a job start seconds apart (each imports torch and Lightning), and setup and the first step (a rank's
data preparation, a compilation) keep one rank waiting for another far longer than a collective of a running job
should. ``participants/runtime.py``'s ``CollectiveTimeout`` sets ``strategy.timeout_s`` then."""


def start_up_timeout(config: StrategyConfig) -> timedelta:
    """The collectives' timeout from the start until the first optimizer step is over (:data:`START_UP_S`)."""
    return timedelta(seconds=max(config.timeout_s, START_UP_S))


def compile_split(compile: CompileConfig, sync: SyncConfig, world_size: int) -> Optional[BucketCapacity]:
    """Where the compiled step is cut: the bucket capacities, or ``None`` (uncut): at world size 1 (nothing to
    overlap), for the blocks compiled one by one or the whole step asked for uncut (``regional`` true or false), in
    graph mode (the collectives are inside the graph), and with ``sync.schedule: after_backward`` (every bucket is
    issued once backward ends: a cut would only cost; ``measured``: none until settled)."""
    if sync.schedule == "measured":
        return None
    if compile.regional != "auto" or world_size < 2 or sync.mode == "graph" or not launches_during_backward(sync.schedule):
        return None
    return sync.capacity


@dataclass(frozen=True)
class StepPlan:
    """The ``strategy`` block resolved for one world: every decision a participant acts on, made once.

    Example::

        plan = resolve_plan(config, world_size=2, device_type="cuda", num_nodes=1, mesh=mesh)
        if plan.sync_mode == "hooks" and plan.launch_during_backward: ...
    """

    world_size: int
    device_type: str
    num_nodes: int
    sync_mode: Optional[SyncMode]
    """How gradients are averaged when fitting; ``None`` on one rank (nothing to average)."""
    reduce_by_scatter: bool
    """``sync.reduce`` resolved against the mesh (``auto``: reduce_scatter where ``dp_shard > 1``)."""
    schedule: Schedule
    """``sync.schedule`` for this world (``measured``: pending until the probe at setup settles it)."""
    schedule_line: Optional[str]
    """What ``measured`` became and why, printed at fit start (``None``: nothing was resolved)."""
    capacity: BucketCapacity
    """The buckets' capacities in bytes (``sync.first_bucket_mb`` / ``sync.bucket_mb``)."""
    compile_cut: Optional[BucketCapacity]
    """Where the compiled step is cut (the bucket capacities), or ``None``: uncut (one rank, ``compile.regional``
    true or false, graph mode, reduce_scatter, ``schedule: after_backward``)."""
    reduce_dtype: Optional[torch.dtype]
    """The dtype gradients are averaged in (``None``: their own; ``auto`` starts there, its trial switches it)."""
    check_each_collective: bool
    """``sync.check: collective``."""
    shards_embeddings: bool
    """``embedding.shard`` asked for (true or auto), on several ranks, without reduce_scatter (which already shards
    every parameter's optimizer state)."""
    start_up_timeout: timedelta
    """The collectives' timeout until the first optimizer step is over (:data:`START_UP_S`)."""
    timeout: timedelta
    """``strategy.timeout_s``, set on the collectives after the first optimizer step."""
    sync: SyncConfig
    """``strategy.sync`` with ``schedule`` resolved (the options read as they are: ``nonfinite``, ``comm_sms`` ...)."""
    compile: CompileConfig
    compression: CompressionConfig
    embedding: EmbeddingConfig
    checkpoint: CheckpointConfig
    schedule_choice: Optional[MeasuredChoice] = None
    """The probe's evidence and the predicted step of each candidate, once ``measured`` is settled by a probe (or by
    a checkpoint's choice)."""

    def settled(self, schedule: Literal["overlap", "after_backward"], line: str,
                choice: Optional[MeasuredChoice] = None, reduce_dtype: Literal["fp32", "bf16"] = "fp32",
                comm_sms: Optional[int] = None) -> StepPlan:
        """This plan with ``measured`` settled: the schedule, the line printed at fit start, and what follows from the
        choice (the compile cut, the reduce dtype, the SMs, the config's copy). The one way a pending schedule is
        resolved."""
        if self.schedule != "measured":
            raise RuntimeError(f"sync.schedule is {self.schedule!r}: only a pending 'measured' is settled")
        sync = dataclasses.replace(self.sync, schedule=schedule, reduce_dtype=reduce_dtype,
                                   comm_sms=self.sync.comm_sms if comm_sms is None else comm_sms)
        cut = None if self.reduce_by_scatter else compile_split(self.compile, sync, self.world_size)
        return dataclasses.replace(self, schedule=schedule, schedule_line=line, sync=sync, compile_cut=cut,
                                   reduce_dtype=reduce_torch_dtype(reduce_dtype), schedule_choice=choice)

    @property
    def launch_during_backward(self) -> bool:
        """Whether buckets are issued as they fill during backward (``after_backward``: all once backward ends;
        ``auto`` starts as ``overlap``, its trial switches it)."""
        return launches_during_backward(self.schedule)


def resolve_plan(config: StrategyConfig, *, world_size: int, device_type: str, num_nodes: int,
                 mesh: Optional[DeviceMesh], free_links: bool = False) -> StepPlan:
    """The plan of ``config`` in this world (a refusal is a one-line ``ConfigError`` naming the key; ``free_links``:
    a simulated world whose collectives cost nothing)."""
    sharded = reduces_by_scatter(config.sync.reduce, mesh, world_size)
    resolved, line = config.resolved(device_type=device_type, world_size=world_size, sharded=sharded,
                                     free_links=free_links)
    sync = resolved.sync
    schedule = sync.schedule
    assert schedule != "by_topology"  # (SyncConfig reads it as measured)
    mode: Optional[SyncMode] = None
    if world_size > 1:
        mode = "sharded" if sharded else sync.mode
    return StepPlan(
        world_size=world_size,
        device_type=device_type,
        num_nodes=num_nodes,
        sync_mode=mode,
        reduce_by_scatter=sharded,
        schedule=schedule,
        schedule_line=line,
        capacity=sync.capacity,
        # (reduce_scatter: regional auto becomes the blocks one by one, or the whole step uncut: participants/compilation.py)
        compile_cut=None if sharded else compile_split(config.compile, sync, world_size),
        reduce_dtype=reduce_torch_dtype(sync.reduce_dtype),
        check_each_collective=sync.check == "collective",
        shards_embeddings=config.embedding.shard is not False and world_size > 1 and not sharded,
        start_up_timeout=start_up_timeout(config),
        timeout=timedelta(seconds=config.timeout_s),
        sync=sync,
        compile=config.compile,
        compression=config.compression,
        embedding=config.embedding,
        checkpoint=config.checkpoint,
    )
