"""``StaticDistFabricStrategy``: the static_dist step engine under Lightning Fabric, as a thin front end.

Each trainable module set up gets the step participants the Trainer strategy runs (``fabric/model.py`` says which of
the user's calls drives which phase, and which models a ``fabric.backward`` synchronises): the Trainer's sections
work here, ``simulate`` as ``Fabric(devices=1)``. ``setup_distributed`` (the peer watchdog) runs once, on the first
trainable model's; ``process_dataloader`` from ``fabric.setup_dataloaders``. Fabric has no ``on_exception`` hook:
teardown reads whether it follows a failure (``fabric/processes.py``), and then does no collective.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_static_dist.config import ConfigError
from lightning_static_dist.fabric.metrics import StepFigures
from lightning_static_dist.fabric.checkpoints import FabricCheckpoints
from lightning_static_dist.fabric.model import LocalAccumulation, FabricModel, run_backward, teardown_models
from lightning_static_dist.processes.launcher import register_names
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants.roster_offer import RosterOffer
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync.broadcast import start_from_rank_zero

log = logging.getLogger(__name__)


class StaticDistFabricStrategy(FabricCheckpoints):
    """Data-parallel training under Fabric with explicit, bucketed gradient collectives that overlap backward.

    Registered in Fabric's ``STRATEGY_REGISTRY`` as ``"static_dist"`` (processes started like ``ddp``),
    ``"static_dist_spawn"`` and ``"static_dist_notebook"`` (``fork``). The keyword sections are the Trainer
    strategy's (``compile``, ``mesh``, ``sync``, ``compression``, ``embedding``, ``checkpoint``; each a dict or its
    dataclass, validated here). Every module set up with trainable parameters is synchronised on its own (a GAN's
    two models each); the module is not wrapped, and is compiled by the strategy with ``strategy.compile``.
    ``monitor_every_n_steps``: record the overlap timeline every this many optimizer steps (0: never). The DDP
    arguments (``timeout``, ``bucket_cap_mb``, ``broadcast_buffers`` ...) have DDP's meaning
    (``lightning_static_dist/ddp_arguments.py``).

    Example::

        fabric = L.Fabric(devices=2, strategy=StaticDistFabricStrategy(sync={"bucket_mb": 25}))
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        fabric.backward(loss_fn(model(x), y)); optimizer.step()
        fabric.log_dict(fabric.strategy.metrics(), step=step)  # rank-local: on every rank, or on one
        print(offer_of(fabric).sync_figures().bucket_plan)     # the run's facts: the offer, as under the Trainer
    """

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision: Any = None, *,
                 compile: Any = None, mesh: Any = None, sync: Any = None, compression: Any = None, embedding: Any = None,
                 checkpoint: Any = None, simulate: Any = None, timeout_s: Optional[float] = None,
                 process_group_backend: Optional[str] = None,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen", monitor_every_n_steps: int = 1,
                 timeout: Optional[timedelta] = None, find_unused_parameters: Optional[bool] = None,
                 static_graph: Optional[bool] = None, gradient_as_bucket_view: Optional[bool] = None,
                 bucket_cap_mb: Optional[float] = None, broadcast_buffers: Optional[bool] = None) -> None:
        config, notes = StrategyConfig.from_keywords(locals())  # (the keywords by name: the signature stays explicit)
        if isinstance(monitor_every_n_steps, bool) or not isinstance(monitor_every_n_steps, int) or monitor_every_n_steps < 0:
            raise ConfigError(f"monitor_every_n_steps={monitor_every_n_steps!r}: must be an integer >= 0 (0: never)")
        super().__init__(config, accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, start_method=start_method)
        for note in notes:
            rank_zero_info(note)
        self._figures = StepFigures()  # (on the root device, read when it first combines: not known before launch)
        self._backward_sync_control = LocalAccumulation(self._model_of)
        self._monitor_every = monitor_every_n_steps
        self._torn_down_offers: list[RosterOffer] = []
        log.debug(f"{self.__class__.__name__}: initialised with {self.config}")

    @classmethod
    def from_config(cls, config: StrategyConfig, **kwargs: Any) -> StaticDistFabricStrategy:
        """Build the strategy from a validated ``strategy`` block; ``kwargs`` win over it (as the Trainer's)."""
        return cls(**config.as_keywords(kwargs))

    # ------------------------------------------------------------------------------------------ what users read

    @property
    def offer(self) -> Optional[RosterOffer]:
        """What the run offers its user (:class:`~lightning_static_dist.offer.StaticDistOffer`, also through
        ``offer_of(fabric)``): the first trainable model's (``None`` before its ``fabric.setup``), as the Trainer's;
        still readable after teardown, as the Trainer's after ``fit``."""
        offers = self.offers
        return offers[0] if offers else None

    @property
    def offers(self) -> list[RosterOffer]:
        """One :class:`~lightning_static_dist.offer.StaticDistOffer` per trainable model, in set-up order (a GAN's
        generator's, then its discriminator's); after teardown, those of the models torn down."""
        return [model.offer for model in self._models] if self._models else list(self._torn_down_offers)

    def metrics(self) -> dict[str, float]:
        """The ``static_dist/*`` figures for ``fabric.log_dict``, rank-local (no collective): ``sync_rounds``,
        ``sync_buckets``, ``sync_bytes_sent``, ``sync_round_bytes`` (world size > 1); once per recorded step the
        overlap figures (mean over ranks, and ``_max``), combined in ``optimizer.step()``; with ``strategy.compile``
        this rank's ``graph_breaks``, ``recompiles`` and ``compile_s``. NaN figures are left out. These are the first
        trainable model's; the ``i``-th set up after it (a GAN's second) has its sync and compile figures under
        ``static_dist/model{i}/`` (the overlap timeline records the first model only)."""
        return self._figures.read([(m.parts.gradients.synchronizer, m.parts.compile.report) for m in self._models])

    # ------------------------------------------------------------------------------------- setup and a step

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        module = self.setup_module(module, optimizers)
        optimizers = [self.setup_optimizer(optimizer) for optimizer in optimizers]
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: Module, optimizers: Optional[list[Optimizer]] = None) -> Module:
        """Every rank takes rank 0's weights; a module with trainable parameters gets its own participants, set up
        now with its optimizers, or with the first optimizer set up over it (else at its first training forward)."""
        start_from_rank_zero(module, self.dp_group)
        if any(p.requires_grad for p in module.parameters()) and self._model_of(module) is None:
            recorder = StepRecorder(self.root_device) if self._monitor_every and not self._models else None
            self._add_model(FabricModel(self, module, optimizers or [], recorder, self._monitor_every,
                                              failed=self.has_failed))
            if len(self._models) == 1:  # once per process (the peer watchdog): the process group is up since launch
                self._models[0].phases.setup_distributed()
            if optimizers:
                self._models[-1].set_up()
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        model = self._model_stepped_by(optimizer)
        if model is not None:
            model.add_optimizer(optimizer)
        return optimizer

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        for model in self._models:  # (a loader set up before its model is left as it is)
            model.phases.process_dataloader(dataloader)
        return dataloader

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        # the models whose training forward ran since their last step (and ``model=``'s); those the backward gives
        # gradients synchronise (``run_backward``)
        models = [m for m in self._models if m.phases.batch_open or (module is not None and m.module is module)]
        run_backward(models, lambda: super(StaticDistFabricStrategy, self).backward(tensor, module, *args, **kwargs))

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        model = self._model_stepped_by(optimizer)
        if model is not None:
            timeline = model.after_optimizer_step()
            self._figures.after_step(timeline, self.world_size, self.root_device)
        return output

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        model = self._model_of(module)
        if model is not None and model.parts.gradients.clips_by_norm:  # one rank's norm is not the model's
            self.precision.unscale_gradients(optimizer)
            return model.parts.gradients.clip_grad_norm_(float(max_norm), float(norm_type))
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def teardown(self) -> None:
        """The models' participants and hooks, then Fabric's. After a failure (:meth:`failed_at_teardown`) or with the
        ranks out of step (raised at the end, as under the Trainer), with no collective."""
        models, self._models = self._models, []
        self._torn_down_offers = [model.offer for model in models] or self._torn_down_offers
        try:
            mismatch = teardown_models(models, self.failed_at_teardown())
            if mismatch is not None:
                self.mark_failed()
        finally:
            super().teardown()
        if mismatch is not None:
            raise mismatch

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, "Static data-parallel strategy for Fabric (explicit bucketed collectives)")
