"""One trainable module set up under Fabric, with the step participants the Trainer strategy runs.

Fabric hands the loop to the user, so the phases are driven from what the user calls (:class:`SynchronisedModel`
says which call drives which phase). Each trainable module set up gets its own participants, its own view of the
strategy (:class:`ModelView`: that module, its optimizers) and its own step count (:class:`FabricContext`): two models
trained one after the other, as in a GAN loop, each average their own gradients.

Example (what ``StaticDistFabricStrategy.setup_module_and_optimizers`` does)::

    model = SynchronisedModel(strategy, module, [optimizer])
    model.set_up()                 # before_optimizers, setup, after_setup
    module(x)                      # its forward hooks: on_train_batch_start, before_forward, after_forward
    run_backward([model], loss.backward)   # before_backward; the backward; after_backward, finish_gradients ...
    optimizer.step(); model.after_optimizer_step()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Callable, Optional

import torch
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.strategies.strategy import _BackwardSyncControl

from lightning_static_dist.config import ConfigError
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.participants import Participants
from lightning_static_dist.processes.fingerprint import RankMismatchError


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
    """The strategy as one module's participants read it (:class:`~lightning_static_dist.participants.StrategyView`):
    the strategy's configuration, ranks and groups, this module and its optimizers."""

    def __init__(self, strategy: Any, module: Module, optimizers: list[Optimizer]) -> None:
        self._strategy = strategy
        self._module = module
        self.optimizers = optimizers
        self.context: Optional[FabricContext] = None

    def __getattr__(self, name: str) -> Any:  # config, world_size, ranks, device, mesh, groups, simulation ...
        return getattr(self._strategy, name)

    @property
    def lightning_module(self) -> Module:
        return self._module

    @property
    def model(self) -> Module:
        return self._module

    @property
    def precision_plugin(self) -> Any:
        return self._strategy.precision

    @property
    def preempted(self) -> bool:
        return False  # (Fabric's loop is the user's: no agreed SIGTERM stop)


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


class SynchronisedModel:
    """One trainable module's step under Fabric, driven from the user's calls::

        fabric.setup(module, optimizer)   before_optimizers, setup, after_setup (the optimizer set up with it, or
                                          the first one later set up over its parameters; else the first forward)
        module(x), in training            first forward since a step: on_train_batch_start; then before_forward,
                                          after_forward (a forward pre/post hook; evaluation forwards: nothing)
        fabric.backward(loss)             before_backward (every model whose training forward ran since its step),
                                          the backward, after_backward; then, for the models whose parameters got
                                          a gradient in it: finish_gradients, before_optimizer_step
        optimizer.step()                  after_optimizer_step
        fabric.no_backward_sync(module)   no_sync, and finish_gradients told it is accumulating
        fabric.save / fabric.load         check_in_step; the participants' state entries and state-dict forms
        teardown                          check_in_step (unless failed), teardown(failed)

    Args:
        strategy: the Fabric strategy (the view reads its configuration, ranks and groups).
        module: the trainable module.
        optimizers: its optimizers, where set up with it (else the one :meth:`add_optimizer` is given).
        recorder: the strategy's overlap recorder (``None``: nothing recorded).
        monitor_every: record every this many optimizer steps.
    """

    def __init__(self, strategy: Any, module: Module, optimizers: list[Optimizer],
                 recorder: Optional[StepRecorder] = None, monitor_every: int = 1,
                 failed: Callable[[], bool] = lambda: False) -> None:
        self.module = module
        self.view = ModelView(strategy, module, list(optimizers))
        self.context = FabricContext(module)
        self.parts = Participants(self.view, failed=failed)  # type: ignore[arg-type]
        self._recorder = recorder
        self._monitor_every = monitor_every
        self.is_set_up = False
        self.accumulating = False
        self.step_open = False  # a training forward ran since the last optimizer step
        self.got_gradients = False  # a parameter's gradient was accumulated since the last before_backward
        self._hooks = [module.register_forward_pre_hook(self._before_forward),
                       module.register_forward_hook(self._after_forward)]

    def each(self, phase: str, *args: Any) -> None:
        """Call ``phase`` on every participant, in their order."""
        for participant in self.parts.ordered:
            getattr(participant, phase)(*args)

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
        if self.is_set_up:
            raise ConfigError("fabric.setup_optimizers: an optimizer over a model whose step is set up already (with"
                              " an optimizer, or at its first forward); allowed: set the model up with all its"
                              " optimizers at once, fabric.setup(model, optimizer1, optimizer2)")
        self.view.optimizers.append(optimizer)
        self.set_up()

    def set_up(self) -> None:
        """The setup phases (once): the embeddings sharded and the synchroniser built, the module compiled."""
        if self.is_set_up:
            return
        self.is_set_up = True
        self.view.context = self.context
        before = dict(self.module.named_parameters(remove_duplicate=False))
        self.each("before_optimizers", self.context)
        sharder = self.parts.embeddings.sharder
        if sharder is not None:  # the shards are new parameters: the user's optimizer, built before setup, must hold them
            replaced = {id(before[name]): w.shard for w in sharder.weights for name in w.names if name in before}
            for optimizer in self.view.optimizers:
                repoint_optimizer(optimizer, replaced)
        self.each("setup", self.context)
        self.each("after_setup", self.context)
        if self._recorder is not None:
            self.each("attach_recorder", self._recorder)
        # which backward passes reach this model: a flag per model, set by any of its parameters (after setup: the
        # embeddings' shards are the parameters now). What DDP reads from its own gradient hooks.
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_gradient)
                        for p in self.module.parameters() if p.requires_grad]

    def _on_gradient(self, param: torch.Tensor) -> None:
        self.got_gradients = True

    # -------------------------------------------------------------------------------------------- one step

    @torch.compiler.disable  # runs eagerly also when the user's torch.compile traces the module's __call__
    def _before_forward(self, module: Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # an evaluation forward: no buffers from rank 0, nothing recorded
        self.set_up()
        if not self.step_open:  # the first forward since the last optimizer step: a batch starts
            self.step_open = True
            if self._recorder is not None and self.context.fitting:
                self._recorder.active = self.context.steps % self._monitor_every == 0
                self._recorder.begin_step(self.context.steps, self.view.global_rank)
            self.each("on_train_batch_start")
        self.each("before_forward")

    @torch.compiler.disable
    def _after_forward(self, module: Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.each("after_forward")

    def before_backward(self) -> None:
        self.got_gradients = False
        self.each("before_backward")

    def finish_gradients(self) -> None:
        """After a backward that gave this model's parameters gradients: its round, the checks, the step's last
        phase before clipping and ``optimizer.step()``."""
        self.each("finish_gradients", self.accumulating)
        if self.accumulating:  # a micro-batch synchronised nothing: its timeline is not kept
            if self._recorder is not None:
                self._recorder.end_step(keep=False)
            self.step_open = False
            return
        self.each("before_optimizer_step")

    def after_optimizer_step(self) -> Any:
        """``optimizer.step()`` returned: the step's last phase; the recorded timeline (or ``None``)."""
        self.context.steps += 1
        self.each("after_optimizer_step")
        timeline = None
        if self._recorder is not None and self.step_open:
            timeline = self._recorder.end_step(keep=True)  # on CUDA the step before this one (its events are done)
        self.step_open = False
        return timeline

    @contextmanager
    def accumulate_locally(self) -> Iterator[None]:
        """``fabric.no_backward_sync(module)``: the gradients accumulate locally."""
        self.accumulating = True
        try:
            with ExitStack() as stack:
                for participant in self.parts.ordered:
                    stack.enter_context(participant.no_sync())
                yield
        finally:
            self.accumulating = False

    # -------------------------------------------------------------------------------------------- the end

    def teardown(self, failed: bool) -> None:
        """The participants' teardown (``failed``: no collective), then this model's hooks removed, whatever raised."""
        try:
            self.each("teardown", failed)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []


def run_backward(models: list[SynchronisedModel], run: Callable[[], None]) -> None:
    """``fabric.backward(loss)`` over ``models`` (those whose training forward ran since their last step): every
    model's pre-phases before ``run`` (the backward itself), every model's ``after_backward`` after it, then the
    rounds and checks of the models whose parameters got a gradient in it, in the order they were set up.

    A model a backward does not reach (a GAN's generator under the critic's loss of a detached fake) runs no round,
    as DDP's reducer, fired by its gradient hooks, runs none; so each rank must give a model gradients in the same
    backward passes (as under DDP: a rank whose model got none where a peer's did leaves that peer waiting).
    """
    for model in models:
        model.before_backward()
    run()
    for model in models:
        model.each("after_backward")  # (the recorder's backward ends before any round's waits)
    for model in models:
        if model.got_gradients:
            model.finish_gradients()


def teardown_models(models: list[SynchronisedModel], failed: bool) -> Optional[RankMismatchError]:
    """Every model's ``check_in_step`` (unless ``failed``), then every model's teardown, each also when another's
    raised; ``failed`` or out of step: with no collective (a peer may be gone). As the Trainer strategy's teardown,
    the ranks' mismatch is returned, to be raised once the strategy's own teardown is done."""
    mismatch: Optional[RankMismatchError] = None
    if not failed:
        try:  # (no collective: the last rounds' verdicts, read from what they recorded)
            for model in models:
                model.each("check_in_step")
        except RankMismatchError as err:
            mismatch = err
    with ExitStack() as stack:
        for model in models:
            stack.callback(model.teardown, failed or mismatch is not None)
    return mismatch


class LocalAccumulation(_BackwardSyncControl):
    """``fabric.no_backward_sync(module)``: that module's gradients accumulate locally (a module set up without
    trainable parameters has nothing to hold back)."""

    def __init__(self, models: Callable[[Module], Optional[SynchronisedModel]]) -> None:
        self._models = models

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        model = self._models(module)
        return model.accumulate_locally() if enabled and model is not None else nullcontext()
