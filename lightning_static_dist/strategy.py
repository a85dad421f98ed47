"""``StaticDistStrategy``: the Lightning lifecycle of data-parallel training without the DDP wrapper.

The strategy owns processes, the process group, the ``DeviceMesh``, placement, checkpoint files and the hooks
Lightning calls. Each feature's part of those hooks is a step participant (:mod:`~lightning_static_dist.participants`):
a hook calls one phase on every participant, in the one fixed order the class docstring lists. The mechanics live
below them: :mod:`~lightning_static_dist.mesh` (mesh shape), :mod:`~lightning_static_dist.sync` (bucketed gradient
collectives), :mod:`~lightning_static_dist.config` (validation).

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
from contextlib import ExitStack, contextmanager
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

from lightning_static_dist.checkpoint import ShardedOptimizerState, is_sharded_checkpoint, load_sharded
from lightning_static_dist.compat import allow_compiled_models_in_trainer, destroy_process_groups_at_exit, mark_run_failed
from lightning_static_dist.compile import CompileReport
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
from lightning_static_dist.engine import compressing_reducer_of, register_names, start_from_rank_zero
from lightning_static_dist.faults import diagnose, is_collective_failure, record_nccl_flight, waiting_in
from lightning_static_dist import loop as loop_patches
from lightning_static_dist.launcher import StaticDistLauncher, StaticDistSpawnLauncher
from lightning_static_dist.fingerprint import RankMismatchError
from lightning_static_dist.mesh import build_dp_mesh, resolve_mesh_shape
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants import (
    BufferBroadcast,
    CompressionState,
    EmbeddingShards,
    GraphSync,
    HookSync,
    NonfiniteCheck,
    PeerWatch,
    PhaseRecording,
    ShardedSync,
    SigtermAgreement,
    StaticCompile,
    StepParticipant,
)
from lightning_static_dist.sync import GradientSynchronizer
from lightning_static_dist.sync.graph import GraphGradientSync
from lightning_static_dist.sync.sharded import ShardedGradientSynchronizer

log = logging.getLogger(__name__)


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

    Each hook calls one phase on the step participants, in this order (a participant whose feature is off does
    nothing; at most one of the three synchronisers is active in a fit)::

        BufferBroadcast   sync.broadcast_buffers: rank 0's buffers before each training forward
        ShardedSync       sync.reduce=reduce_scatter: builds the sharded synchroniser; gathers; sharded checkpoints
        HookSync          sync.mode=hooks: builds the synchroniser; runs the rounds of either synchroniser
        GraphSync         sync.mode=graph: the averaging identity; the graph check before the first backward
        StaticCompile     compile: compiles at setup (after the synchroniser: its plan follows the graph's pieces)
        NonfiniteCheck    sync.nonfinite: after the gradients are averaged
        EmbeddingShards   embedding: shard, prefetch, gather before forward, release after backward and step
        SigtermAgreement  Lightning's SIGTERM check over the host group (loop.py)
        PeerWatch         the peer watchdog
        CompressionState  compression: the auto trial, and the compressor's state in checkpoints
        PhaseRecording    the overlap monitor's recorder: marks forward, backward and optimizer phases

    The order keeps what must come first first: the buffers before the embeddings' gather before the recorder's
    forward; the gradients synchronised, then checked, then the embeddings released; the sharded synchroniser
    released at teardown before the hook synchroniser frees its buffers; the recorder last, so that a phase it
    marks begins after the waits of the others. ``after_backward`` (the recorder ends backward) runs before
    ``finish_gradients`` (the waits), so the recorder never counts waiting as compute.

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
        self.failure: Optional[str] = None
        """One line saying which rank stopped participating, and where, after a communication failure."""
        self._accumulating = False
        self._failed = False
        self._host_group: Optional[torch.distributed.ProcessGroup] = None
        # the step participants (see the class docstring for the order and why)
        self._recording = PhaseRecording()
        self._compile = StaticCompile(self)
        self._compression = CompressionState(self)
        self._embeddings = EmbeddingShards(self, self._recording)
        self._hooks = HookSync(self, self._embeddings, self._compile, self._compression, self._recording)
        self._sharded = ShardedSync(self, self._hooks, self._compile, self._recording)
        self._graph = GraphSync(self, self._compile)
        self._nonfinite = NonfiniteCheck(self, self._sharded)
        self._participants: tuple[StepParticipant, ...] = (
            BufferBroadcast(self), self._sharded, self._hooks, self._graph, self._compile, self._nonfinite,
            self._embeddings, SigtermAgreement(self), PeerWatch(self, failed=self._has_failed), self._compression,
            self._recording,
        )
        log.debug(f"{self.__class__.__name__}: initialised with {self._config}")

    def _has_failed(self) -> bool:
        """Whether this rank is reporting a failure itself (the watchdog's thread reads it)."""
        return self._failed

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
    def is_distributed(self) -> bool:
        # Lightning asks this of strategies it does not know (sampler insertion, `self.log(sync_dist=True)`)
        return True

    # ------------------------------------------------------------------------------- what the participants hold

    @property
    def synchronizer(self) -> Optional[GradientSynchronizer]:
        """The gradient synchroniser while fitting (``None`` before ``setup``, outside ``fit`` and on one rank)."""
        return self._hooks.synchronizer

    @property
    def sharded_sync(self) -> Optional[ShardedGradientSynchronizer]:
        """With ``sync.reduce: reduce_scatter`` while fitting: the synchroniser holding this rank's shards."""
        return self._sharded.sharded_sync

    @property
    def graph_sync(self) -> Optional[GraphGradientSync]:
        """With ``sync.mode: graph`` while fitting: the averaging identity the parameters are read through."""
        return self._graph.graph_sync

    @property
    def embedding_sharder(self) -> Optional[EmbeddingSharder]:
        """The sharded embeddings (``None`` when ``strategy.embedding.shard`` is off or at world size 1)."""
        return self._embeddings.sharder

    @property
    def compression_trial(self) -> Optional[CompressionTrial]:
        """``strategy.compression.name: auto``: the trial of the candidates and, once made, its choice."""
        return self._compression.trial

    @property
    def compressing_reducer(self) -> Optional[CompressingReducer]:
        """The synchroniser's compressing reducer (``None`` without compression or at world size 1)."""
        return compressing_reducer_of(self.synchronizer)

    @property
    def compile_report(self) -> Optional[CompileReport]:
        """What static compilation did on this rank (``None`` when the model is not compiled)."""
        return self._compile.report

    @property
    def requested_backend(self) -> Optional[str]:
        """Set when ``trainer.fit(torch.compile(model))`` asked for compilation with this backend."""
        return self._compile.requested_backend

    @requested_backend.setter
    def requested_backend(self, backend: Optional[str]) -> None:
        self._compile.requested_backend = backend

    @property
    def recorder(self) -> Optional[StepRecorder]:
        """The overlap monitor's recorder, when one is attached."""
        return self._recording.recorder

    @recorder.setter
    def recorder(self, recorder: Optional[StepRecorder]) -> None:
        self._recording.recorder = recorder

    @property
    def nonfinite_steps(self) -> int:
        """Synchronised steps whose averaged gradients held NaN/Inf (with ``strategy.sync.nonfinite`` on)."""
        return self._nonfinite.steps

    @nonfinite_steps.setter
    def nonfinite_steps(self, steps: int) -> None:
        self._nonfinite.steps = steps

    def adopt_compiled_model(self, dynamo_ctx: Any) -> None:
        """``trainer.fit(torch.compile(model))``: Lightning's compile check (widened by
        :func:`~lightning_static_dist.compat.allow_compiled_models_in_trainer`) hands over the user's ``torch.compile``
        context and takes the compiled model apart; the strategy compiles it its own way, with the user's backend."""
        self._compile.adopt(dynamo_ctx)

    def attach_recorder(self, recorder: StepRecorder) -> None:
        """Let the overlap monitor's recorder see compute phases and collectives (the monitor calls this)."""
        for participant in self._participants:
            participant.attach_recorder(recorder)

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
    def dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """Every data-parallel rank: the mesh covers the world."""
        return _group.WORLD if self._mesh is not None else None

    @property
    def host_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """A Gloo group over every rank for figures held on the host (``None`` on one rank, or where none could be
        made)."""
        return self._host_group

    def reduce_scatter(self) -> bool:
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
        for participant in self._participants:
            participant.setup_distributed()

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
        start_from_rank_zero(self.model, self.dp_group)
        for participant in self._participants:
            participant.before_optimizers(trainer)  # the embeddings sharded: the optimizer must hold the shards
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        for participant in self._participants:
            participant.setup(trainer)  # the synchronisers, then compilation
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        for participant in self._participants:
            participant.after_setup(trainer)

    @override
    def model_to_device(self) -> None:
        log.debug(f"{self.__class__.__name__}: moving model to device [{self.root_device}]...")
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        for participant in self._participants:
            participant.process_dataloader(dataloader)
        return dataloader

    # ------------------------------------------------------------------------------------------ training step

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for participant in self._participants:
            participant.on_train_batch_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        for participant in self._participants:
            participant.before_forward()
        output = super().training_step(*args, **kwargs)
        for participant in self._participants:
            participant.after_forward()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        for participant in self._participants:
            participant.before_reading_parameters()
        return super().validation_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        for participant in self._participants:
            participant.before_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # gradient clipping, the AMP scaler and `on_before_optimizer_step` all run after this: they see averages
        for participant in self._participants:
            participant.after_backward()
        for participant in self._participants:
            participant.finish_gradients(self._accumulating)
        for participant in self._participants:
            participant.before_optimizer_step()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        for participant in self._participants:
            participant.after_optimizer_step()
        return output

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        for participant in self._participants:
            participant.on_validation_end()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (Lightning enters this on non-boundary micro-batches)."""
        self._accumulating = True
        try:
            with ExitStack() as stack:
                for participant in self._participants:
                    stack.enter_context(participant.no_sync())
                yield None
        finally:
            self._accumulating = False

    @override
    def on_exception(self, exception: BaseException) -> None:
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
        for participant in self._participants:
            participant.on_exception(exception)

    # -------------------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        for participant in self._participants:
            participant.before_reading_parameters()
        state = super().lightning_module_state_dict()
        for participant in self._participants:
            state = participant.model_state_dict(state)  # collective where weights are gathered
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        for participant in self._participants:
            state = participant.model_state_to_load(state)
        if state is not checkpoint["state_dict"]:
            checkpoint = {**checkpoint, "state_dict": state}
        super().load_model_state_dict(checkpoint, strict=strict)
        for participant in self._participants:
            participant.after_model_loaded()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        for participant in self._participants:
            own = participant.optimizer_state(optimizer)
            if own is not None:
                return own
        state = super().optimizer_state(optimizer)
        for participant in self._participants:
            state = participant.optimizer_state_to_save(optimizer, state)
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if any(participant.load_optimizer_states(checkpoint) for participant in self._participants):
            return
        states = checkpoint["optimizer_states"]
        if any(isinstance(state, ShardedOptimizerState) for state in states):  # an unsharded run resumes from one
            states = [s.full() if isinstance(s, ShardedOptimizerState) else s for s in states]
            checkpoint = {**checkpoint, "optimizer_states": states}
        loaded = [self._optimizer_state_to_load(opt, state) for opt, state in zip(self.optimizers, states)]
        if any(new is not old for new, old in zip(loaded, states)):
            checkpoint = {**checkpoint, "optimizer_states": loaded}
        super().load_optimizer_state_dict(checkpoint)

    def _optimizer_state_to_load(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        for participant in self._participants:
            state = participant.optimizer_state_to_load(optimizer, state)
        return state

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        for participant in self._participants:
            participant.check_in_step()  # no checkpoint of a step whose ranks were out of step
        if any(participant.write_checkpoint(checkpoint, filepath) for participant in self._participants):
            return
        for participant in self._participants:
            checkpoint.update(participant.state_dict())  # every rank gets here (Lightning writes on rank 0 only)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if is_sharded_checkpoint(checkpoint_path):
            return load_sharded(os.fspath(checkpoint_path))  # collective: every rank reads the model's tensors
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        for participant in self._participants:
            participant.load_state_dict(checkpoint)  # setup ran first: each takes its own entries out
        return checkpoint

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
        # where no Gloo group could be made (loop.host_group warned), through the default group and the device
        device = torch.device("cpu") if self._host_group is not None else self.root_device
        flat = torch.tensor(values, dtype=torch.float64, device=device)
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
        if not self._failed:
            try:  # the last rounds' step check, not read yet (no collective: it cannot wait for a peer)
                for participant in self._participants:
                    participant.check_in_step()
            except RankMismatchError as err:  # out of step: skip the collective parts of teardown, then raise
                self._failed, mismatch = True, err
        for participant in self._participants:
            participant.teardown(self._failed)
        self._failed = False

        super().teardown()
        if mismatch is not None:
            raise mismatch

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, "Static data-parallel strategy (explicit bucketed collectives)")
