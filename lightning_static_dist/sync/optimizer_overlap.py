"""``strategy.sync.optimizer_overlap``: each bucket's parameters take their optimizer step as soon as that bucket's
average lands, while the later buckets' collectives are still in flight (modded-nanogpt steps its parameters so).

Under ``sync.schedule: after_backward`` the synchroniser leaves its waits pending
(:class:`~lightning_static_dist.sync.round_state.RoundSchedule`'s ``defer_waits``) and :func:`step_per_bucket` walks
the plan: wait for bucket k (a stream wait), step its parameters, and so on. That is the step the user asked for only
where nothing reads the gradients between backward and the step and the optimizer updates each parameter from its
own gradient and state alone: :func:`choose_optimizer_overlap` decides, and says why.

Example::

    sync.follow(RoundSchedule(launch_during_backward=False, defer_waits=True))
    loss.backward()                       # every bucket issued as backward ends, none waited for
    step_per_bucket(optimizer, sync)      # settle(k) then step bucket k's parameters, for each k; then the rest
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from lightning_static_dist.config.check import fail
from lightning_static_dist.sync.config import SyncConfig
from lightning_static_dist.sync.synchronizer import GradientSynchronizer

KEY = f"{SyncConfig.KEY}.optimizer_overlap"

PER_PARAMETER: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad,
)
"""torch.optim's elementwise optimizers: a parameter's update reads its own gradient and state only, so stepping the
parameters bucket by bucket is the same step (exact types: a subclass may couple parameters in its own ``step``)."""


#: Why Lightning's gradient scaler rules the optimizer overlap out (a clause of a line).
SCALER_HAZARD = "the gradient scaler (16-mixed) unscales and checks every gradient before the step"


@dataclass(frozen=True)
class OverlapChoice:
    """Whether the optimizer steps bucket by bucket, and why (a clause for the line printed at fit start)."""

    on: bool
    why: str

    def describe(self) -> str:
        return f"optimizer overlap: {'on' if self.on else 'off'} ({self.why})"


def step_hazards(readers: Optional[Sequence[str]], automatic_optimization: bool, scaler: bool,
                 optimizers: Sequence[Any]) -> list[str]:
    """What the run shows at setup that rules optimizer overlap out. ``readers``: what the front end runs between
    backward and the step that may read the gradients (a clause each; ``None``: it cannot tell)."""
    found = []
    if readers is None:
        found.append("the front end's own loop may read the gradients between backward and the step (Fabric)")
    else:
        found.extend(readers)
    if not automatic_optimization:
        found.append("manual optimization steps inside training_step")
    if scaler:
        found.append(SCALER_HAZARD)
    if len(optimizers) != 1:
        found.append(f"{len(optimizers)} optimizers: one is stepped bucket by bucket")
    elif type(optimizers[0]) not in PER_PARAMETER:
        found.append(f"{type(optimizers[0]).__name__} is not one of torch.optim's per-parameter optimizers"
                     f" ({', '.join(t.__name__ for t in PER_PARAMETER)})")
    found.extend(step_hooks(optimizers))
    return found


def step_hooks(optimizers: Sequence[Any]) -> list[str]:
    """Optimizer step hooks registered at setup: stepped bucket by bucket, each would run once per bucket, seeing
    part of the step (torch's global ones, and each optimizer's own)."""
    found = []
    if torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        found.append("torch's global optimizer step hooks (register_optimizer_step_pre_hook / _post_hook) would run"
                     " once per bucket")
    for optimizer in optimizers:
        if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks",
                                                                           None):
            found.append(f"{type(optimizer).__name__} has step hooks (register_step_pre_hook / register_step_post_hook)"
                         " that would run once per bucket")
    return found


def choose_optimizer_overlap(setting: Union[bool, Literal["auto"]], hazards: Sequence[str]) -> OverlapChoice:
    """Resolve ``sync.optimizer_overlap`` against the ``hazards`` found (``sync/config.py``'s :func:`overlap_hazards`,
    then :func:`step_hazards`): ``auto`` is on where there are none and off naming the first; ``true`` with one is a
    one-line ``ConfigError``; ``false`` is off."""
    if setting is False:
        return OverlapChoice(False, f"{KEY}=false")
    if hazards:
        if setting is True:
            fail(KEY, True, f"{hazards[0]}; allowed with it: auto (off here), false")
        return OverlapChoice(False, hazards[0])
    return OverlapChoice(True, "each bucket's parameters step as its average lands" if setting is True
                         else "auto: nothing reads the gradients between backward and the step")


def step_per_bucket(optimizer: Optimizer, synchronizer: GradientSynchronizer, **kwargs: Any) -> Optional[str]:
    """One optimizer step, bucket by bucket where the synchroniser left the round's waits pending (else one step).
    A step hook registered since the check at setup (:func:`step_hooks`) makes it one step after every bucket, so the
    hook runs once: the hazard is returned (``None``: none), for the caller to turn the overlap off and say so.

    For each bucket of the plan, in plan order: :meth:`~GradientSynchronizer.settle` up to it, then ``optimizer.step()``
    restricted to its parameters; then the round settled and one step of the parameters outside every bucket (sharded
    embeddings, averaged on their own). The restriction swaps each param group's ``params`` list for the bucket's
    share of it for the length of the step, so the optimizer's own state is what is updated (``state_dict()``, LR
    schedulers and checkpoints unchanged) and no gradient is touched. Lightning's ``on_before_optimizer_step`` fires once;
    so does a step hook (none steps bucket by bucket).
    """
    late = step_hooks([optimizer]) if synchronizer.unsettled else []
    if not synchronizer.unsettled or late:
        synchronizer.settle()
        optimizer.step(**kwargs)
        return late[0] if late else None
    params = synchronizer.parameters
    bucket_of = {id(params[i]): k for k, bucket in enumerate(synchronizer.plan.buckets) for i in bucket.param_indices}
    buckets = len(synchronizer.plan.buckets)
    # shares[k][g]: bucket k's parameters in param group g, in the group's order (k = buckets: outside every bucket)
    shares: list[list[list[Any]]] = [[[] for _ in optimizer.param_groups] for _ in range(buckets + 1)]
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            shares[bucket_of.get(id(p), buckets)][g].append(p)
    for k in range(buckets):
        synchronizer.settle(k)
        _step_restricted(optimizer, shares[k], kwargs)
    synchronizer.settle()
    _step_restricted(optimizer, shares[buckets], kwargs)  # (nothing where none of them has a gradient)
    return None


def _step_restricted(optimizer: Optimizer, share: list[list[Any]], kwargs: dict[str, Any]) -> None:
    """``optimizer.step()`` over ``share`` (one list per param group) only; nothing when it holds no gradient."""
    if not any(p.grad is not None for group in share for p in group):
        return
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    try:
        for group, own in zip(groups, share):
            group["params"] = own
        optimizer.step(**kwargs)
    finally:
        for group, own in zip(groups, saved):
            group["params"] = own


class BucketwiseOptimizer:
    """The optimizer as the precision plugin sees it under optimizer overlap: ``step(closure)`` runs the closure (in
    Lightning's automatic optimization the training step and its backward), then steps the real optimizer bucket by
    bucket (:func:`step_per_bucket`); everything else is the real optimizer's.

    Example::

        output = precision_plugin.optimizer_step(BucketwiseOptimizer(optimizer, synchronizer), model, closure)

    ``on_late_hazard``: told what made a step one step after every bucket (a step hook registered since setup).
    """

    def __init__(self, optimizer: Optimizer, synchronizer: GradientSynchronizer,
                 on_late_hazard: Callable[[str], None] = lambda hazard: None) -> None:
        self.optimizer = optimizer
        self._synchronizer = synchronizer
        self._on_late_hazard = on_late_hazard

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():  # (as torch's optimizers call it)
                loss = closure()
        late = step_per_bucket(self.optimizer, self._synchronizer, **kwargs)
        if late is not None:
            self._on_late_hazard(late)
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
