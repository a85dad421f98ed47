"""Each feature's part of the step plan: what its section of the ``strategy`` block became in the world that started.

:func:`~lightning_static_dist.plan.step_plan.resolve_plan` makes them, once, at setup; the participants read them
(``view.plan.sync.schedule``, ``view.plan.compile.cut`` ...) and never a config section. Each is frozen: a pending
decision (``sync.schedule: measured``) is settled by a new plan, never by a write.

Example::

    plan = resolve_plan(StrategyConfig(), world_size=2, device_type="cpu", num_nodes=1, mesh=None)
    plan.sync.schedule, plan.sync.capacity.bytes, plan.compile.enabled     # ('overlap', 104857600, False)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from lightning_static_dist.checkpoint import CheckpointConfig
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.embedding import EmbeddingConfig
from lightning_static_dist.sync.config import launches_during_backward, reduce_torch_dtype
from lightning_static_dist.sync.plan import BucketCapacity
from lightning_static_dist.sync.schedule_choice import MeasuredChoice

SyncMode = Literal["hooks", "graph", "sharded"]
"""How a multi-rank fit averages: bucket hooks, collectives inside the compiled backward, or reduce-scatter shards."""

Schedule = Literal["overlap", "after_backward", "auto", "measured"]
"""``sync.schedule`` once the world is known: ``measured`` and ``auto`` are pending (the probe at setup settles
``measured`` through ``StepPlan.settled``; ``auto``'s trial chooses among its candidates while the fit runs)."""


@dataclass(frozen=True)
class SyncPlan:
    """``strategy.sync`` decided for this world.

    Example::

        if plan.sync.mode == "hooks" and plan.sync.launch_during_backward: ...
    """

    mode: Optional[SyncMode]
    """How gradients are averaged when fitting; ``None`` on one rank (nothing to average)."""
    reduce_by_scatter: bool
    """``sync.reduce`` resolved against the mesh (``auto``: reduce_scatter where ``dp_shard > 1``)."""
    schedule: Schedule
    """When the buckets are issued (``measured``: pending until the probe at setup; ``auto``: its trial's)."""
    schedule_line: Optional[str]
    """What ``measured`` became and why, printed at fit start (``None``: nothing was resolved)."""
    capacity: BucketCapacity
    """The buckets' capacities in bytes (``sync.first_bucket_mb`` / ``sync.bucket_mb``)."""
    reduce_dtype: Literal["fp32", "bf16", "auto"]
    """The dtype gradients are averaged in (``auto``: pending; rounds start in fp32 until a trial or the probe
    chooses)."""
    comm_sms: Optional[int]
    """SMs a collective may use (``None``: the library's own choice)."""
    check_each_collective: bool
    """``sync.check: collective``."""
    nonfinite: Literal["off", "warn", "skip", "error"]
    broadcast_buffers: bool
    optimizer_overlap: Union[bool, Literal["auto"]]
    """As asked: the run's own hazards decide ``auto`` at setup (``StepPlan.overlap_hazards`` has the block's)."""
    trial_steps: int
    """``sync.schedule: auto``: optimizer steps each candidate is tried for."""
    schedule_choice: Optional[MeasuredChoice] = None
    """The probe's evidence and the predicted step of each candidate, once ``measured`` is settled by a probe (or by
    a checkpoint's choice)."""

    @property
    def launch_during_backward(self) -> bool:
        """Whether buckets are issued as they fill during backward (``after_backward``: all once backward ends;
        ``auto`` starts as ``overlap``, its trial switches it)."""
        return launches_during_backward(self.schedule)

    @property
    def torch_reduce_dtype(self) -> Optional[torch.dtype]:
        """:attr:`reduce_dtype` as the synchroniser takes it (``None``: the gradients' own)."""
        return reduce_torch_dtype(self.reduce_dtype)


@dataclass(frozen=True)
class CompilePlan:
    """``strategy.compile`` decided for this world (``enabled: auto`` by the device). What the run adds at setup (a
    ``torch.compile(model)``'s backend, ``regional`` under reduce_scatter, CUDA graphs against the loop) the compile
    participant decides on top of it.

    Example::

        compile_regions(module, plan.compile, split=plan.compile.cut)
    """

    KEY = CompileConfig.KEY

    enabled: bool
    backend: str
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
    fullgraph: bool
    dynamic: Union[bool, Literal["auto"]]
    regional: Union[bool, Literal["auto"]]
    around_blocks: bool
    fallback: Literal["eager", "error"]
    optimizer: bool
    cudagraphs: Union[bool, Literal["auto"]]
    """As asked until the compile participant decides ``auto`` against the run."""
    cut: Optional[BucketCapacity]
    """Where the compiled step is cut (the bucket capacities), or ``None``: uncut (one rank, ``regional`` true or
    false, graph mode, reduce_scatter, ``schedule: after_backward``, a ``measured`` not settled yet)."""

    @property
    def torch_dynamic(self) -> Optional[bool]:
        """``dynamic`` as ``torch.compile`` takes it (``None``: automatic dynamic shapes)."""
        return None if self.dynamic == "auto" else bool(self.dynamic)


@dataclass(frozen=True)
class EmbeddingPlan:
    """``strategy.embedding`` decided for this world."""

    shard: Union[bool, Literal["auto"]]
    """As asked (``auto``: the embeddings of at least :attr:`min_rows` rows)."""
    on: bool
    """Whether embeddings are sharded: asked, on several ranks, without reduce_scatter (which already shards every
    parameter's optimizer state)."""
    min_rows: int
    prefetch: Literal["batch_start", "after_optimizer"]
    gather_once_per_step: bool


@dataclass(frozen=True)
class CompressionPlan:
    """``strategy.compression``: nothing in it depends on the world; the section's choices, frozen."""

    name: str
    rank: int
    warm_start: bool
    min_compression_rate: float
    levels: int
    density: float
    error_feedback: bool
    start_step: int
    min_numel: int
    trial_steps: int


@dataclass(frozen=True)
class CheckpointPlan:
    """``strategy.checkpoint`` decided for this world."""

    format: Literal["full", "sharded"]
    """``sharded`` where each rank holds shards of the optimizer state (reduce_scatter) and the format is not
    ``full``; otherwise one full checkpoint."""
    sharded_unavailable: bool
    """``format: sharded`` asked where nothing is sharded (``all_reduce``): said once, at setup."""
    consolidate_at_end: bool


def compile_cut(regional: Union[bool, str], world_size: int, mode: Optional[str], schedule: str,
                reduce_by_scatter: bool, capacity: BucketCapacity) -> Optional[BucketCapacity]:
    """Where the compiled step is cut: the bucket capacities, or ``None`` (uncut): at world size 1 (nothing to
    overlap), for the blocks compiled one by one or the whole step asked for uncut (``regional`` true or false), in
    graph mode (the collectives are inside the graph), under reduce_scatter (its gathers follow the blocks:
    ``participants/compilation.py``), with ``after_backward`` (every bucket is issued once backward ends: a cut would
    only cost) and while ``measured`` is pending."""
    if schedule == "measured" or regional != "auto" or world_size < 2 or reduce_by_scatter:
        return None
    if mode == "graph" or not launches_during_backward(schedule):
        return None
    return capacity


def compile_plan(config: CompileConfig, device_type: str, cut: Optional[BucketCapacity]) -> CompilePlan:
    """``strategy.compile`` in a world of ``device_type``: ``enabled: auto`` is on CUDA only (on a CPU the compile
    outlasts a small model's fit)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if config.enabled == "auto":
        fields["enabled"] = device_type == "cuda"
    return CompilePlan(**fields, cut=cut)


def embedding_plan(config: EmbeddingConfig, world_size: int, reduce_by_scatter: bool) -> EmbeddingPlan:
    return EmbeddingPlan(shard=config.shard, on=config.shard is not False and world_size > 1 and not reduce_by_scatter,
                         min_rows=config.min_rows, prefetch=config.prefetch,
                         gather_once_per_step=config.gather_once_per_step)


def compression_plan(config: CompressionConfig) -> CompressionPlan:
    return CompressionPlan(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def checkpoint_plan(config: CheckpointConfig, reduce_by_scatter: bool) -> CheckpointPlan:
    return CheckpointPlan(format="sharded" if reduce_by_scatter and config.format != "full" else "full",
                          sharded_unavailable=config.format == "sharded" and not reduce_by_scatter,
                          consolidate_at_end=config.consolidate_at_end)
