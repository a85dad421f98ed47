"""``StaticDistStrategy``: the Lightning lifecycle of data-parallel training without the DDP wrapper.

The strategy owns the hooks Lightning calls and checkpoint files; its base,
:class:`~lightning_static_dist.processes.data_parallel.DataParallelProcesses`, owns the processes, groups and
collectives. Each hook is one call on the step's phases (:class:`~lightning_static_dist.participants.StepPhases`),
which run every feature's participant in their one order; ``docs/architecture.md`` walks through one step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, TypeVar, Union

import torch
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.checkpoint import CheckpointConfig, agree_on
from lightning_static_dist import trainer_checkpoints
from lightning_static_dist.compat import allow_compiled_models_in_trainer
from lightning_static_dist.config.lightning_cli import parse_errors_of
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.embedding import EmbeddingConfig
from lightning_static_dist.agreement.fingerprint import RankMismatchError
from lightning_static_dist.processes.launcher import register_names
from lightning_static_dist.mesh import MeshConfig
from lightning_static_dist.offer import StaticDistOffer
from lightning_static_dist.participants import Participants, StepPhases
from lightning_static_dist.participants.roster_offer import RosterOffer
from lightning_static_dist.processes.data_parallel import DataParallelProcesses
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.trainer_context import TrainerContext, refuse_saves_on_exception
from lightning_static_dist.sync.broadcast import start_from_rank_zero
from lightning_static_dist.sync.config import SyncConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class StaticDistStrategy(DataParallelProcesses):
    """Data-parallel training with explicit, bucketed gradient collectives over a ``DeviceMesh``.

    Registered as ``"static_dist"`` (started like ``ddp``), ``"static_dist_spawn"`` and ``"static_dist_notebook"``
    (``fork``). Each section is a dict or its dataclass, omitted: its defaults; a bad value is a
    :class:`~lightning_static_dist.config.ConfigError` here, before any process starts.

    Args:
        compile, mesh, sync, compression, embedding, checkpoint, simulate: the ``strategy`` block's sections
            (``docs/configuration.md``); ``simulate``: this process as rank 0 of N identical ranks (``devices=1``).
        timeout_s: timeout of every collective, in seconds (default 1800).
        process_group_backend: a registered ``torch.distributed`` backend, or ``device:backend`` pairs, checked when
            the process group starts; by default NCCL on CUDA and Gloo on CPU.
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"``, ``"fork"``, ``"forkserver"``.
        num_nodes, timeout ... model_averaging_period: Lightning ``DDPStrategy``'s arguments with DDP's meaning, or
            refused in one line naming what to use (``lightning_static_dist/ddp_arguments.py``).

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
        config, notes = StrategyConfig.from_keywords(locals())  # (the keywords by name: the signature stays explicit)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
                         config=config, start_method=start_method, process_group_backend=process_group_backend,
                         num_nodes=num_nodes)
        for note in notes:
            rank_zero_info(note)
        # Lightning's compile check, widened for this strategy only (once per process; others keep the original)
        allow_compiled_models_in_trainer()
        self._resuming_from: Optional[str] = None  # the checkpoint being loaded, for the line a damaged one gets
        self._parts = Participants(self, failed=self.has_failed)
        self._phases = StepPhases(self._parts)
        self._offer = RosterOffer(self._parts, self, host_max=self.host_max)
        self._context: Optional[TrainerContext] = None
        self._layers_synced = False  # ``Trainer(sync_batchnorm=True)`` applied to the model in setup
        log.debug(f"{self.__class__.__name__}: initialised with {self.config}")

    @classmethod
    def from_config(cls, config: StrategyConfig, **kwargs: Any) -> StaticDistStrategy:
        """Build the strategy from a validated ``strategy`` block; ``kwargs`` win over it (a DDP argument over the
        key it stands for; two for one key: a :class:`~lightning_static_dist.config.ConfigError` naming it).

        Example::

            strategy = StaticDistStrategy.from_config(load_run_config("charlm_cpu").strategy, start_method="spawn")
        """
        return cls(**config.as_keywords(kwargs))

    # ------------------------------------------------------------------------------- what the participants hold

    @property
    def context(self) -> Optional[TrainerContext]:
        """What the step participants know of the trainer (set when a stage's setup begins)."""
        return self._context

    @property
    def offer(self) -> StaticDistOffer:
        """What the strategy offers its callbacks (:class:`~lightning_static_dist.offer.StaticDistOffer`, through
        :func:`~lightning_static_dist.offer.offer_of`): the protocol's members, nothing else of the strategy."""
        return self._offer

    def adopt_compiled_model(self, dynamo_ctx: Any) -> None:
        """``trainer.fit(torch.compile(model))``: the user's ``torch.compile`` context, handed over by Lightning's
        compile check (``compat.py``); the strategy compiles the model its own way, with the user's backend."""
        self._parts.compile.adopt(dynamo_ctx)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._phases.setup_distributed()

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

        def build_optimizers() -> None:
            if context.fitting:
                self.setup_optimizers(trainer)

        def prepare() -> None:
            self.setup_precision_plugin()
            if context.fitting:
                _optimizers_to_device(self.optimizers, self.root_device)

        self._phases.set_up(context, build_optimizers, prepare)
        self._clip_through_the_gradients()

    def _clip_through_the_gradients(self) -> None:
        """Where one rank's norm is not the model's (``reduce_scatter``: shards), this plugin instance's
        ``clip_grad_by_norm`` (Lightning clips there; a strategy has no clipping hook) is the gradient participant's
        clipping over the shard group, until :meth:`teardown` gives the plugin its own method back."""
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
        self._phases.process_dataloader(dataloader)
        return dataloader

    # ------------------------------------------------------------------------------------------ training step

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._phases.on_train_batch_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._phases.before_forward()
        output = super().training_step(*args, **kwargs)
        self._phases.after_forward()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._phases.before_reading_parameters()
        return super().validation_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._phases.before_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # gradient clipping, the AMP scaler and `on_before_optimizer_step` all run after this: they see averages
        self._phases.end_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # (sync.optimizer_overlap: the plugin steps a stand-in that runs the closure, then steps bucket by bucket)
        output = super().optimizer_step(self._phases.optimizer_to_step(optimizer), closure, model, **kwargs)
        self._phases.after_optimizer_step()
        return output

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._phases.on_validation_end()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._phases.on_train_end()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (Lightning enters this on non-boundary micro-batches)."""
        with self._phases.no_sync():
            yield None

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # the failure recorded (and diagnosed) first
        if not self._failed:
            return  # an agreed stop (SIGTERM): every rank finished its step, nothing to abandon
        self._phases.on_exception(exception)

    # -------------------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._phases.model_state_dict(super().lightning_module_state_dict)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._agree_on_resume(lambda: self._load_model_state(checkpoint, strict))

    def _load_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        super().load_model_state_dict(trainer_checkpoints.model_state_to_load(self._parts, checkpoint), strict=strict)
        self._phases.after_model_loaded()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._parts.optimizer_state(optimizer, super().optimizer_state)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._agree_on_resume(lambda: self._load_optimizer_states(checkpoint))

    def _load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        to_load = trainer_checkpoints.optimizer_states_to_load(self._parts, self.optimizers, checkpoint)
        if to_load is not None:
            super().load_optimizer_state_dict(to_load)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write the checkpoint (sharded: every rank its part; full: rank 0 the file). A write that fails on any rank
        raises the same one-line ``CheckpointError`` on every rank, and leaves the previous checkpoint as it was."""
        self._phases.check_in_step()  # no checkpoint of a step whose ranks were out of step
        if self._parts.write_checkpoint(checkpoint, filepath):
            return
        checkpoint.update(self._parts.state_dict())  # every rank gets here (Lightning writes on rank 0 only)
        write = trainer_checkpoints.write_full
        agree_on(lambda: write(self.checkpoint_io, checkpoint, filepath, storage_options) if self.is_global_zero
                 else None, filepath, self.global_rank, group=self.host_group)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read the checkpoint on every rank (``weights_only``: ``None`` is torch's default). A damaged or foreign one
        raises the same one-line ``CheckpointError`` on every rank, naming the file."""
        self._resuming_from = os.fspath(checkpoint_path)

        def read_full() -> dict[str, Any]:
            return super(StaticDistStrategy, self).load_checkpoint(checkpoint_path, weights_only=weights_only)

        return self._agree_on_resume(lambda: trainer_checkpoints.read(checkpoint_path, weights_only, read_full,
                                                                      self._phases))

    def _agree_on_resume(self, attempt: Callable[[], T]) -> T:
        """A part of resuming, its outcome agreed on by every rank (one line naming the checkpoint where one fails)."""
        return agree_on(attempt, self._resuming_from or "the checkpoint", self.global_rank, reading=True,
                        group=self.host_group)

    # -------------------------------------------------------------------------------------------- teardown

    @override
    def teardown(self) -> None:
        log.debug(f"{self.__class__.__name__}: tearing down strategy")
        mismatch: Optional[RankMismatchError] = None
        try:  # out of step: no collective in the participants' teardown, then the mismatch raised at the end
            mismatch = self._phases.teardown(self._failed, on_mismatch=self._mark_out_of_step)
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

    def _mark_out_of_step(self) -> None:
        self._failed = True  # the ranks' last steps disagreed: no collective from here on

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, "Static data-parallel strategy (explicit bucketed collectives)")
