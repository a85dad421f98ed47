"""The step plan: what the ``strategy`` block means in the world that started, resolved once at setup.

The config says what the user asked (``sync.schedule: measured``, ``sync.reduce: auto``, ``bucket_mb`` in MiB);
the world (its size, device type, nodes and mesh) decides what that becomes. :func:`resolve_plan` makes every decision
once, when the processes have started and the mesh is built (``plan/world.py``'s ``DataParallelWorld.build``,
for both front ends), into one frozen plan of per-feature plans (``plan/features.py``: ``SyncPlan``, ``CompilePlan``
...), and the participants read it as ``view.plan``: none reads a config section. Two decisions are pending states:
``measured`` waits for the link probe at setup, which settles it through :meth:`StepPlan.settled` (a new frozen plan)
before any participant acts on the schedule; ``auto`` is timed by its trial while the fit runs.

Example::

    plan = resolve_plan(StrategyConfig(), world_size=2, device_type="cpu", num_nodes=1, mesh=None)
    plan.sync.schedule            # 'overlap' (measured, without a probe, on CPUs)
    plan.sync.capacity.bytes      # 104857600 (sync.bucket_mb's 100 MiB)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Optional

from torch.distributed.device_mesh import DeviceMesh

from lightning_static_dist.mesh import reduces_by_scatter
from lightning_static_dist.plan.features import (
    CheckpointPlan,
    CompilePlan,
    CompressionPlan,
    EmbeddingPlan,
    Schedule,
    SyncMode,
    SyncPlan,
    checkpoint_plan,
    compile_cut,
    compile_plan,
    compression_plan,
    embedding_plan,
)
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync.config import overlap_hazards, schedule_without_probe
from lightning_static_dist.sync.schedule_choice import MeasuredChoice

__all__ = ["CheckpointPlan", "CompilePlan", "CompressionPlan", "EmbeddingPlan", "Schedule", "StepPlan", "SyncMode",
           "SyncPlan", "resolve_plan", "start_up_timeout"]

START_UP_S = 600.0
"""Seconds the collectives may wait until the first optimizer step is over, when ``strategy.timeout_s`` is shorter:
the ranks of a job start seconds apart (each imports torch and Lightning), and setup and the first step (a rank's
data preparation, a compilation) keep one rank waiting for another far longer than a collective of a running job
should. ``participants/runtime.py``'s ``CollectiveTimeout`` sets ``strategy.timeout_s`` then."""


def start_up_timeout(config: StrategyConfig) -> timedelta:
    """The collectives' timeout from the start until the first optimizer step is over (:data:`START_UP_S`)."""
    return timedelta(seconds=max(config.timeout_s, START_UP_S))


@dataclass(frozen=True)
class StepPlan:
    """The ``strategy`` block resolved for one world: every decision a participant acts on, made once, one frozen
    plan per feature.

    Example::

        plan = resolve_plan(config, world_size=2, device_type="cuda", num_nodes=1, mesh=mesh)
        if plan.sync.mode == "hooks" and plan.sync.launch_during_backward: ...
    """

    world_size: int
    device_type: str
    num_nodes: int
    sync: SyncPlan
    compile: CompilePlan
    compression: CompressionPlan
    embedding: EmbeddingPlan
    checkpoint: CheckpointPlan
    start_up_timeout: timedelta
    """The collectives' timeout until the first optimizer step is over (:data:`START_UP_S`)."""
    timeout: timedelta
    """``strategy.timeout_s``, set on the collectives after the first optimizer step."""

    def settled(self, schedule: Literal["overlap", "after_backward"], line: str,
                choice: Optional[MeasuredChoice] = None, reduce_dtype: Literal["fp32", "bf16"] = "fp32",
                comm_sms: Optional[int] = None) -> StepPlan:
        """This plan with ``measured`` settled: the schedule, the line printed at fit start, and what follows from the
        choice (the compile cut, the reduce dtype, the SMs). The one way a pending schedule is resolved."""
        sync = self.sync
        if sync.schedule != "measured":
            raise RuntimeError(f"sync.schedule is {sync.schedule!r}: only a pending 'measured' is settled")
        sync = dataclasses.replace(sync, schedule=schedule, schedule_line=line, schedule_choice=choice,
                                   reduce_dtype=reduce_dtype, comm_sms=sync.comm_sms if comm_sms is None else comm_sms)
        cut = compile_cut(self.compile.regional, self.world_size, sync.mode, schedule, sync.reduce_by_scatter,
                          sync.capacity)
        return dataclasses.replace(self, sync=sync, compile=dataclasses.replace(self.compile, cut=cut))

    def overlap_hazards(self, schedule: Optional[str] = None) -> list[str]:
        """What the block rules the optimizer overlap out with, under ``schedule`` (``None``: the plan's), a clause
        each: :func:`~lightning_static_dist.sync.config.overlap_hazards`, the one judge of it."""
        sync = self.sync
        return overlap_hazards(sync.schedule if schedule is None else schedule, graph=sync.mode == "graph",
                               sharded=sync.reduce_by_scatter, compression=self.compression.name,
                               nonfinite=sync.nonfinite, compile_optimizer=self.compile.optimizer)


def resolve_plan(config: StrategyConfig, *, world_size: int, device_type: str, num_nodes: int,
                 mesh: Optional[DeviceMesh], free_links: bool = False) -> StepPlan:
    """The plan of ``config`` in this world, every decision made here (``free_links``: a simulated world whose
    collectives cost nothing). ``sync.schedule: measured`` becomes concrete where no probe decides it
    (:func:`~lightning_static_dist.sync.config.schedule_without_probe`: one rank, CPUs, graph mode, reduce_scatter,
    ``sync.probe: false``), with the line that says what it became; elsewhere it stays pending for the probe."""
    asked = config.sync
    sharded = reduces_by_scatter(asked.reduce, mesh, world_size)
    schedule, reduce_dtype, line = asked.schedule, asked.reduce_dtype, None
    resolution = schedule_without_probe(asked, device_type=device_type, world_size=world_size, sharded=sharded,
                                        free_links=free_links)
    if resolution is not None:
        schedule, why = resolution
        if reduce_dtype == "auto":  # (nothing measured bf16's worth: the exact dtype)
            reduce_dtype, why = "fp32", f"{why}; reduce_dtype auto: fp32"
        line = f"sync.schedule measured: {schedule} ({why})"
    mode: Optional[SyncMode] = None
    if world_size > 1:
        mode = "sharded" if sharded else asked.mode
    sync = SyncPlan(mode=mode, reduce_by_scatter=sharded, schedule=schedule, schedule_line=line,
                    capacity=asked.capacity, reduce_dtype=reduce_dtype, comm_sms=asked.comm_sms,
                    check_each_collective=asked.check == "collective", nonfinite=asked.nonfinite,
                    broadcast_buffers=asked.broadcast_buffers, optimizer_overlap=asked.optimizer_overlap,
                    trial_steps=asked.schedule_trial_steps)
    cut = compile_cut(config.compile.regional, world_size, mode, schedule, sharded, sync.capacity)
    return StepPlan(
        world_size=world_size,
        device_type=device_type,
        num_nodes=num_nodes,
        sync=sync,
        compile=compile_plan(config.compile, device_type, cut),
        compression=compression_plan(config.compression),
        embedding=embedding_plan(config.embedding, world_size, sharded),
        checkpoint=checkpoint_plan(config.checkpoint, sharded),
        start_up_timeout=start_up_timeout(config),
        timeout=timedelta(seconds=config.timeout_s),
    )
