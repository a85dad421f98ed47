"""One trainable module set up under Fabric, with the step participants the Trainer strategy runs.

Fabric hands the loop to the user, so the phases are driven from what the user calls (:class:`FabricModel`
says which call drives which phase). Each trainable module set up gets its own participants, its own view of the
strategy (:class:`ModelView`: that module, its optimizers) and its own step count (:class:`FabricContext`): two models
trained one after the other, as in a GAN loop, each average their own gradients.

Example (what ``StaticDistFabricStrategy.setup_module_and_optimizers`` does)::

    model = FabricModel(strategy, module, [optimizer])
    model.set_up()                 # before_optimizers, setup, after_setup
    module(x)                      # its forward hooks: on_train_batch_start, before_forward, after_forward
    run_backward([model], loss.backward)   # before_backward; the backward; after_backward, finish_gradients ...
    optimizer.step(); model.after_optimizer_step()
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.strategies.strategy import _BackwardSyncControl

from lightning_static_dist.config import ConfigError
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants import Participants, StepPhases
from lightning_static_dist.participants.roster_offer import RosterOffer
from lightning_static_dist.participants.phases import run_backward as phases_run_backward
from lightning_static_dist.participants.phases import teardown_all
from lightning_static_dist.agreement.fingerprint import RankMismatchError
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.plan.step_plan import StepPlan

if TYPE_CHECKING:
    from lightning_static_dist.fabric.processes import FabricProcesses


class FabricContext:
    """The :class:`~lightning_static_dist.participants.StepContext` of one module under Fabric: fitting while it has
    trainable parameters, the optimizer steps it took, its own ``training`` flag; no callbacks, no Trainer loop.

    Example::

        context = FabricContext(module)
        context.fitting, context.global_step     # (True, 0) before the first optimizer step
    """

    def __init__(self, module: Module) -> None:
        self._module = module
        self.steps = 0
        """Optimizer steps taken (the view's ``global_step``)."""

    @property
    def fitting(self) -> bool:
        return any(p.requires_grad for p in self._module.parameters())

    @property
    def global_step(self) -> int:
        return self.steps

    @property
    def training(self) -> bool:
        return self._module.training

    def add_callback(self, callback: Any) -> None:
        """Fabric has no callbacks of the Trainer's kind: nothing."""

    @property
    def micro_batches(self) -> None:
        return None  # the script accumulates when it enters no_backward_sync, step by step

    @property
    def gradient_readers(self) -> None:
        return None  # the script's loop runs between backward and the step: it may read any gradient

    @property
    def trainer_loop(self) -> None:
        return None


class ModelView:
    """The strategy as one module's participants read it (:class:`~lightning_static_dist.participants.StrategyView`,
    member by member): the strategy's configuration, ranks and groups; this module and its optimizers.

    Example::

        view = ModelView(strategy, module, [optimizer])
        view.model is module, view.world_size    # (True, 2) on two ranks
    """

    def __init__(self, strategy: FabricProcesses, module: Module, optimizers: list[Optimizer]) -> None:
        self._strategy = strategy
        self._module = module
        self.optimizers = optimizers
        self.context: Optional[FabricContext] = None

    @property
    def plan(self) -> StepPlan:
        return self._strategy.plan

    def settle_schedule(self, plan: StepPlan) -> None:
        self._strategy.settle_schedule(plan)

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self._strategy.is_global_zero

    @property
    def root_device(self) -> torch.device:
        return self._strategy.root_device

    @property
    def device_mesh(self) -> Any:
        return self._strategy.device_mesh

    @property
    def simulation(self) -> Optional[SimulateConfig]:
        return self._strategy.simulation

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return self._strategy.dp_group

    @property
    def host_group(self) -> Optional[dist.ProcessGroup]:
        return self._strategy.host_group

    @property
    def preempted(self) -> bool:
        return False  # (Fabric's loop is the user's: no agreed SIGTERM stop)

    @property
    def lightning_module(self) -> Module:
        return self._module

    @property
    def model(self) -> Module:
        return self._module

    @property
    def precision_plugin(self) -> Any:
        return self._strategy.precision

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._strategy.barrier(*args, **kwargs)


def repoint_optimizer(optimizer: Optimizer, new: dict[int, torch.Tensor]) -> None:
    """Point ``optimizer``'s param groups at ``new`` (``id`` of the tensor it held -> the one it is to hold): Fabric's
    optimizer is built by the user before setup, on the parameters as they were. Allowed only while it has no state
    (a one-line :class:`ConfigError` otherwise).

    Example::

        repoint_optimizer(optimizer, {id(embedding.weight): shard})
    """
    held = any(id(p) in new for group in optimizer.param_groups for p in group["params"])
    if not held:
        return
    if optimizer.state:
        raise ConfigError("strategy.embedding.shard: the optimizer already has state, and the sharded parameters need"
                          " an optimizer that has not stepped; allowed: set up the model and the optimizer before the"
                          " first step")
    for group in optimizer.param_groups:
        group["params"] = [new.get(id(p), p) for p in group["params"]]


class FabricModel:
    """One trainable module's step under Fabric: its participants, driven through their
    :class:`~lightning_static_dist.participants.StepPhases` from the user's calls::

        fabric.setup(module, optimizer)   the setup phases (the optimizer set up with it, or the first one later set
                                          up over its parameters; else the first training forward)
        module(x), in training            first forward since a step: on_train_batch_start; then before_forward,
                                          after_forward (a forward pre/post hook; evaluation forwards: nothing)
        fabric.backward(loss)             ``run_backward`` over the models whose training forward ran since their step
        optimizer.step()                  after_optimizer_step
        fabric.no_backward_sync(module)   the phases' no_sync
        fabric.save / fabric.load         check_in_step; the participants' state entries and state-dict forms
        teardown                          ``teardown_models``

    Args:
        strategy: the Fabric strategy (the view reads its configuration, ranks and groups).
        module: the trainable module.
        optimizers: its optimizers, where set up with it (else the one :meth:`add_optimizer` is given).
        recorder: the strategy's overlap recorder (``None``: nothing recorded).
        monitor_every: record every this many optimizer steps.
    """

    def __init__(self, strategy: FabricProcesses, module: Module, optimizers: list[Optimizer],
                 recorder: Optional[StepRecorder] = None, monitor_every: int = 1,
                 failed: Callable[[], bool] = lambda: False) -> None:
        self.module = module
        self.view = ModelView(strategy, module, list(optimizers))
        self.context = FabricContext(module)
        self.parts = Participants(self.view, failed=failed)
        self.phases = StepPhases(self.parts)
        self.offer = RosterOffer(self.parts, self.view, host_max=strategy.host_max)
        self._recorder = recorder
        self._monitor_every = monitor_every
        self._hooks = [module.register_forward_pre_hook(self._before_forward),
                       module.register_forward_hook(self._after_forward)]

    # ------------------------------------------------------------------------------------------------ setup

    def owns(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps this module's parameters (set up with it, or over them)."""
        if any(optimizer is o for o in self.view.optimizers):
            return True
        mine = {id(p) for p in self.module.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """An optimizer set up after the module (``fabric.setup_optimizers``): the step is set up with it. Refused in
        one line once the step is set up (with an optimizer, or at the first forward): its participants compiled,
        counted (``reduce_scatter``: exactly one) and repointed the optimizers they had."""
        if any(optimizer is o for o in self.view.optimizers):
            return
        if self.phases.is_set_up:
            raise ConfigError("fabric.setup_optimizers: an optimizer over a model whose step is set up already (with"
                              " an optimizer, or at its first forward); allowed: set the model up with all its"
                              " optimizers at once, fabric.setup(model, optimizer1, optimizer2)")
        self.view.optimizers.append(optimizer)
        self.set_up()

    def set_up(self) -> None:
        """The setup phases (once): the embeddings sharded and the synchroniser built, the module compiled."""
        if self.phases.is_set_up:
            return
        self.view.context = self.context
        before = dict(self.module.named_parameters(remove_duplicate=False))

        def repoint_optimizers() -> None:
            sharder = self.parts.embeddings.sharder
            if sharder is None:
                return
            # the shards are new parameters: the user's optimizer, built before setup, must hold them
            replaced = {id(before[name]): w.shard for w in sharder.weights for name in w.names if name in before}
            for optimizer in self.view.optimizers:
                repoint_optimizer(optimizer, replaced)

        self.phases.set_up(self.context, repoint_optimizers, prepare=lambda: None)
        if self._recorder is not None:
            self.phases.attach_recorder(self._recorder)
        # which backward passes reach this model (after setup: the embeddings' shards are the parameters now)
        self._hooks += [p.register_post_accumulate_grad_hook(self.phases.note_gradient)
                        for p in self.module.parameters() if p.requires_grad]

    # -------------------------------------------------------------------------------------------- one step

    @torch.compiler.disable  # runs eagerly also when the user's torch.compile traces the module's __call__
    def _before_forward(self, module: Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # an evaluation forward: no buffers from rank 0, nothing recorded
        self.set_up()
        if not self.phases.batch_open:  # the first forward since the last optimizer step: a batch starts
            if self._recorder is not None and self.context.fitting:
                self._recorder.active = self.context.steps % self._monitor_every == 0
                self._recorder.begin_step(self.context.steps, self.view.global_rank)
            self.phases.on_train_batch_start()
        self.phases.before_forward()

    @torch.compiler.disable
    def _after_forward(self, module: Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.phases.after_forward()

    def after_backward(self) -> None:
        """A backward ended (``run_backward``): where it reached this model in a micro-batch that accumulates, the
        micro-batch synchronised nothing, and its timeline is not kept."""
        if self._recorder is not None and self.phases.got_gradients and self.phases.accumulating:
            self._recorder.end_step(keep=False)

    def after_optimizer_step(self) -> Any:
        """``optimizer.step()`` returned: the step's last phase; the recorded timeline (or ``None``)."""
        self.context.steps += 1
        recorded = self._recorder is not None and self.phases.batch_open
        self.phases.after_optimizer_step()
        return self._recorder.end_step(keep=True) if recorded else None  # (CUDA: the step before, its events done)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def run_backward(models: list[FabricModel], run: Callable[[], None]) -> None:
    """``fabric.backward(loss)`` over ``models``: :func:`~lightning_static_dist.participants.phases.run_backward`
    over their phases, then the recorder told of a micro-batch that accumulated."""
    phases_run_backward([m.phases for m in models], run)
    for model in models:
        model.after_backward()


def teardown_models(models: list[FabricModel], failed: bool) -> Optional[RankMismatchError]:
    """:func:`~lightning_static_dist.participants.phases.teardown_all` over the models' phases (the ranks' mismatch
    returned, as under the Trainer), then every model's hooks removed, whatever raised."""
    try:
        return teardown_all([m.phases for m in models], failed)
    finally:
        for model in models:
            model.remove_hooks()


class LocalAccumulation(_BackwardSyncControl):
    """``fabric.no_backward_sync(module)``: that module's gradients accumulate locally (a module set up without
    trainable parameters has nothing to hold back)."""

    def __init__(self, models: Callable[[Module], Optional[FabricModel]]) -> None:
        self._models = models

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        model = self._models(module)
        return model.phases.no_sync() if enabled and model is not None else nullcontext()
