"""``StaticDistFabricStrategy``: the static_dist engine under Lightning Fabric, as a thin adapter.

Fabric hands the training loop to the user; each call of it maps onto the parts the Trainer strategy
(:mod:`~lightning_static_dist.strategy`) drives, built by the same code (:mod:`~lightning_static_dist.engine`)::

    fabric.setup(model, optimizer)   every rank takes rank 0's weights; the GradientSynchronizer is attached;
                                     strategy.compile compiles the model, cut where the gradient buckets end
    model(x)                         a forward pre-hook broadcasts rank 0's buffers (strategy.sync.broadcast_buffers)
    fabric.backward(loss)            post-accumulate-grad hooks fill buckets, full buckets launch async (compressed)
                                     collectives during backward; the round finishes as backward returns
    fabric.no_backward_sync(model)   GradientSynchronizer.no_sync(): micro-batches accumulate locally
    optimizer.step()                 steps on the averaged gradients; closes the step's overlap timeline
    fabric.save / fabric.load        each rank's compression state rides along in the checkpoint

Refused under Fabric, at construction, with a one-line :class:`~lightning_static_dist.config.ConfigError` naming the
key: ``sync.mode: graph``, ``sync.reduce: reduce_scatter`` (and ``auto`` with ``mesh.dp_shard`` other than 1),
``sync.nonfinite`` other than ``off``, ``embedding.shard`` and ``compression.name: auto``. They need the Trainer
strategy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _PATH

from lightning_static_dist.compile import CompileReport, compile_optimizer_step, compile_regions
from lightning_static_dist.compression import CompressingReducer
from lightning_static_dist.checkpoint import CheckpointConfig
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.config import ConfigError
from lightning_static_dist.ddp_arguments import DDPArguments, check_process_group_backend, yield_to
from lightning_static_dist.embedding import EmbeddingConfig
from lightning_static_dist.engine import (
    COMPRESSION_KEY,
    broadcast_buffers,
    compile_split,
    build_synchronizer,
    check_same_graphs,
    compressing_reducer_of,
    gather_compression_state,
    register_names,
    restore_compression_state,
    start_from_rank_zero,
)
from lightning_static_dist.processes.launcher import exit_without_native_teardown
from lightning_static_dist.mesh import MeshConfig, build_dp_mesh, resolve_mesh_shape
from lightning_static_dist.overlap.intervals import step_metrics
from lightning_static_dist.overlap.monitor import METRICS, RankAggregate, aggregate_over_ranks
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.overlap.timeline import StepTimeline
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.strategy_config import StrategyConfig
from lightning_static_dist.sync import GradientSynchronizer
from lightning_static_dist.sync.config import SyncConfig

log = logging.getLogger(__name__)


def sync_figures(sync: GradientSynchronizer) -> dict[str, float]:
    """The synchroniser's own figures, rank-local (equal on every rank: one plan, one round count)."""
    stats = sync.stats
    return {"static_dist/sync_rounds": float(stats.rounds), "static_dist/sync_buckets": float(len(sync.plan.buckets)),
            "static_dist/sync_bytes_sent": float(stats.bytes_sent),
            "static_dist/sync_round_bytes": float(stats.last_round_bytes)}


def _refuse_what_fabric_lacks(config: StrategyConfig) -> None:
    """A :class:`ConfigError` for the settings only the Trainer strategy implements."""
    sync = config.sync
    sharded = sync.reduce == "reduce_scatter" or (sync.reduce == "auto" and config.mesh.dp_shard != 1)
    refused = (
        (sync.mode == "graph", "sync.mode", sync.mode, "'hooks'"),
        (sharded, "sync.reduce", sync.reduce, "'all_reduce', or 'auto' with strategy.mesh.dp_shard=1"),
        (sync.nonfinite != "off", "sync.nonfinite", sync.nonfinite, "'off'"),
        (config.embedding.shard is not False, "embedding.shard", config.embedding.shard, "false"),
        (config.compression.name == "auto", "compression.name", config.compression.name, "a compressor by its name"),
        (sync.schedule == "auto", "sync.schedule", sync.schedule, "'overlap' or 'after_backward'"),
        (config.simulate.enabled, "simulate.world_size", config.simulate.world_size, "null"),
        (sync.comm_sms is not None, "sync.comm_sms", sync.comm_sms, "null"),
    )
    for hit, key, value, allowed in refused:
        if hit:
            raise ConfigError(f"strategy.{key}={value!r}: not supported by the Fabric strategy (use the Trainer's"
                              f" StaticDistStrategy); allowed under Fabric: {allowed}")


class StaticDistFabricStrategy(DDPStrategy):
    """Data-parallel training under Fabric with explicit, bucketed gradient collectives that overlap backward.

    Registered in Fabric's ``STRATEGY_REGISTRY`` as ``"static_dist"`` (processes started like ``ddp``),
    ``"static_dist_spawn"`` and ``"static_dist_notebook"`` (``fork``) when ``lightning_static_dist`` is imported.
    The keyword sections are the Trainer strategy's (each a plain dict or its dataclass, validated here, before any
    process starts); one model per strategy is synchronised (the first one set up with trainable parameters).

    Args:
        compile: ``strategy.compile`` (:class:`~lightning_static_dist.compile.config.CompileConfig`): the model set up is
            compiled by the strategy, cut at the gradient buckets (pass the model uncompiled).
        mesh: ``strategy.mesh``; sync: ``strategy.sync``; compression: ``strategy.compression``;
            embedding: ``strategy.embedding``; checkpoint: ``strategy.checkpoint`` (as ``StaticDistStrategy``).
        timeout_s: timeout of every collective, in seconds (default 1800; or ``timeout``, DDP's ``timedelta``).
        process_group_backend: as ``StaticDistStrategy`` (checked when the process group starts).
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"``, ``"fork"``, ``"forkserver"``.
        monitor_every_n_steps: record the overlap timeline every this many optimizer steps (0: never); read the
            figures with :meth:`metrics`.
        timeout, find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb, broadcast_buffers:
            Fabric ``DDPStrategy``'s ``DistributedDataParallel`` arguments, with DDP's meaning
            (``lightning_static_dist/ddp_arguments.py``).

    Example::

        import lightning as L
        import lightning_static_dist  # registers "static_dist" with Fabric too

        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="static_dist")
        fabric = L.Fabric(devices=2, strategy=lightning_static_dist.StaticDistFabricStrategy(
            sync={"bucket_mb": 25}, compression={"name": "powersgd", "rank": 4}))
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        for step, (x, y) in enumerate(fabric.setup_dataloaders(loader)):
            fabric.backward(loss_fn(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            fabric.log_dict(fabric.strategy.metrics(), step=step)  # rank-local: on every rank, or on one
    """

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        *,
        compile: Union[CompileConfig, dict[str, Any], None] = None,
        mesh: Union[MeshConfig, dict[str, Any], None] = None,
        sync: Union[SyncConfig, dict[str, Any], None] = None,
        compression: Union[CompressionConfig, dict[str, Any], None] = None,
        embedding: Union[EmbeddingConfig, dict[str, Any], None] = None,
        checkpoint: Union[CheckpointConfig, dict[str, Any], None] = None,
        simulate: Union[SimulateConfig, dict[str, Any], None] = None,
        timeout_s: Optional[float] = None,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        monitor_every_n_steps: int = 1,
        timeout: Optional[timedelta] = None,
        find_unused_parameters: Optional[bool] = None,
        static_graph: Optional[bool] = None,
        gradient_as_bucket_view: Optional[bool] = None,
        bucket_cap_mb: Optional[float] = None,
        broadcast_buffers: Optional[bool] = None,
    ) -> None:
        ddp = DDPArguments(timeout=timeout, find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                           gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb,
                           broadcast_buffers=broadcast_buffers)
        sections = dict(compile=compile, mesh=mesh, sync=sync, compression=compression, embedding=embedding,
                        checkpoint=checkpoint, simulate=simulate)
        self._config, notes = StrategyConfig.from_arguments(ddp, sections, timeout_s, start_method)
        _refuse_what_fabric_lacks(self._config)
        if isinstance(monitor_every_n_steps, bool) or not isinstance(monitor_every_n_steps, int) or monitor_every_n_steps < 0:
            raise ConfigError(f"monitor_every_n_steps={monitor_every_n_steps!r}: must be an integer >= 0 (0: never)")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=self._config.timeout_s),
            start_method=start_method,
        )
        for note in notes:
            rank_zero_info(note)
        self._backward_sync_control = _LocalAccumulation(self)
        self._monitor_every = monitor_every_n_steps
        self._mesh: Optional[DeviceMesh] = None
        self._module: Optional[Module] = None
        self._synchronizer: Optional[GradientSynchronizer] = None
        self._compression_resume: Optional[dict[str, Any]] = None
        self._buffers_to_broadcast: list[Tensor] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._compile_report: Optional[CompileReport] = None
        self._graphs_checked = True
        self._accumulating = False
        self._recorder: Optional[StepRecorder] = None
        self._step_open = False
        self._steps = 0
        self._overlap_figures: dict[str, float] = {}
        self._aggregate: Optional[RankAggregate] = None
        log.debug(f"{self.__class__.__name__}: initialised with {self._config}")

    @classmethod
    def from_config(cls, config: StrategyConfig, **kwargs: Any) -> StaticDistFabricStrategy:
        """Build the strategy from a validated ``strategy`` block (``load_run_config(...).strategy``); ``kwargs``
        win over the block, as in ``StaticDistStrategy.from_config``."""
        sections = {name: getattr(config, name) for name in StrategyConfig.__dataclass_fields__}
        return cls(**{**yield_to(sections, kwargs), **kwargs})

    # ------------------------------------------------------------------------------------------ what users read

    @property
    def config(self) -> StrategyConfig:
        """The validated strategy configuration (``strategy.config.sync.bucket_mb`` ...)."""
        return self._config

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh, built when the processes start."""
        if self._mesh is None:
            raise RuntimeError("The device mesh is built when the processes start: access it after `fabric.launch()`.")
        return self._mesh

    @property
    def synchronizer(self) -> Optional[GradientSynchronizer]:
        """The gradient synchroniser of the model set up (``None`` before ``fabric.setup`` and on one rank)."""
        return self._synchronizer

    @property
    def compressing_reducer(self) -> Optional[CompressingReducer]:
        """The synchroniser's compressing reducer (``None`` without compression or at world size 1)."""
        return compressing_reducer_of(self._synchronizer)

    @property
    def compile_report(self) -> Optional[CompileReport]:
        """What static compilation did on this rank (``None`` when the model is not compiled)."""
        return self._compile_report

    def metrics(self) -> dict[str, float]:
        """The ``static_dist/*`` figures for ``fabric.log_dict``. Rank-local: no collective, so it may be called on
        every rank or on one (``if fabric.global_rank == 0``); the figures aggregated over ranks were aggregated in
        ``optimizer.step()``, which every rank calls.

        Always (at world size > 1), the synchroniser's own figures, the same on every rank: ``sync_rounds``
        (synchronised backward passes so far), ``sync_buckets`` (buckets in the plan), ``sync_bytes_sent`` (payload
        bytes this rank sent so far) and ``sync_round_bytes`` (those of the latest round). Once per recorded step
        (``monitor_every_n_steps``), the overlap figures (``overlap_ratio``, ``comm_ms``, ``bytes_sent``,
        ``compression_ratio`` ...: the mean over ranks, and ``_max``), as the Trainer's ``OverlapMonitor`` logs them.
        The overlap figures are combined over the ranks in ``optimizer.step()`` of each recorded step: one small
        all-gather, which on CUDA the host waits for (``monitor_every_n_steps=0`` records nothing and combines
        nothing). With ``strategy.compile``, this rank's ``graph_breaks``, ``recompiles`` and ``compile_s`` (the
        ranks compile the same graphs: that is checked before the first bucket collective). Figures nothing measured
        (NaN) are left out.
        """
        figures = sync_figures(self._synchronizer) if self._synchronizer is not None else {}
        overlap, self._overlap_figures = self._overlap_figures, {}  # once per recorded step, as the monitor logs them
        figures.update(overlap)
        report = self._compile_report
        if report is not None:
            figures.update({"static_dist/graph_breaks": float(len(report.graph_breaks)),
                            "static_dist/recompiles": float(len(report.recompiles)),
                            "static_dist/compile_s": float(report.compile_s)})
        return {name: value for name, value in figures.items() if not math.isnan(value)}

    def _aggregate_figures(self, timeline: Optional[StepTimeline]) -> None:
        """After an optimizer step (every rank is here): a recorded step's overlap figures, aggregated over the ranks
        for :meth:`metrics` to hand out."""
        if timeline is not None:  # the same steps are recorded on every rank: they all aggregate, or none does
            if self._aggregate is None:
                self._aggregate = RankAggregate(len(METRICS)).to(self.root_device)
            self._overlap_figures = aggregate_over_ranks(self._aggregate, METRICS, step_metrics(timeline), "",
                                                         self.world_size, no_max=("trigger_delay_worst_bucket_ms",))

    # ------------------------------------------------------------------------------------- processes and ranks

    @override
    def _configure_launcher(self) -> None:
        # in the launching process, before any rank starts: a mesh that cannot fit the world is a config error, and
        # so is a backend torch does not know now (checked again in each rank, at setup_environment)
        resolve_mesh_shape(self._config.mesh, self.num_nodes * self.num_processes)
        check_process_group_backend(self._process_group_backend)
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = _SpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        check_process_group_backend(self._process_group_backend)  # against the backends torch knows now
        super().setup_environment()  # the process group, with strategy.timeout_s
        self._mesh = build_dp_mesh(self.root_device.type, self._config.mesh)

    @property
    def _dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """Every data-parallel rank: the mesh covers the world."""
        return _group.WORLD if self._mesh is not None else None

    # ------------------------------------------------------------------------------------------------ setup

    @override
    def setup_module(self, module: Module) -> Module:
        """Start every rank from rank 0's weights; the first module with trainable parameters gets the synchroniser
        (at world size > 1), compilation (``strategy.compile``) and the step's hooks. The module is not wrapped."""
        start_from_rank_zero(module, self._dp_group)
        if not any(p.requires_grad for p in module.parameters()):
            return module  # nothing to synchronise (a frozen teacher, an evaluation copy)
        if self._module is not None:
            raise RuntimeError("static_dist: the Fabric strategy synchronises one model and one was set up already;"
                               " set up the others without trainable parameters, or combine them in one nn.Module")
        self._module = module
        if self.world_size > 1:
            self._attach_synchronizer(module)
        self._compile(module)
        if self._monitor_every:
            self._recorder = StepRecorder(self.root_device)
            if self._synchronizer is not None:
                self._synchronizer.recorder = self._recorder
        self._hooks += [module.register_forward_pre_hook(self._before_forward),
                        module.register_forward_hook(self._after_forward)]
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        config = self._config.compile
        if config.enabled and config.optimizer:
            if self._compile_report is None:
                self._compile_report = CompileReport()
            compile_optimizer_step(optimizer, config, self._compile_report)
        return optimizer

    def _attach_synchronizer(self, module: Module) -> None:
        sync = self._config.sync
        self._buffers_to_broadcast = list(module.buffers()) if sync.broadcast_buffers else []
        if self._config.checkpoint.format == "sharded":
            rank_zero_warn("static_dist: strategy.checkpoint.format='sharded' has nothing to shard with"
                           " strategy.sync.reduce=all_reduce (every rank holds the whole state); checkpoints are full")
        self._synchronizer = build_synchronizer(module.named_parameters(), sync, self._config.compression,
                                                group=self._dp_group)
        self._restore_compression_state()
        self._synchronizer.attach()

    def _compile(self, module: Module) -> None:
        """``strategy.compile``: the module's ``forward`` (a LightningModule's ``training_step``) as one graph, cut
        where the gradient buckets end so that their collectives still overlap backward; or its blocks one by one."""
        config, sync = self._config.compile, self._config.sync
        if not config.enabled:
            return
        split = compile_split(config, sync, self.world_size)
        self._compile_report = compile_regions(module, config, self._compile_report, split=split)
        self._graphs_checked = False
        if self._synchronizer is not None and self._compile_report.splitter is not None:
            self._synchronizer.ready_groups = self._compile_report.splitter.ready_groups

    def _check_graphs_once(self) -> None:
        # after round 1 (its collectives are sized by the parameter list, checked at setup) and before the first
        # bucket collective of the plan: the ranks compiled the same graphs
        if self._compile_report is None or self._graphs_checked:
            return
        self._graphs_checked = True
        check_same_graphs(self._compile_report, self._dp_group)

    # -------------------------------------------------------------------------------------------- one step

    @torch.compiler.disable  # runs eagerly also when the user's torch.compile traces the module's __call__
    def _before_forward(self, module: Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # an evaluation forward: no buffers taken from rank 0, nothing recorded
        if self._buffers_to_broadcast:
            broadcast_buffers(self._buffers_to_broadcast, self._dp_group)
        recorder = self._recorder
        if recorder is None:
            return
        if not self._step_open:  # the first forward since the last optimizer step (or accumulated micro-batch)
            recorder.active = self._steps % self._monitor_every == 0
            recorder.begin_step(self._steps, self.global_rank)
            self._step_open = True
        recorder.begin("forward")

    @torch.compiler.disable
    def _after_forward(self, module: Module, args: Any, output: Any) -> None:
        if self._recorder is not None:
            self._recorder.end("forward")

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        recorder = self._recorder
        if recorder is not None:
            recorder.begin("backward")
        super().backward(tensor, module, *args, **kwargs)  # the round finishes as the autograd engine finishes
        if recorder is not None:
            recorder.end("backward")  # (already ended where the synchroniser started waiting)
        if self._synchronizer is not None:
            self._check_graphs_once()
            self._synchronizer.finish_if_pending()  # a rank whose backward made no gradient takes part all the same
        if recorder is None:
            return
        if self._accumulating:  # a micro-batch synchronised nothing: its timeline is not kept
            recorder.end_step(keep=False)
            self._step_open = False
        else:
            recorder.begin("optimizer")

    @contextmanager
    def _accumulate_locally(self) -> Iterator[None]:
        self._accumulating = True
        try:
            with self._synchronizer.no_sync() if self._synchronizer is not None else nullcontext():
                yield
        finally:
            self._accumulating = False

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        recorder, self._steps = self._recorder, self._steps + 1
        timeline = None
        if recorder is not None and self._step_open:
            recorder.end("optimizer")
            self._step_open = False
            timeline = recorder.end_step(keep=True)  # on CUDA the step before this one (its events are done)
        self._aggregate_figures(timeline)
        return output

    # -------------------------------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if self._synchronizer is not None:
            self._synchronizer.check_pending_rounds()  # no checkpoint of a step whose ranks were out of step
        reducer = self.compressing_reducer
        if reducer is not None:  # every rank gets here (fabric.save is called on all of them); rank 0 writes
            saved = gather_compression_state(reducer, self._dp_group, self.world_size)
            if saved is not None:
                state = {**state, COMPRESSION_KEY: saved}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: _PATH, state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if COMPRESSION_KEY in remainder:
            self._compression_resume = remainder.pop(COMPRESSION_KEY)
            self._restore_compression_state()  # now, or when the synchroniser is built
        return remainder

    def _restore_compression_state(self) -> None:
        reducer = self.compressing_reducer
        if self._compression_resume is None or reducer is None:
            return
        saved, self._compression_resume = self._compression_resume, None
        restore_compression_state(reducer, saved, self.global_rank, self.world_size, self.root_device)

    # -------------------------------------------------------------------------------------------- teardown

    @override
    def teardown(self) -> None:
        if self._synchronizer is not None:
            self._synchronizer.check_pending_rounds()
            self._synchronizer.detach()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, "Static data-parallel strategy for Fabric (explicit bucketed collectives)")


class _LocalAccumulation(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the synchroniser launches nothing; the gradients accumulate locally."""

    def __init__(self, strategy: StaticDistFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled or module is not self._strategy._module:
            return nullcontext()  # (a module set up without trainable parameters has nothing to hold back)
        return self._strategy._accumulate_locally()


class _SpawnLauncher(_MultiProcessingLauncher):
    """Fabric's spawn/fork launcher whose spawned ranks leave with ``os._exit`` once rank 0's result is handed over:
    the interpreter's teardown of a finished Gloo rank sometimes aborts it (see ``StaticDistSpawnLauncher`` in
    ``lightning_static_dist/processes/launcher.py``)."""

    @override
    def _wrapping_function(self, process_idx: int, function: Callable, args: Any, kwargs: Any, return_queue: Any,
                           global_states: Any = None) -> None:
        super()._wrapping_function(process_idx, function, args, kwargs, return_queue, global_states)
        if self._start_method == "spawn":
            exit_without_native_teardown(0)


StaticDistFabricStrategy.register_strategies(STRATEGY_REGISTRY)
