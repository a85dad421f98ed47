"""``StaticDistStrategy``: the Lightning lifecycle of data-parallel training without the DDP wrapper.

The strategy owns the hooks Lightning calls and checkpoint files; its base,
:class:`~lightning_static_dist.processes.data_parallel.DataParallelProcesses`, owns the processes, the process group, the
``DeviceMesh`` and the collectives. Each feature's part of the hooks is a step participant
(:mod:`~lightning_static_dist.participants`): a hook calls one phase on every participant, in the one fixed order
:class:`~lightning_static_dist.participants.Participants` lists. The mechanics live below them:
:mod:`~lightning_static_dist.sync` (bucketed gradient collectives), :mod:`~lightning_static_dist.compile`,
:mod:`~lightning_static_dist.config` (validation).

One training step, as Lightning drives it::

    training_step      buffers broadcast from rank 0 (``sync.broadcast_buffers``), then the user's forward
    backward           post-accumulate-grad hooks fill buckets; full buckets launch async collectives (compiled
                       as one graph, the step is cut at the buckets: each piece's gradients are ready together)
    post_backward      GradientSynchronizer.finish(): launch the rest, make the stream wait, no host wait
                       (sync.mode=graph: the collectives are inside the compiled backward graph instead)
    optimizer step     the precision plugin unscales / clips the *synchronised* gradients, then steps
                       (sync.optimizer_overlap: each bucket waited for and stepped in turn, the waits left to here)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, TypeVar, Union

import torch
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.checkpoint import (
    CheckpointConfig,
    ShardedOptimizerState,
    agree_on,
    check_lightning_checkpoint,
    is_sharded_checkpoint,
    load_sharded,
    save_full,
)
from lightning_static_dist.compat import allow_compiled_models_in_trainer
from lightning_static_dist.config import ConfigError
from lightning_static_dist.config.lightning_cli import parse_errors_of
from lightning_static_dist.compile import CompileReport
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.auto import CompressionTrial
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.ddp_arguments import DDPArguments, yield_to
from lightning_static_dist.embedding import EmbeddingConfig, EmbeddingSharder
from lightning_static_dist.processes.fingerprint import RankMismatchError
from lightning_static_dist.processes.launcher import register_names
from lightning_static_dist.mesh import MeshConfig
from lightning_static_dist.offer import StaticDistOffer
from lightning_static_dist.participants import Participants
from lightning_static_dist.participants.offer import ParticipantsOffer
from lightning_static_dist.processes.data_parallel import DataParallelProcesses
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.strategy_config import StrategyConfig
from lightning_static_dist.sync import RoundSync
from lightning_static_dist.sync.broadcast import start_from_rank_zero
from lightning_static_dist.sync.config import SyncConfig
from lightning_static_dist.sync.optimizer_overlap import OverlapChoice
from lightning_static_dist.sync.sharded import ShardedGradientSynchronizer

log = logging.getLogger(__name__)
T = TypeVar("T")


def refuse_saves_on_exception(callbacks: list[Any], world_size: int) -> None:
    """``ModelCheckpoint(save_on_exception=True)`` with more than one rank: a :class:`ConfigError`. An exception
    reaches one rank, and that rank alone would start the save, a collective here (the state's gather, the write's
    agreement, Lightning's barrier): it would wait for peers that never come. A SIGTERM stop saves by itself."""
    if world_size < 2:
        return
    for callback in callbacks:
        if getattr(callback, "save_on_exception", False):
            raise ConfigError(f"{type(callback).__name__}(save_on_exception=True): under static_dist a save is a"
                              " collective, and an exception reaches one rank, whose save would wait for the others;"
                              " allowed: save_on_exception=False (a SIGTERM stop saves a checkpoint by itself)")


class TrainerContext:
    """The :class:`~lightning_static_dist.participants.StepContext` of a Lightning ``Trainer``: what the step
    participants may know of it (fitting or not, the global step, the training loop, its callbacks).

    Example::

        context = TrainerContext(trainer)
        context.fitting, context.global_step     # (True, 0) at the start of a fit
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    @property
    def fitting(self) -> bool:
        return self._trainer.state.fn == TrainerFn.FITTING

    @property
    def global_step(self) -> int:
        return self._trainer.global_step

    @property
    def training(self) -> bool:
        return self._trainer.training

    def add_callback(self, callback: pl.Callback) -> None:
        if not any(isinstance(c, type(callback)) for c in self._trainer.callbacks):
            self._trainer.callbacks.append(callback)

    @property
    def micro_batches(self) -> int:
        return self._trainer.accumulate_grad_batches

    @property
    def gradient_readers(self) -> list[str]:
        """Clipping, the hooks Lightning runs between backward and the step where the module or a callback
        overrides them (they may read any gradient), and the module's own ``optimizer_step`` / ``backward`` where
        overridden (either may run a backward without a step after it, or read the gradients before the step)."""
        trainer = self._trainer
        found = []
        if trainer.gradient_clip_val:  # (None or 0: no clipping)
            found.append(f"gradient clipping (trainer.gradient_clip_val={trainer.gradient_clip_val}) needs every"
                         " bucket's average first")
        module = trainer.lightning_module
        for hook in ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"):
            owners = [module] if is_overridden(hook, module, parent=pl.LightningModule) else []
            owners += [c for c in trainer.callbacks if is_overridden(hook, c, parent=pl.Callback)]
            found.extend(f"{type(owner).__name__}.{hook} is overridden and may read the gradients" for owner in owners)
        found.extend(f"{type(module).__name__}.{hook} is overridden and may run a backward without stepping, or read"
                     " the gradients before the step" for hook in ("optimizer_step", "backward")
                     if is_overridden(hook, module, parent=pl.LightningModule))
        return found

    @property
    def trainer_loop(self) -> pl.Trainer:
        return self._trainer


class StaticDistStrategy(DataParallelProcesses):
    """Data-parallel training with explicit, bucketed gradient collectives over a ``DeviceMesh``.

    Registered as ``"static_dist"`` (processes started like ``ddp``), ``"static_dist_spawn"`` (``spawn``, for tests
    and scripts without a ``__main__`` guard problem) and ``"static_dist_notebook"`` (``fork``) when
    ``lightning_static_dist`` is imported. Each keyword section takes a plain dict or its dataclass; omitted sections
    take their defaults. Bad values raise :class:`~lightning_static_dist.config.ConfigError` here, before any
    process starts.

    Args:
        compile: ``strategy.compile`` (:class:`~lightning_static_dist.compile.config.CompileConfig`).
        mesh: ``strategy.mesh`` (:class:`~lightning_static_dist.mesh.MeshConfig`).
        sync: ``strategy.sync`` (:class:`~lightning_static_dist.sync.config.SyncConfig`).
        compression: ``strategy.compression`` (:class:`~lightning_static_dist.compression.config.CompressionConfig`).
        embedding: ``strategy.embedding`` (:class:`~lightning_static_dist.embedding.EmbeddingConfig`).
        checkpoint: ``strategy.checkpoint`` (:class:`~lightning_static_dist.checkpoint.CheckpointConfig`).
        simulate: ``strategy.simulate`` (:class:`~lightning_static_dist.simulate.config.SimulateConfig`): this one
            process as rank 0 of N identical ranks (``Trainer(devices=1)``), a dry run of an N-rank configuration.
        timeout_s: timeout of every collective, in seconds (default 1800; or ``timeout``, DDP's ``timedelta``).
        process_group_backend: a backend registered with ``torch.distributed`` (``"nccl"``, ``"gloo"``, ``"xccl"``
            ...) or ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``), checked when the process group starts (as
            DDP does: a backend registered after the strategy was built counts); by default NCCL on CUDA and Gloo
            on CPU.
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

    Each hook calls one phase on every step participant, in the order
    :class:`~lightning_static_dist.participants.Participants` documents (the buffers before the embeddings' gather
    before the recorder's forward; the gradients synchronised, then checked, then the embeddings released).
    ``after_backward`` (the recorder ends backward) runs before ``finish_gradients`` (the waits), so the recorder
    never counts waiting as compute.

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
        simulate: Union[SimulateConfig, dict[str, Any], None] = None,
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
        ddp = DDPArguments(timeout, find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb,
                           broadcast_buffers, ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper, model_averaging_period)
        sections = dict(compile=compile, mesh=mesh, sync=sync, compression=compression, embedding=embedding,
                        checkpoint=checkpoint, simulate=simulate)
        config, notes = StrategyConfig.from_arguments(ddp, sections, timeout_s, start_method)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
                         config=config, start_method=start_method, process_group_backend=process_group_backend,
                         num_nodes=num_nodes)
        for note in notes:
            rank_zero_info(note)
        # Lightning's compile check, widened for this strategy only (once per process; others keep the original)
        allow_compiled_models_in_trainer()
        self._accumulating = False
        self._resuming_from: Optional[str] = None  # the checkpoint being loaded, for the line a damaged one gets
        self._parts = Participants(self, failed=self.has_failed)
        self._offer = ParticipantsOffer(self._parts, self, host_max=self.host_max)
        self._context: Optional[TrainerContext] = None
        self._layers_synced = False  # ``Trainer(sync_batchnorm=True)`` applied to the model in setup
        log.debug(f"{self.__class__.__name__}: initialised with {self._config}")

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

    # ------------------------------------------------------------------------------- what the participants hold

    @property
    def context(self) -> Optional[TrainerContext]:
        """What the step participants know of the trainer (set when a stage's setup begins)."""
        return self._context

    @property
    def offer(self) -> StaticDistOffer:
        """What the strategy offers its callbacks (:class:`~lightning_static_dist.offer.StaticDistOffer`; a callback
        gets it with :func:`~lightning_static_dist.offer.offer_of`). An object of its own, not the strategy: the
        callbacks' contract is the protocol's members and nothing else of a Lightning strategy, and a change of the
        reducer goes through its one owner (``strategy.compression``'s participant)."""
        return self._offer

    @property
    def synchronizer(self) -> Optional[RoundSync]:
        """The gradient synchroniser whose rounds run after each backward while fitting (with ``reduce_scatter`` the
        sharded one; ``None`` before ``setup``, outside ``fit``, on one rank and with ``sync.mode: graph``)."""
        return self._parts.gradients.synchronizer

    @property
    def sharded_sync(self) -> Optional[ShardedGradientSynchronizer]:
        """With ``sync.reduce: reduce_scatter`` while fitting: the synchroniser holding this rank's shards."""
        return self._parts.gradients.sharded_sync

    @property
    def embedding_sharder(self) -> Optional[EmbeddingSharder]:
        """The sharded embeddings (``None`` when ``strategy.embedding.shard`` is off or at world size 1)."""
        return self._parts.embeddings.sharder

    @property
    def optimizer_overlap(self) -> Optional[OverlapChoice]:
        """``strategy.sync.optimizer_overlap`` as resolved for this fit, and why (``None`` where nothing is averaged)."""
        return self._parts.overlap.choice

    @property
    def schedule_trial(self) -> Optional[CompressionTrial]:
        """``strategy.sync.schedule: auto``: the trial of the two schedules and, once made, its choice."""
        return self._parts.schedule.trial

    @property
    def compile_report(self) -> Optional[CompileReport]:
        """What static compilation did on this rank (``None`` when the model is not compiled)."""
        return self._parts.compile.report

    def adopt_compiled_model(self, dynamo_ctx: Any) -> None:
        """``trainer.fit(torch.compile(model))``: Lightning's compile check (widened by
        :func:`~lightning_static_dist.compat.allow_compiled_models_in_trainer`) hands over the user's ``torch.compile``
        context and takes the compiled model apart; the strategy compiles it its own way, with the user's backend."""
        self._parts.compile.adopt(dynamo_ctx)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        for participant in self._parts.ordered:
            participant.setup_distributed()

    # ------------------------------------------------------------------------------------------------- setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # a strategy LightningCLI built: a value refused only here, where the callbacks, the optimizers and the model
        # are known (save_on_exception, reduce_scatter's one optimizer ...), ends the command in one line too
        with parse_errors_of(self):
            self._setup(trainer)

    def _setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        refuse_saves_on_exception(trainer.callbacks, self.world_size)
        self.accelerator.setup(trainer)
        assert self.model is not None
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
            self._layers_synced = True  # (reverted in teardown, as Lightning's DDP does)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        start_from_rank_zero(self.model, self.dp_group)
        context = self._context = TrainerContext(trainer)
        for participant in self._parts.ordered:
            participant.before_optimizers(context)  # the embeddings sharded: the optimizer must hold the shards
        if context.fitting:
            self.setup_optimizers(trainer)
        for participant in self._parts.ordered:
            participant.setup(context)  # the synchronisers, then compilation
        self.setup_precision_plugin()
        if context.fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        for participant in self._parts.ordered:
            participant.after_setup(context)
        self._clip_through_the_gradients()

    def _clip_through_the_gradients(self) -> None:
        """Lightning clips gradients in the precision plugin (``clip_grad_by_norm``), and a Lightning strategy has no
        clipping hook of its own. Where one rank's norm is not the model's (``reduce_scatter``: each rank holds
        shards), the plugin's method is replaced, on this plugin instance and for this fit, by the gradient
        participant's clipping over the shard group. This is the one place it is replaced; :meth:`teardown` gives the
        plugin its own method back."""
        gradients = self._parts.gradients
        if gradients.clips_by_norm:
            self.precision_plugin.clip_grad_by_norm = (  # type: ignore[method-assign]
                lambda optimizer, clip_val: gradients.clip_grad_norm_(clip_val))

    @override
    def model_to_device(self) -> None:
        log.debug(f"{self.__class__.__name__}: moving model to device [{self.root_device}]...")
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        for participant in self._parts.ordered:
            participant.process_dataloader(dataloader)
        return dataloader

    # ------------------------------------------------------------------------------------------ training step

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for participant in self._parts.ordered:
            participant.on_train_batch_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        for participant in self._parts.ordered:
            participant.before_forward()
        output = super().training_step(*args, **kwargs)
        for participant in self._parts.ordered:
            participant.after_forward()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        for participant in self._parts.ordered:
            participant.before_reading_parameters()
        return super().validation_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        for participant in self._parts.ordered:
            participant.before_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # gradient clipping, the AMP scaler and `on_before_optimizer_step` all run after this: they see averages
        for participant in self._parts.ordered:
            participant.after_backward()
        for participant in self._parts.ordered:
            participant.finish_gradients(self._accumulating)
        for participant in self._parts.ordered:
            participant.before_optimizer_step()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # (sync.optimizer_overlap: the plugin steps a stand-in that runs the closure, then steps bucket by bucket)
        output = super().optimizer_step(self._parts.optimizer_to_step(optimizer), closure, model, **kwargs)
        for participant in self._parts.ordered:
            participant.after_optimizer_step()
        return output

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        for participant in self._parts.ordered:
            participant.on_validation_end()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        for participant in self._parts.ordered:
            participant.on_train_end()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (Lightning enters this on non-boundary micro-batches)."""
        self._accumulating = True
        try:
            with ExitStack() as stack:
                for participant in self._parts.ordered:
                    stack.enter_context(participant.no_sync())
                yield None
        finally:
            self._accumulating = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # the failure recorded (and diagnosed) first
        if not self._failed:
            return  # an agreed stop (SIGTERM): every rank finished its step, nothing to abandon
        for participant in self._parts.ordered:
            participant.on_exception(exception)

    # -------------------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        for participant in self._parts.ordered:
            participant.before_reading_parameters()
        return self._parts.model_state_dict(super().lightning_module_state_dict())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._agree_on_resume(lambda: self._load_model_state(checkpoint, strict))

    def _load_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        state = self._parts.model_state_to_load(checkpoint["state_dict"])
        if state is not checkpoint["state_dict"]:
            checkpoint = {**checkpoint, "state_dict": state}
        super().load_model_state_dict(checkpoint, strict=strict)
        for participant in self._parts.ordered:
            participant.after_model_loaded()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._parts.optimizer_state(optimizer, super().optimizer_state)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._agree_on_resume(lambda: self._load_optimizer_states(checkpoint))

    def _load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        if self._parts.load_optimizer_states(checkpoint):
            return
        states = checkpoint["optimizer_states"]
        if any(isinstance(state, ShardedOptimizerState) for state in states):  # an unsharded run resumes from one
            states = [s.full() if isinstance(s, ShardedOptimizerState) else s for s in states]
            checkpoint = {**checkpoint, "optimizer_states": states}
        loaded = [self._parts.optimizer_state_to_load(opt, state) for opt, state in zip(self.optimizers, states)]
        if any(new is not old for new, old in zip(loaded, states)):
            checkpoint = {**checkpoint, "optimizer_states": loaded}
        super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Write the checkpoint (sharded: every rank its part; full: rank 0 the file, beside it as ``.tmp`` first).
        The ranks agree on the outcome: a write that fails on any rank (a full disk, no permission) raises the same
        one-line :class:`~lightning_static_dist.checkpoint.CheckpointError` on every rank, and leaves the previous
        checkpoint as it was."""
        for participant in self._parts.ordered:
            participant.check_in_step()  # no checkpoint of a step whose ranks were out of step
        if self._parts.write_checkpoint(checkpoint, filepath):
            return
        checkpoint.update(self._parts.state_dict())  # every rank gets here (Lightning writes on rank 0 only)
        agree_on(lambda: self._write_file(checkpoint, filepath, storage_options) if self.is_global_zero else None,
                 filepath, self.global_rank, group=self.host_group)

    def _write_file(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any]) -> None:
        """Rank 0's part of a full save. Lightning's own ``TorchCheckpointIO`` writes through a temporary file in
        ``/tmp`` moved into place, a copy where ``/tmp`` is another file system, which a full disk cuts short over
        the previous checkpoint: a local file is written by :func:`~lightning_static_dist.checkpoint.save_full`
        instead. A user's ``CheckpointIO``, or a remote path, is left to the plugin."""
        plugin = self.checkpoint_io
        if type(plugin) is TorchCheckpointIO and storage_options is None and isinstance(get_filesystem(filepath),
                                                                                          LocalFileSystem):
            save_full(checkpoint, os.fspath(filepath))
        else:
            plugin.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read the checkpoint on every rank, ``weights_only`` as the caller asks (``None``: torch's default, a
        weights-only load). A damaged or foreign checkpoint (truncated, a file missing, another model's) raises the
        same one-line :class:`~lightning_static_dist.checkpoint.CheckpointError` on every rank, naming the file."""
        self._resuming_from = os.fspath(checkpoint_path)
        return self._agree_on_resume(lambda: self._read_checkpoint(checkpoint_path, weights_only))

    def _read_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool]) -> dict[str, Any]:
        if is_sharded_checkpoint(checkpoint_path):  # collective: every rank reads the model's tensors
            checkpoint = load_sharded(os.fspath(checkpoint_path), weights_only=weights_only)
            check_lightning_checkpoint(checkpoint)
            return checkpoint
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        check_lightning_checkpoint(checkpoint)  # (a plain torch file: one line, not Lightning's KeyError)
        for participant in self._parts.ordered:
            participant.load_state_dict(checkpoint)  # each takes its own entries out (kept until its setup, if before)
        return checkpoint

    def _agree_on_resume(self, attempt: Callable[[], T]) -> T:
        """A part of resuming, its outcome agreed on by every rank (one line naming the checkpoint where one fails)."""
        return agree_on(attempt, self._resuming_from or "the checkpoint", self.global_rank, reading=True,
                        group=self.host_group)

    # -------------------------------------------------------------------------------------------- teardown

    @override
    def teardown(self) -> None:
        log.debug(f"{self.__class__.__name__}: tearing down strategy")
        mismatch: Optional[RankMismatchError] = None
        if not self._failed:
            try:  # the last rounds' step check, not read yet (no collective: it cannot wait for a peer)
                for participant in self._parts.ordered:
                    participant.check_in_step()
            except RankMismatchError as err:  # out of step: skip the collective parts of teardown, then raise
                self._failed, mismatch = True, err
        try:
            for participant in self._parts.ordered:
                participant.teardown(self._failed)
        finally:  # (also when the last checkpoint's consolidation fails)
            self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)  # the plugin's own clipping again
            if self._layers_synced and self._layer_sync is not None and self.model is not None:
                # the user's BatchNorm layers back, as Lightning's DDP leaves them: a later stage or another
                # Trainer must not find SyncBatchNorm (a collective in every forward) in the model
                self.model = self._layer_sync.revert(self.model)
                self._layers_synced = False

        super().teardown()  # (the processes' part reads whether this rank failed)
        self._failed = False
        if mismatch is not None:
            raise mismatch

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, "Static data-parallel strategy (explicit bucketed collectives)")
