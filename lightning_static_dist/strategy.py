"""``StaticDistStrategy``: the Lightning lifecycle of data-parallel training without the DDP wrapper.

The strategy owns processes, the process group, the ``DeviceMesh``, placement, checkpoints and the hooks Lightning
calls; the mechanics live in small modules: :mod:`~lightning_static_dist.mesh` (mesh shape),
:mod:`~lightning_static_dist.sync` (bucketed gradient collectives), :mod:`~lightning_static_dist.config` (validation).

One training step, as Lightning drives it::

    training_step      buffers broadcast from rank 0 (``sync.broadcast_buffers``), then the user's forward
    backward           post-accumulate-grad hooks fill buckets; full buckets launch async collectives (compiled
                       as one graph, the step is cut at the buckets: each piece's gradients are ready together)
    post_backward      GradientSynchronizer.finish(): launch the rest, make the stream wait, no host wait
                       (sync.mode=graph: the collectives are inside the compiled backward graph instead)
    optimizer step     the precision plugin unscales / clips the *synchronised* gradients, then steps
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_static_dist.callbacks import GraphReport
from lightning_static_dist.checkpoint import (
    ShardedOptimizerState,
    consolidate,
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
)
from lightning_static_dist.compat import (
    allow_compiled_models_in_trainer,
    destroy_process_groups_at_exit,
    mark_run_failed,
    unwrap_optimizer,
)
from lightning_static_dist.compile import (
    CompileReport,
    backend_of,
    compile_optimizer_step,
    compile_regions,
    drop_short_last_batch,
    find_regions,
    graph_mode_patches,
    is_compiled,
)
from lightning_static_dist.compression import CompressingReducer
from lightning_static_dist.compression.auto import CompressionTrial
from lightning_static_dist.config import (
    CheckpointConfig,
    CompileConfig,
    CompressionConfig,
    ConfigError,
    EmbeddingConfig,
    MeshConfig,
    StrategyConfig,
    SyncConfig,
)
from lightning_static_dist.ddp_arguments import DDPArguments, device_backend, strategy_config, yield_to
from lightning_static_dist.embedding import EmbeddingSharder
from lightning_static_dist.engine import (
    COMPRESSION_KEY as _COMPRESSION_KEY,
    broadcast_buffers,
    bucket_split,
    build_synchronizer,
    check_same_graphs,
    compressing_reducer_of,
    compression_trial,
    gather_compression_state,
    register_names,
    restore_compression_state,
    start_from_rank_zero,
    use_compressor,
)
from lightning_static_dist.faults import diagnose, is_collective_failure, record_nccl_flight, waiting_in
from lightning_static_dist import loop as loop_patches
from lightning_static_dist.launcher import StaticDistLauncher, StaticDistSpawnLauncher
from lightning_static_dist.fingerprint import RankMismatchError
from lightning_static_dist.mesh import REPLICATE_DIM, SHARD_DIM, build_dp_mesh, resolve_mesh_shape
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.sync import GradientSynchronizer
from lightning_static_dist.sync.graph import GraphGradientSync
from lightning_static_dist.sync.sharded import ShardedGradientSynchronizer
from lightning_static_dist.watchdog import PeerWatchdog

log = logging.getLogger(__name__)


_TRIAL_KEY = "static_dist_compression_auto"  # compression.name: auto: the trial's choice and times
_PIECES_KEY = "static_dist_optimizer_pieces"  # optimizer_state() in sharded-checkpoint mode: this rank's ranges

#: torch.optim optimizers whose update of an element depends on more than that element's own gradient and state:
#: stepping flat chunks of the parameters would change their results (reduce_scatter refuses them).
_NOT_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "SparseAdam")
                         if hasattr(torch.optim, name))


#: backends whose communicator is created eagerly on the rank's device when the process group is bound to it
_DEVICE_BOUND_BACKENDS = ("nccl", "xccl", "hccl")


def binds_device(backend: str, device: torch.device) -> bool:
    """Whether the process group starts bound to the rank's device (``device_id``): for the accelerator's own
    collective library (NCCL, XCCL, HCCL), so that the mesh's groups are split from one eagerly created
    communicator. Any other backend is not bound — Gloo carrying CUDA tensors in particular: ``DeviceMesh`` would
    then split its groups, and ``split_group`` cannot copy Gloo's options (``TypeError: cannot pickle ...
    _Options`` on torch 2.11). ``backend`` was validated by ``ddp_arguments.check_process_group_backend``."""
    return device.type != "cpu" and device_backend(backend, device.type) in _DEVICE_BOUND_BACKENDS


class StaticDistStrategy(ParallelStrategy):
    """Data-parallel training with explicit, bucketed gradient collectives over a ``DeviceMesh``.

    Registered as ``"static_dist"`` (processes started like ``ddp``), ``"static_dist_spawn"`` (``spawn``, for tests
    and scripts without a ``__main__`` guard problem) and ``"static_dist_notebook"`` (``fork``) when
    ``lightning_static_dist`` is imported. Each keyword section takes a plain dict or its dataclass; omitted sections
    take their defaults. Bad values raise :class:`~lightning_static_dist.config.ConfigError` here, before any
    process starts.

    Args:
        compile: ``strategy.compile`` (:class:`~lightning_static_dist.config.CompileConfig`).
        mesh: ``strategy.mesh`` (:class:`~lightning_static_dist.config.MeshConfig`).
        sync: ``strategy.sync`` (:class:`~lightning_static_dist.config.SyncConfig`).
        compression: ``strategy.compression`` (:class:`~lightning_static_dist.config.CompressionConfig`).
        embedding: ``strategy.embedding`` (:class:`~lightning_static_dist.config.EmbeddingConfig`).
        checkpoint: ``strategy.checkpoint`` (:class:`~lightning_static_dist.config.CheckpointConfig`).
        timeout_s: timeout of every collective, in seconds (default 1800; or ``timeout``, DDP's ``timedelta``).
        process_group_backend: a backend registered with ``torch.distributed`` (``"nccl"``, ``"gloo"``, ``"xccl"``
            ...) or ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``), checked here; by default NCCL on CUDA and
            Gloo on CPU.
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"``, ``"fork"``, ``"forkserver"``.
        num_nodes: accepted for code written against older strategies; as with ``DDPStrategy``, Lightning sets the
            strategy's ``num_nodes`` from ``Trainer(num_nodes=...)``, which is the value that counts.
        timeout, find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb, broadcast_buffers,
            ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper, model_averaging_period: Lightning ``DDPStrategy``'s
            arguments, with DDP's meaning (``lightning_static_dist/ddp_arguments.py``): ``timeout`` and the two
            bucket settings stand for ``timeout_s``, ``sync.bucket_mb`` and ``sync.broadcast_buffers``; the three
            DDP switches are accepted with one line saying why they have nothing to do here; a communication hook or
            model averaging is refused, naming what to use. Other ``DistributedDataParallel`` arguments
            (``init_sync`` ...) are a ``TypeError`` naming them.

    Example::

        import lightning as L
        import lightning_static_dist  # registers "static_dist"

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="static_dist")
        trainer = L.Trainer(devices=2, strategy=lightning_static_dist.StaticDistStrategy(sync={"bucket_mb": 10}))
    """

    strategy_name = "static_dist"

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        *,
        compile: Union[CompileConfig, dict[str, Any], None] = None,
        mesh: Union[MeshConfig, dict[str, Any], None] = None,
        sync: Union[SyncConfig, dict[str, Any], None] = None,
        compression: Union[CompressionConfig, dict[str, Any], None] = None,
        embedding: Union[EmbeddingConfig, dict[str, Any], None] = None,
        checkpoint: Union[CheckpointConfig, dict[str, Any], None] = None,
        timeout_s: Optional[float] = None,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        num_nodes: int = 1,
        timeout: Optional[timedelta] = None,
        find_unused_parameters: Optional[bool] = None,
        static_graph: Optional[bool] = None,
        gradient_as_bucket_view: Optional[bool] = None,
        bucket_cap_mb: Optional[float] = None,
        broadcast_buffers: Optional[bool] = None,
        ddp_comm_state: Any = None,
        ddp_comm_hook: Any = None,
        ddp_comm_wrapper: Any = None,
        model_averaging_period: Optional[int] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        ddp = DDPArguments(timeout, find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb,
                           broadcast_buffers, ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper, model_averaging_period)
        sections = dict(compile=compile, mesh=mesh, sync=sync, compression=compression, embedding=embedding,
                        checkpoint=checkpoint)
        self._config, notes = strategy_config(ddp, sections, timeout_s, start_method, process_group_backend)
        if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
            raise ConfigError(f"num_nodes={num_nodes!r}: must be an integer >= 1")
        for note in notes:
            rank_zero_info(note)
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = num_nodes
        # Lightning's compile check, widened for this strategy only (once per process; others keep the original)
        allow_compiled_models_in_trainer()
        self._mesh: Optional[DeviceMesh] = None
        self._compression_resume: Optional[dict[str, Any]] = None
        self._trial: Optional[CompressionTrial] = None
        self._trial_resume: Optional[dict[str, Any]] = None
        self._embedding_sharder: Optional[EmbeddingSharder] = None
        self._watchdog: Optional[PeerWatchdog] = None
        self.failure: Optional[str] = None
        """One line saying which rank stopped participating, and where, after a communication failure."""
        self.nonfinite_steps = 0
        """Synchronised steps whose averaged gradients held NaN/Inf (with ``strategy.sync.nonfinite`` on)."""
        self._accumulating = False
        self._failed = False
        self._synchronizer: Optional[GradientSynchronizer] = None
        self._buffers_to_broadcast: list[Tensor] = []
        self._compile_report: Optional[CompileReport] = None
        self._graph_sync: Optional[GraphGradientSync] = None
        self.recorder: Optional[StepRecorder] = None
        """The overlap monitor's recorder, when one is attached."""
        self.requested_backend: Optional[str] = None
        """Set when ``trainer.fit(torch.compile(model))`` asked for compilation with this backend."""
        self._graphs_checked = True
        self._gather_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._buckets_at_step_start: Optional[list[int]] = None
        self._last_sharded_checkpoint: Optional[str] = None
        self._loop_patched: Optional[pl.Trainer] = None
        self._host_group: Optional[torch.distributed.ProcessGroup] = None
        log.debug(f"{self.__class__.__name__}: initialised with {self._config}")

    # ------------------------------------------------------------------------------------------ configuration

    @property
    def config(self) -> StrategyConfig:
        """The validated strategy configuration (``strategy.config.sync.bucket_mb`` ...)."""
        return self._config

    @classmethod
    def from_config(cls, config: StrategyConfig, **kwargs: Any) -> StaticDistStrategy:
        """Build the strategy from a validated ``strategy`` block (``RunConfig.strategy``).

        ``kwargs`` go to ``__init__`` and win over the block: a section or ``timeout_s`` replaces the block's, a DDP
        argument (``timeout``, ``bucket_cap_mb``, ``broadcast_buffers``) the key it stands for. Two ``kwargs`` for
        one key (``timeout`` and ``timeout_s``; ``bucket_cap_mb`` and ``sync={"bucket_mb": ...}``) are a
        :class:`~lightning_static_dist.config.ConfigError` naming it.

        Example::

            config = load_run_config("charlm_cpu").strategy
            strategy = StaticDistStrategy.from_config(config, timeout=timedelta(minutes=5), start_method="spawn")
        """
        sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(**{**yield_to(sections, kwargs), **kwargs})

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh, built in :meth:`setup_environment` from the world that actually started."""
        if self._mesh is None:
            raise RuntimeError("The device mesh is built when the processes start: access it in or after `setup`.")
        return self._mesh

    @property
    def synchronizer(self) -> Optional[GradientSynchronizer]:
        """The gradient synchroniser while fitting (``None`` before ``setup``, outside ``fit`` and on one rank)."""
        return self._synchronizer

    @property
    def graph_sync(self) -> Optional[GraphGradientSync]:
        """With ``sync.mode: graph`` while fitting: the averaging identity the parameters are read through."""
        return self._graph_sync

    @property
    def is_distributed(self) -> bool:
        # Lightning asks this of strategies it does not know (sampler insertion, `self.log(sync_dist=True)`)
        return True

    # ------------------------------------------------------------------------------------- processes and ranks

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # Lightning's connector sets it from Trainer(num_nodes=...); a different constructor value would be lost silently
        if num_nodes != self._num_nodes and self._num_nodes != 1:
            rank_zero_warn(f"static_dist: num_nodes={self._num_nodes} given to the strategy is replaced by the Trainer's"
                           f" num_nodes={num_nodes} (as with DDPStrategy: set it on the Trainer)")
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        """The backend given, else the default for this rank's device (NCCL on CUDA, Gloo on CPU) once the devices are
        known (``DDPStrategy``'s reads ``None`` until its process group starts)."""
        if self._process_group_backend is None and self.parallel_devices:
            return _get_default_process_group_backend_for_device(self.root_device)
        return self._process_group_backend

    @property
    def sharded_sync(self) -> Optional[ShardedGradientSynchronizer]:
        """With ``sync.reduce: reduce_scatter`` while fitting: the synchroniser holding this rank's shards."""
        sync = self._synchronizer
        return sync if isinstance(sync, ShardedGradientSynchronizer) and not sync.released else None

    def _reduce_scatter(self) -> bool:
        """``strategy.sync.reduce`` resolved against the mesh that started (``auto``: reduce_scatter if dp_shard > 1)."""
        reduce = self._config.sync.reduce
        if reduce == "auto":
            return self._mesh is not None and self._mesh.size(1) > 1
        return reduce == "reduce_scatter" and self.world_size > 1

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # in the launching process, before any rank starts: a mesh that cannot fit the world is a config error
        resolve_mesh_shape(self._config.mesh, self.num_nodes * self.num_processes)
        if self._start_method == "popen":
            self._launcher = StaticDistLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = StaticDistSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()
        if self.lightning_module is not None:
            # the same hand-over ModelParallelStrategy uses: `self.device_mesh` inside the LightningModule
            self.lightning_module._device_mesh = self._mesh

    def setup_distributed(self) -> None:
        """Initialise the process group and build the data-parallel mesh over it."""
        log.debug(f"{self.__class__.__name__}: setting up distributed...")
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        record_nccl_flight(self._process_group_backend, self.root_device,
                           trainer.default_root_dir if trainer is not None else os.getcwd())
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=timedelta(seconds=self._config.timeout_s),
            device_id=self.root_device if binds_device(self._process_group_backend, self.root_device) else None,
        )
        destroy_process_groups_at_exit()  # at exit, while the interpreter is whole; not after a failure
        self._mesh = build_dp_mesh(self.root_device.type, self._config.mesh)
        if self.world_size > 1 and self._host_group is None:  # once per strategy: every later stage reuses it
            self._host_group = loop_patches.host_group(timedelta(seconds=self._config.timeout_s))
        if self.world_size > 1 and self._watchdog is None:  # a dead peer ends this rank even where it cannot raise
            self._watchdog = PeerWatchdog(self.global_rank, self.world_size, failed=lambda: self._failed,
                                          step=lambda: trainer.global_step if trainer is not None else -1)
            self._watchdog.start()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------------------------------------- setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        start_from_rank_zero(self.model, self._dp_group)
        if trainer.state.fn == TrainerFn.FITTING:
            self._shard_embeddings()  # before the optimizer is built: it must hold the shards, not the full weights
            self.setup_optimizers(trainer)
            if self.world_size > 1:  # one rank has nothing to average: no buckets, no copies
                self._attach_synchronizer()
        self._compile(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.world_size > 1:
                # Lightning's per-step SIGTERM broadcast, host to host instead of through the device (loop.py says why)
                self._loop_patched = trainer if loop_patches.install(trainer, self._host_group) else None

    # ----------------------------------------------------------------------------------------------- compile

    def adopt_compiled_model(self, dynamo_ctx: Any) -> None:
        """``trainer.fit(torch.compile(model))``: Lightning's compile check (widened by
        :func:`~lightning_static_dist.compat.allow_compiled_models_in_trainer`) hands over the user's ``torch.compile``
        context and takes the compiled model apart; the strategy compiles it its own way, with the user's backend."""
        self.requested_backend = backend_of(dynamo_ctx) or self.config.compile.backend

    @property
    def compile_report(self) -> Optional[CompileReport]:
        """What static compilation did on this rank (``None`` when the model is not compiled)."""
        return self._compile_report

    def _compile_config(self) -> CompileConfig:
        """``strategy.compile`` as it applies to this run: enabled by ``trainer.fit(torch.compile(model))``, and with
        ``reduce_scatter`` a ``regional: auto`` resolved to the blocks one by one (each block waits for its own
        parameters' all-gather in a forward pre-hook; a graph cut at the buckets could not follow that synchroniser's
        static plan), or to the whole step uncut for a model without repeated blocks."""
        config = self._config.compile
        if self.requested_backend is not None:
            # the user passed torch.compile(model); Lightning's compile check (see compile.py) unwrapped it
            config = dataclasses.replace(config, enabled=True, backend=self.requested_backend)
        if config.regional == "auto" and self._reduce_scatter():
            config = dataclasses.replace(config, regional=bool(self._repeated_blocks()))
        return config

    def _repeated_blocks(self) -> list[torch.nn.Module]:
        """The blocks ``regional: true`` would compile one by one (none when the model has no repeated blocks)."""
        assert self.lightning_module is not None
        try:
            return [m for _, m in find_regions(self.lightning_module, True)]
        except ConfigError:
            return []

    def _compile(self, trainer: pl.Trainer) -> None:
        """Compile the LightningModule as ``strategy.compile`` says (or as a ``torch.compile``-d model asked)."""
        module = self.lightning_module
        assert module is not None
        config = self._compile_config()
        if self.requested_backend is not None:
            rank_zero_info(f"static_dist: compiling the torch.compile()-d model in the strategy (backend {config.backend!r})")
        sync = self._config.sync
        graph_mode = sync.mode == "graph" and self.world_size > 1
        if graph_mode and not config.enabled:
            raise ConfigError("strategy.sync.mode='graph': the collectives live in the compiled graph, which needs"
                              " strategy.compile.enabled=true (or trainer.fit(torch.compile(model))); allowed"
                              " without compile: 'hooks'")
        if config.enabled and not is_compiled(module):
            split = None
            if config.regional == "auto" and self.world_size > 1 and not graph_mode:
                # one graph for forward + loss, cut where the buckets end so that collectives still overlap backward
                # (decided from the config, not from this stage: a validate before fit compiles for the fit too)
                split = bucket_split(sync)
            patches = graph_mode_patches(sync.first_bucket_mb, sync.bucket_mb) if graph_mode else None
            self._compile_report = compile_regions(module, config, split=split, inductor_patches=patches)
            if config.optimizer and trainer.state.fn == TrainerFn.FITTING:
                for optimizer in self.optimizers:
                    compile_optimizer_step(optimizer, config, self._compile_report)
            if not any(isinstance(c, GraphReport) for c in trainer.callbacks):
                trainer.callbacks.append(GraphReport())
            self._graphs_checked = False
        report = self._compile_report
        if report is not None and report.splitter is not None and self._synchronizer is not None:
            # also on a later fit of the same, already compiled model: its plan follows the same pieces
            self._synchronizer.ready_groups = report.splitter.ready_groups

    def _check_graphs_once(self) -> None:
        # after round 1 (whose collectives are sized by the parameter list, checked at setup) and before the first
        # bucket collective of the plan: ranks compiled the same graphs
        if self._compile_report is None or self._graphs_checked:
            return
        self._graphs_checked = True
        check_same_graphs(self._compile_report, self._dp_group)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # here, not in on_train_start: Lightning counts an epoch's batches (validation schedule, progress) right after
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.training and self._compile_report is not None and not self._config.compile.dynamic:
            drop_short_last_batch(dataloader)
        return dataloader

    @property
    def _dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """Every data-parallel rank: the mesh covers the world."""
        return _group.WORLD if self._mesh is not None else None

    def _attach_synchronizer(self) -> None:
        assert self.model is not None
        sync = self._config.sync
        self._buffers_to_broadcast = list(self.model.buffers()) if sync.broadcast_buffers else []
        sharded = self._embedding_sharder.shard_parameters() if self._embedding_sharder is not None else set()
        if self._reduce_scatter():
            self._attach_sharded_synchronizer()
            return
        if self._config.checkpoint.format == "sharded":
            rank_zero_warn("static_dist: strategy.checkpoint.format='sharded' has nothing to shard with"
                           " strategy.sync.reduce=all_reduce (every rank holds the whole state); checkpoints are full")
        reduce_dtype = torch.bfloat16 if sync.reduce_dtype == "bf16" else None
        if sync.mode == "graph":
            self._graph_sync = GraphGradientSync(self.model, group=self._dp_group, reduce_dtype=reduce_dtype)
            self._graph_sync.attach()
            return
        self._synchronizer = build_synchronizer(
            # a shard's gradient arrives averaged by its own reduce-scatter
            [(name, p) for name, p in self.model.named_parameters() if id(p) not in sharded],
            sync, self._config.compression, group=self._dp_group,
        )
        if self._config.compression.name == "auto":
            self._trial = compression_trial(self._config.compression, self.root_device, self._dp_group)
            self._resume_trial()
        if self.compressing_reducer is not None:
            self._restore_compression_state()
        self._synchronizer.attach()
        self._synchronizer.recorder = self.recorder

    def _attach_sharded_synchronizer(self) -> None:
        """``sync.reduce: reduce_scatter``: the optimizer is re-pointed at this rank's shards before its first step."""
        assert self.model is not None and self._mesh is not None
        if len(self.optimizers) != 1:
            raise ConfigError(f"strategy.sync.reduce='reduce_scatter': needs exactly one optimizer, configure_optimizers"
                              f" returned {len(self.optimizers)}; allowed with several: 'all_reduce'")
        optimizer = self.optimizers[0]
        inner = unwrap_optimizer(optimizer)
        if isinstance(inner, _NOT_ELEMENTWISE):
            raise ConfigError(f"strategy.sync.reduce='reduce_scatter': {type(inner).__name__} does not update each element"
                              " on its own (it would see flat chunks, not the parameters' shapes); allowed with it:"
                              " 'all_reduce'")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigError("strategy.sync.reduce='reduce_scatter': the 16-mixed gradient scaler decides per rank on"
                              " shards; use precision bf16-mixed or 32, or strategy.sync.reduce='all_reduce'")
        sync_cfg = self._config.sync
        sync = ShardedGradientSynchronizer(
            self.model.named_parameters(), self.optimizers[0], shard_group=self._mesh.get_group(SHARD_DIM),
            replicate_group=self._mesh.get_group(REPLICATE_DIM), group=self._dp_group,
            first_bucket_mb=sync_cfg.first_bucket_mb, bucket_mb=sync_cfg.bucket_mb,
            check_each_collective=sync_cfg.check == "collective",
        )
        sync.bind()
        sync.attach()
        sync.recorder = self.recorder
        self._synchronizer = sync
        # gradient clipping by norm must sum over the shard group (the precision plugin would norm one shard)
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: sync.clip_grad_norm_(clip_val)
        self._wait_for_parameters_where_needed(sync)
        replicate, shard = self._mesh.size(0), self._mesh.size(1)
        state_share = f"1/{shard}" if shard > 1 else "all"
        rank_zero_info(f"static_dist: reduce_scatter over a {replicate} x {shard} mesh ({sync.plan.describe()});"
                       f" each rank keeps {state_share} of the optimizer state")

    def _wait_for_parameters_where_needed(self, sync: ShardedGradientSynchronizer) -> None:
        """Wait for a bucket's all-gather where the forward first needs it: in pre-hooks of the repeated blocks (the
        regions regional compile uses; their hooks run outside the compiled code), the rest at the step's start."""
        module = self.lightning_module
        assert module is not None
        compile_cfg = self._compile_config()
        # the blocks' pre-hooks run outside compiled code only when the blocks are compiled one by one (or eagerly)
        whole = compile_cfg.enabled and compile_cfg.regional is not True
        blocks = [] if whole else self._repeated_blocks()
        inside: set[int] = set()
        for block in blocks:
            buckets = sync.buckets_of(block.parameters())
            inside.update(id(p) for p in block.parameters())
            self._gather_hooks.append(block.register_forward_pre_hook(
                lambda *_, b=tuple(buckets): sync.wait_gather(b)))
        outside = [p for p in module.parameters() if id(p) not in inside]
        self._buckets_at_step_start = sync.buckets_of(outside) if blocks else None

    # ------------------------------------------------------------------------------------- sharded embeddings

    @property
    def embedding_sharder(self) -> Optional[EmbeddingSharder]:
        """The sharded embeddings (``None`` when ``strategy.embedding.shard`` is off or at world size 1)."""
        return self._embedding_sharder

    def _shard_embeddings(self) -> None:
        config = self._config.embedding
        if config.shard is False or self._embedding_sharder is not None:
            return
        if self._reduce_scatter():
            rank_zero_info("static_dist: reduce_scatter shards every parameter's optimizer state; strategy.embedding"
                           " sharding is off")
            return
        if self.world_size == 1:
            rank_zero_info("static_dist: world size 1, strategy.embedding.shard has nothing to shard across")
            return
        assert self.lightning_module is not None
        sharder = EmbeddingSharder(self.lightning_module, config, self._dp_group)
        weights = sharder.shard()
        if not weights:
            rank_zero_warn(
                f"static_dist: strategy.embedding.shard={config.shard!r} found no nn.Embedding"
                + (f" with at least min_rows={config.min_rows} rows" if config.shard == "auto" else "")
                + "; nothing is sharded"
            )
            return
        self._embedding_sharder = sharder
        for w in weights:
            rank_zero_info(f"static_dist: sharded {' = '.join(w.names)} ({w.rows} rows): {w.shard_rows} rows per rank")

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self._loop_patched is not None:  # validation inside fit: the ranks agree on SIGTERM here (loop.py)
            loop_patches.agree(self._loop_patched)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._embedding_sharder is not None and self._config.embedding.prefetch == "batch_start":
            self._embedding_sharder.prefetch()
        if self._trial is not None and not self._trial.decided and self._synchronizer is not None:
            assert self.lightning_module is not None
            candidate = self._trial.before_step(self.lightning_module.trainer.global_step)
            if candidate != "keep":
                use_compressor(self._synchronizer, candidate.make())
            if self._trial.decided:
                rank_zero_info(f"static_dist: compression auto: {self._trial.describe()}")

    @property
    def compression_trial(self) -> Optional[CompressionTrial]:
        """``strategy.compression.name: auto``: the trial of the candidates and, once made, its choice."""
        return self._trial

    def _resume_trial(self) -> None:
        """A checkpoint's choice (``compression.name: auto``): reduce with it from now on, with no second trial."""
        if self._trial_resume is None or self._trial is None or self._synchronizer is None:
            return  # nothing saved, or setup has not built the trial yet (it calls this again)
        saved, self._trial_resume = self._trial_resume, None
        self._trial.load_state_dict(saved)
        if not self._trial.decided:
            return
        chosen = next((c for c in self._trial.candidates if c.name == self._trial.choice), None)
        if chosen is None:  # strategy.compression.rank changed since: time the candidates again
            rank_zero_warn(f"static_dist: compression auto: the checkpoint chose {self._trial.choice!r}, not among this"
                           f" run's candidates ({', '.join(c.name for c in self._trial.candidates)}): timing them again")
            self._trial.choice = None
            return
        use_compressor(self._synchronizer, chosen.make())

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.sharded_sync is not None:
            self.sharded_sync.wait_gather()  # the parameters are current only once their gathers are done
        state = super().lightning_module_state_dict()
        if self._embedding_sharder is not None:
            state = self._embedding_sharder.full_state_dict(state)  # collective: every rank gets here
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._embedding_sharder is not None:
            checkpoint = {**checkpoint, "state_dict": self._embedding_sharder.shard_state_dict(checkpoint["state_dict"])}
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.sharded_sync is not None:
            self.sharded_sync.refresh_chunks()  # the optimizer updates the chunks: give them the loaded weights

    def _sharded_checkpoints(self) -> bool:
        return self.sharded_sync is not None and self._config.checkpoint.format != "full"

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._sharded_checkpoints():
            assert self.sharded_sync is not None
            return {_PIECES_KEY: self.sharded_sync.piece_tensors()}  # this rank's own ranges: nothing is gathered
        if self.sharded_sync is not None:
            return self.sharded_sync.full_optimizer_state()  # collective: the form any world size can load
        state = super().optimizer_state(optimizer)
        if self._embedding_sharder is not None:
            inner = unwrap_optimizer(optimizer)
            state = self._embedding_sharder.full_optimizer_state(inner, state)  # collective
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        sync = self.sharded_sync
        if sync is not None:
            state = states[0]
            if isinstance(state, ShardedOptimizerState):  # read only the ranges this rank's pieces cover
                sync.load_optimizer_state(state.pieces(sync.wanted_ranges()), state.param_groups)
            else:
                sync.load_full_optimizer_state(state)
            _optimizers_to_device(self.optimizers, self.root_device)
            return
        if any(isinstance(state, ShardedOptimizerState) for state in states):  # an unsharded run resumes from one
            states = [s.full() if isinstance(s, ShardedOptimizerState) else s for s in states]
            checkpoint = {**checkpoint, "optimizer_states": states}
        if self._embedding_sharder is not None:
            states = [
                self._embedding_sharder.shard_optimizer_state(opt, state)
                for opt, state in zip(self.optimizers, checkpoint["optimizer_states"])
            ]
            checkpoint = {**checkpoint, "optimizer_states": states}
        super().load_optimizer_state_dict(checkpoint)

    # -------------------------------------------------------------------------------------------- checkpoints

    @property
    def compressing_reducer(self) -> Optional[CompressingReducer]:
        """The synchroniser's compressing reducer (``None`` without compression or at world size 1)."""
        return compressing_reducer_of(self._synchronizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if self._synchronizer is not None:
            self._synchronizer.check_pending_rounds()  # no checkpoint of a step whose ranks were out of step
        if self._sharded_checkpoints():
            self._save_sharded(checkpoint, os.fspath(filepath))
            return
        # every rank gets here (Lightning writes on rank 0 only): gather each rank's compression state, so that a
        # resumed rank gets its own error-feedback residual back, not rank 0's
        reducer = self.compressing_reducer
        if reducer is not None:
            saved = gather_compression_state(reducer, self._dp_group, self.world_size)  # to rank 0 only (it writes)
            if saved is not None:
                checkpoint[_COMPRESSION_KEY] = saved
        if self._trial is not None:
            checkpoint[_TRIAL_KEY] = self._trial.state_dict()  # the same on every rank
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _save_sharded(self, checkpoint: dict[str, Any], path: str) -> None:
        """Every rank writes its own optimizer ranges into one ``torch.distributed.checkpoint`` directory."""
        sync = self.sharded_sync
        assert sync is not None
        rest = dict(checkpoint)
        model_state = rest.pop("state_dict", {})
        states = rest.pop("optimizer_states", [])
        pieces = states[0][_PIECES_KEY] if states else {}
        meta = {"lightning": rest, "param_groups": sync.full_param_groups(), "shapes": sync.original_shapes(),
                "has_optimizer": bool(states)}
        with waiting_in("writing the sharded checkpoint"):
            save_sharded(path, meta, model_state, pieces, self.global_rank)
        self._last_sharded_checkpoint = path

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if is_sharded_checkpoint(checkpoint_path):
            return load_sharded(os.fspath(checkpoint_path))  # collective: every rank reads the model's tensors
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._compression_resume = checkpoint.pop(_COMPRESSION_KEY, None)
        self._trial_resume = checkpoint.pop(_TRIAL_KEY, None)
        self._resume_trial()  # setup ran first: choose the compressor before its state is restored
        if self.compressing_reducer is not None:
            self._restore_compression_state()
        return checkpoint

    def _restore_compression_state(self) -> None:
        saved, self._compression_resume = self._compression_resume, None
        reducer = self.compressing_reducer
        if saved is None or reducer is None:
            return
        restore_compression_state(reducer, saved, self.global_rank, self.world_size, self.root_device)

    @override
    def model_to_device(self) -> None:
        log.debug(f"{self.__class__.__name__}: moving model to device [{self.root_device}]...")
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------ training step

    def attach_recorder(self, recorder: StepRecorder) -> None:
        """Let the overlap monitor's recorder see compute phases and collectives (the monitor calls this)."""
        self.recorder = recorder
        if self._synchronizer is not None:
            self._synchronizer.recorder = recorder

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._buffers_to_broadcast:
            broadcast_buffers(self._buffers_to_broadcast, self._dp_group)
        if self._embedding_sharder is not None:
            with waiting_in("the all-gather of the sharded embeddings"):
                self._embedding_sharder.materialize()  # the only wait for the gather issued earlier
        if self.sharded_sync is not None:
            self.sharded_sync.wait_gather(self._buckets_at_step_start)  # the blocks' buckets: in their pre-hooks
        if self.recorder is None:
            return super().training_step(*args, **kwargs)
        self.recorder.begin("forward")
        output = super().training_step(*args, **kwargs)
        self.recorder.end("forward")
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.sharded_sync is not None:
            self.sharded_sync.wait_gather()
        return super().validation_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._graph_sync is not None and not self._graphs_checked:
            # before the first backward runs the collectives compiled into it: every rank compiled the same graphs
            try:
                self._check_graphs_once()
            except RankMismatchError as err:
                raise RankMismatchError(
                    "static_dist: strategy.sync.mode=graph needs every rank to compile the same graphs (the gradient"
                    f" collectives are inside them): {err}. A model whose ranks use different parameters needs"
                    " strategy.sync.mode=hooks"
                ) from None
        if self.recorder is not None:
            self.recorder.begin("backward")

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.sharded_sync is not None:
            self.sharded_sync.start_gather()  # overlapped with whatever runs until the next forward needs them
        if self._embedding_sharder is not None:
            self._embedding_sharder.release()  # the shards changed: any gathered weight is stale
            if self._config.embedding.prefetch == "after_optimizer":
                self._embedding_sharder.prefetch()
        if self._trial is not None:
            self._trial.after_step()
        if self.recorder is not None:
            self.recorder.end("optimizer")
        return output

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # gradient clipping, the AMP scaler and `on_before_optimizer_step` all run after this: they see averages
        if self.recorder is not None:
            self.recorder.end("backward")  # before the wait: waiting is not compute
        self._synchronize_gradients()
        if self._config.sync.nonfinite != "off" and not self._accumulating:
            self._check_nonfinite(self._config.sync.nonfinite)
        sharder = self._embedding_sharder
        if sharder is not None and not (self._accumulating and self._config.embedding.gather_once_per_step):
            sharder.release()  # the full weight lives from the gather to the end of the (synchronised) backward
            if self.recorder is not None:
                self.recorder.note("embed_gather_ms", 1e3 * sharder.timing.gather_s)
                self.recorder.note("embed_gather_exposed_ms", 1e3 * sharder.timing.exposed_s)
        if self.recorder is not None:
            self.recorder.begin("optimizer")

    def _check_nonfinite(self, policy: str) -> None:
        """``strategy.sync.nonfinite``: one collective flag, so every rank warns, skips or raises together."""
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return  # the gradient scaler skips non-finite steps itself
        assert self.lightning_module is not None
        if self.sharded_sync is not None:  # the averaged gradients live in the shards
            named = [(f"a shard of {' / '.join(piece.names)}", piece.param)
                     for piece in self.sharded_sync.pieces(optimized_only=False) if piece.param.grad is not None]
        else:
            named = [(n, p) for n, p in self.lightning_module.named_parameters() if p.grad is not None]
        # a rank with no gradient here (its chunks all padding) still takes part in the flag's all-reduce
        finite = torch.isfinite(torch.stack(torch._foreach_norm([p.grad for _, p in named]))) if named else None
        flag = torch.zeros(1, dtype=torch.float32, device=self.root_device)
        if finite is not None:
            flag += (~finite).any().to(torch.float32)
        if self.world_size > 1:  # a shard's gradient is only on its owner: decide together
            torch.distributed.all_reduce(flag, group=self._dp_group)
        if flag.item() == 0:
            return
        bad = [n for (n, _), ok in zip(named, finite.tolist()) if not ok] if finite is not None else []
        first = bad[0] if bad else "a parameter sharded on another rank"
        step = self.lightning_module.trainer.global_step
        self.nonfinite_steps += 1
        if policy == "error":
            raise FloatingPointError(
                f"static_dist: non-finite gradient at step {step}, first offending parameter {first!r}"
                f" ({len(bad)} on this rank; strategy.sync.nonfinite=error)"
            )
        if policy == "skip":
            for _, p in named:
                p.grad = None  # the optimizer then updates nothing (no weight decay either) on every rank
        rank_zero_warn(
            f"static_dist: non-finite gradient at step {step} (first: {first!r}); "
            + ("optimizer step skipped on every rank" if policy == "skip" else "the optimizer step goes ahead")
            + f" (strategy.sync.nonfinite={policy})"
        )

    def _synchronize_gradients(self) -> None:
        if self._graph_sync is not None:
            self._graph_sync.check_trainable()
            self._graph_sync.rounds += 1
        elif self._synchronizer is not None:
            self._check_graphs_once()
            self._synchronizer.finish_if_pending()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (Lightning enters this on non-boundary micro-batches)."""
        self._accumulating = True
        try:
            if self._synchronizer is None:  # (graph mode averages every micro-batch inside its backward graph)
                yield None
                return
            with self._synchronizer.no_sync():
                yield None
        finally:
            self._accumulating = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        # forget the round without waiting: a peer that failed may never join the collectives in flight
        mark_run_failed()  # the exit-time teardown must not wait for peers that may be gone
        self._failed = True
        if self.world_size > 1 and is_collective_failure(exception):
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            step = trainer.global_step if trainer is not None else -1
            self.failure = diagnose(exception, self.global_rank, self.world_size, step)
            print(self.failure, file=sys.stderr, flush=True)
            if isinstance(self._launcher, _SubprocessScriptLauncher):
                # Lightning kills the other ranks only on Ctrl-C; a stuck rank would outlive the job
                self._launcher.kill(signal.SIGKILL)
        if self._synchronizer is not None:
            self._synchronizer.abandon_round()

    # ------------------------------------------------------------------------------------------ collectives

    def host_max(self, values: Sequence[float]) -> list[float]:
        """The maximum over ranks of figures held on the host, through the strategy's host (Gloo) group: no device
        tensor, so no GPU synchronisation (a device all-reduce read back with ``.item()`` waits for the GPU's queue).
        A collective: every rank calls it.

        Example::

            breaks, recompiles = strategy.host_max([len(report.graph_breaks), len(report.recompiles)])
        """
        if self.world_size == 1:
            return [float(v) for v in values]
        if self._host_group is None:  # no Gloo group could be made here (loop.host_group warned): through the device
            flat = torch.tensor(values, dtype=torch.float64, device=self.root_device)
            torch.distributed.all_reduce(flat, op=ReduceOp.MAX)
            return flat.tolist()
        flat = torch.tensor(values, dtype=torch.float64)
        with waiting_in("the maximum over ranks of host figures (strategy.host_max)"):
            torch.distributed.all_reduce(flat, op=ReduceOp.MAX, group=self._host_group)
        return flat.tolist()


    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if "nccl" in torch.distributed.get_backend() and self.root_device.type == "cuda":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        torch.distributed.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        """Reduce a tensor over all processes (``"mean"`` by default, ``"sum"``, or a ``ReduceOp``).

        Non-tensors are returned unchanged, as in every Lightning strategy.
        """
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -------------------------------------------------------------------------------------------- teardown

    @override
    def teardown(self) -> None:
        log.debug(f"{self.__class__.__name__}: tearing down strategy")
        mismatch: Optional[RankMismatchError] = None
        if self._synchronizer is not None and not self._failed:
            try:  # the last rounds' step check, not read yet (no collective: it cannot wait for a peer)
                self._synchronizer.check_pending_rounds()
            except RankMismatchError as err:  # out of step: skip the collective parts of teardown, then raise
                self._failed, mismatch = True, err
        for hook in self._gather_hooks:
            hook.remove()
        self._gather_hooks = []
        if self.sharded_sync is not None:
            self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)  # the plugin's own clipping again
            if not self._failed:
                self.sharded_sync.release()  # whole parameters and a full-form optimizer after fit (collective)
                self._consolidate_last_checkpoint()
        if self._synchronizer is not None:
            self._synchronizer.detach()  # frees its buffers; the plan and the counters stay readable
        if self._graph_sync is not None:
            self._graph_sync.detach()
            self._graph_sync = None
        if self._embedding_sharder is not None:
            if self._failed:
                rank_zero_warn("static_dist: training failed; the sharded embeddings stay sharded in this process")
            else:
                self._embedding_sharder.unshard()  # a usable model after fit (collective: every rank tears down)
            self._embedding_sharder = None
        if self._loop_patched is not None:
            loop_patches.uninstall(self._loop_patched, drain=not self._failed)
            self._loop_patched = None
        if self._watchdog is not None:
            self._watchdog.stop(clean=not self._failed)
            self._watchdog = None
        self._trial = None  # a later fit builds its own (and resumes the checkpoint's choice into it)
        self._failed = False
        self._buffers_to_broadcast = []
        self.requested_backend = None
        self.recorder = None

        super().teardown()
        if mismatch is not None:
            raise mismatch

    def _consolidate_last_checkpoint(self) -> None:
        """``strategy.checkpoint.consolidate_at_end``: the last sharded checkpoint becomes a plain file, in place."""
        path, self._last_sharded_checkpoint = self._last_sharded_checkpoint, None
        if path is None or not self._config.checkpoint.consolidate_at_end:
            return
        if self.is_global_zero and is_sharded_checkpoint(path):
            consolidate(path, path)
            rank_zero_info(f"static_dist: consolidated the last sharded checkpoint into a plain file: {path}")
        self.barrier()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, "Static data-parallel strategy (explicit bucketed collectives)")
