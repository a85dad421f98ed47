"""``strategy.sync.reduce: reduce_scatter``: each rank keeps and steps its own shard of the parameters and of the
optimizer state; the whole parameters come back by all-gathers overlapped with the next forward.

:func:`build_sharded_synchronizer` builds the sharded synchroniser for the gradient participant
(:class:`~lightning_static_dist.participants.gradients.GradientAveraging`, which owns it and runs its rounds
like any synchroniser's); :class:`ParameterShards` waits for the gathers where the forward first needs the parameters,
and saves and loads the optimizer state in its sharded forms (``strategy.checkpoint.format``).

Example (the roster builds it)::

    sharded = ParameterShards(strategy, gradients, compile)
    sharded.after_optimizer_step()      # start the all-gathers of the updated shards
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Protocol

import os

import torch

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.checkpoint import (
    ShardedOptimizerState,
    agree_on,
    consolidate,
    is_sharded_checkpoint,
    save_sharded,
)
from lightning_static_dist.compat import unwrap_optimizer
from lightning_static_dist.config import ConfigError
from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.mesh import REPLICATE_DIM, SHARD_DIM
from lightning_static_dist.participants.base import (ModelWorldView, StepContext, StepParticipant, StrategyView,
                                                     syncs_gradients)
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.sync.sharded_synchronizer import ShardedSynchronizer

_PIECES_KEY = "static_dist_optimizer_pieces"  # optimizer_state() in sharded-checkpoint mode: this rank's ranges

#: torch.optim optimizers whose update of an element depends on more than that element's own gradient and state:
#: stepping flat chunks of the parameters would change their results (reduce_scatter refuses them).
_NOT_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "SparseAdam")
                         if hasattr(torch.optim, name))


def build_sharded_synchronizer(view: ModelWorldView) -> ShardedSynchronizer:
    """The sharded synchroniser of this fit, attached, with the one optimizer re-pointed at this rank's shards
    (the gradient participant calls this when it chooses ``reduce_scatter``). Refused, with a one-line
    :class:`ConfigError`, for several optimizers, an optimizer that does not update element by element, and the
    16-mixed gradient scaler."""
    mesh = view.device_mesh
    assert view.model is not None
    if len(view.optimizers) != 1:
        raise ConfigError(f"strategy.sync.reduce='reduce_scatter': needs exactly one optimizer, configure_optimizers"
                          f" returned {len(view.optimizers)}; allowed with several: 'all_reduce'")
    optimizer = view.optimizers[0]
    inner = unwrap_optimizer(optimizer)
    if isinstance(inner, _NOT_ELEMENTWISE):
        raise ConfigError(f"strategy.sync.reduce='reduce_scatter': {type(inner).__name__} does not update each element"
                          " on its own (it would see flat chunks, not the parameters' shapes); allowed with it:"
                          " 'all_reduce'")
    if inner.state:  # (under Fabric the user builds it before setup)
        raise ConfigError("strategy.sync.reduce='reduce_scatter': the optimizer already has state, and each rank must"
                          " step only its shards from the first step; allowed: an optimizer that has not stepped")
    if getattr(view.precision_plugin, "scaler", None) is not None:
        raise ConfigError("strategy.sync.reduce='reduce_scatter': the 16-mixed gradient scaler decides per rank on"
                          " shards; use precision bf16-mixed or 32, or strategy.sync.reduce='all_reduce'")
    plan = view.plan
    sync = ShardedSynchronizer(
        view.model.named_parameters(), optimizer, shard_group=mesh.get_group(SHARD_DIM),
        replicate_group=mesh.get_group(REPLICATE_DIM), group=view.dp_group,
        capacity=plan.sync.capacity,
        check_each_collective=plan.sync.check_each_collective,
    )
    sync.bind()
    sync.attach()
    replicate, shard = mesh.size(0), mesh.size(1)
    state_share = f"1/{shard}" if shard > 1 else "all"
    rank_zero_info(f"static_dist: reduce_scatter over a {replicate} x {shard} mesh ({sync.plan.describe()});"
                   f" each rank keeps {state_share} of the optimizer state")
    return sync


class ShardHolder(Protocol):
    """Where the sharded synchroniser is read from: the gradient participant, which builds it and runs its rounds
    (a protocol, so that this module need not import that one, which imports this).

    Example::

        sharded = ParameterShards(strategy, gradients, compile)   # gradients: a GradientAveraging
    """

    @property
    def sharded_sync(self) -> Optional[ShardedSynchronizer]: ...


class ParameterShards(StepParticipant):
    """The sharded synchroniser's own part of a step: the gathers, and the sharded optimizer state in checkpoints.
    ``gradients`` (the gradient participant, which builds the synchroniser and runs its rounds) is where it reads
    the synchroniser from; its setup runs first."""

    def __init__(self, view: StrategyView, gradients: ShardHolder, compile: StaticCompile) -> None:
        self._view = view
        self._gradients = gradients
        self._compile = compile
        self._gather_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._buckets_at_step_start: Optional[list[int]] = None
        self._last_sharded_checkpoint: Optional[str] = None

    @property
    def sharded_sync(self) -> Optional[ShardedSynchronizer]:
        """While fitting: the synchroniser holding this rank's shards (``None`` otherwise, and once released)."""
        return self._gradients.sharded_sync

    def _sharded_checkpoints(self) -> bool:
        return self.sharded_sync is not None and self._view.plan.checkpoint.format == "sharded"

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self, context: StepContext) -> None:
        view = self._view
        if not syncs_gradients(context, view):
            return
        sync = self.sharded_sync
        if sync is not None:
            self._wait_for_parameters_where_needed(sync)
        elif view.plan.checkpoint.sharded_unavailable:
            rank_zero_warn("static_dist: strategy.checkpoint.format='sharded' has nothing to shard with"
                           " strategy.sync.reduce=all_reduce (every rank holds the whole state); checkpoints are full")

    def _wait_for_parameters_where_needed(self, sync: ShardedSynchronizer) -> None:
        """Wait for a bucket's all-gather where the forward first needs it: in pre-hooks of the repeated blocks (the
        regions regional compile uses; their hooks run outside the compiled code), the rest at the step's start."""
        module = self._view.lightning_module
        assert module is not None
        compile_cfg = self._compile.run_plan()
        # the blocks' pre-hooks run outside compiled code only when the blocks are compiled one by one (or eagerly)
        whole = compile_cfg.enabled and compile_cfg.regional is not True
        blocks = [] if whole else self._compile.repeated_blocks()
        inside: set[int] = set()
        for block in blocks:
            buckets = sync.buckets_of(block.parameters())
            inside.update(id(p) for p in block.parameters())
            self._gather_hooks.append(block.register_forward_pre_hook(
                lambda *_, b=tuple(buckets): sync.wait_gather(b)))
        outside = [p for p in module.parameters() if id(p) not in inside]
        self._buckets_at_step_start = sync.buckets_of(outside) if blocks else None

    # -------------------------------------------------------------------------------------------- a step

    def before_forward(self) -> None:
        if self.sharded_sync is not None:
            self.sharded_sync.wait_gather(self._buckets_at_step_start)  # the blocks' buckets: in their pre-hooks

    def before_reading_parameters(self) -> None:
        if self.sharded_sync is not None:
            self.sharded_sync.wait_gather()  # the parameters are current only once their gathers are done

    def after_optimizer_step(self) -> None:
        if self.sharded_sync is not None:
            self.sharded_sync.start_gather()  # overlapped with whatever runs until the next forward needs them

    # ------------------------------------------------------------------------------------------ checkpoints

    def after_model_loaded(self) -> None:
        if self.sharded_sync is not None:
            self.sharded_sync.refresh_chunks()  # the optimizer updates the chunks: give them the loaded weights

    def optimizer_state(self, optimizer: Any) -> Optional[dict[str, Any]]:
        sync = self.sharded_sync
        if sync is None:
            return None
        if self._sharded_checkpoints():
            return {_PIECES_KEY: sync.state_shard.piece_tensors()}  # this rank's own ranges: nothing is gathered
        return sync.state_shard.full_optimizer_state()  # collective: the form any world size can load

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        sync = self.sharded_sync
        if sync is None:
            return False
        state, own = checkpoint["optimizer_states"][0], sync.state_shard
        if isinstance(state, ShardedOptimizerState):  # read only the ranges this rank's pieces cover
            own.load_optimizer_state(state.pieces(own.wanted_ranges()), state.param_groups)
        else:
            own.load_full_optimizer_state(state)
        _optimizers_to_device(self._view.optimizers, self._view.root_device)
        return True

    def write_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> bool:
        """Every rank writes its own optimizer ranges into one ``torch.distributed.checkpoint`` directory."""
        if not self._sharded_checkpoints():
            return False
        path = os.fspath(path)
        sync = self.sharded_sync
        assert sync is not None
        rest = dict(checkpoint)
        model_state = rest.pop("state_dict", {})
        states = rest.pop("optimizer_states", [])
        pieces = states[0][_PIECES_KEY] if states else {}
        meta = {"lightning": rest, "param_groups": sync.state_shard.full_param_groups(),
                "shapes": sync.state_shard.original_shapes(),
                "has_optimizer": bool(states)}
        with waiting_in("writing the sharded checkpoint"):
            save_sharded(path, meta, model_state, pieces, self._view.global_rank, group=self._view.host_group)
        self._last_sharded_checkpoint = path
        return True

    # -------------------------------------------------------------------------------------------- teardown

    def teardown(self, failed: bool) -> None:
        for hook in self._gather_hooks:
            hook.remove()
        self._gather_hooks = []
        if self.sharded_sync is not None:
            if not failed and not self._view.preempted:  # (preempted: the sharded checkpoint resumes as it is;
                # a gather and a second, full write could outlast the scheduler's grace period)
                self.sharded_sync.release()  # whole parameters and a full-form optimizer after fit (collective)
                self._consolidate_last_checkpoint()

    def _consolidate_last_checkpoint(self) -> None:
        """``strategy.checkpoint.consolidate_at_end``: the last sharded checkpoint becomes a plain file, in place."""
        path, self._last_sharded_checkpoint = self._last_sharded_checkpoint, None
        if path is None or not self._view.plan.checkpoint.consolidate_at_end:
            return
        if self._view.simulation is not None:  # only rank 0's shards were written: there is nothing whole to make
            rank_zero_info(f"static_dist: the last sharded checkpoint ({path}) holds rank 0's shards of a simulated"
                           " world; not consolidated")
            return
        view = self._view
        # rank 0's write, its outcome agreed on (the agreement is also the barrier): a full disk here is every
        # rank's one line, and the sharded checkpoint stays as it was
        # (weights_only=False: the file this fit itself just wrote, with the user's own hyperparameter objects)
        def write() -> None:
            if view.is_global_zero and is_sharded_checkpoint(path):
                consolidate(path, path, weights_only=False)

        agree_on(write, path, view.global_rank, group=view.host_group)
        rank_zero_info(f"static_dist: consolidated the last sharded checkpoint into a plain file: {path}")
