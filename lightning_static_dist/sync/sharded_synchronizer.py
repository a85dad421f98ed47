"""``sync.reduce: reduce_scatter``: gradients reduce-scattered in a shard group, optimizer state split, parameters
all-gathered back; hybrid-sharded data parallelism from the same bucket plan as the all-reduce path.

The rounds are run by a :class:`~lightning_static_dist.sync.synchronizer.GradientSynchronizer` held here (not
inherited), given through ``fix_plan`` a plan made before the first step; this class is that plan's
:class:`~lightning_static_dist.sync.contracts.BucketLayout` and owns what is sharded: the gathers, clipping, and the
optimizer re-pointed at the pieces. Beside it: ``sharded_mean.py`` (the reducer), ``shard_layout.py`` (buckets as
parameter storage, cut into pieces), ``sharded_state.py`` (the optimizer state in the forms checkpoints hold).
A step, and how it differs from DDP: docs/how-it-works.md, "Hybrid sharding".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_static_dist.compat import all_gather_single
from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.sync.buffer import BucketBuffer
from lightning_static_dist.sync.contracts import SyncObserver, SyncStats
from lightning_static_dist.sync.plan import (
    DEFAULT_CAPACITY,
    BucketCapacity,
    BucketPlan,
    GradBucket,
    param_specs,
    plan_buckets,
)
from lightning_static_dist.sync.bucket_reducer import BucketReducer
from lightning_static_dist.sync.shard_layout import NOT_OPTIMIZED, BucketShard, Piece, ordered_by_group, shard_bucket
from lightning_static_dist.sync.sharded_mean import ShardedMean
from lightning_static_dist.sync.sharded_state import OptimizerStateShard
from lightning_static_dist.sync.synchronizer import GradientSynchronizer

__all__ = ["NOT_OPTIMIZED", "BucketShard", "Piece", "ShardedSynchronizer", "ShardedMean"]


class _ShardBuffer(BucketBuffer):
    """A bucket buffer padded to a multiple of the shard size; the averaged chunk goes to the pieces' ``.grad``, and
    a parameter's full-size gradient is dropped as soon as it is handed to the bucket."""

    def __init__(self, bucket: GradBucket, params: Sequence[Parameter], shard: BucketShard) -> None:
        super().__init__(bucket, params, padded_numel=shard.full.numel())
        self.shard = shard
        self._params = params

    def fill(self, slot: int, grad: Optional[Tensor]) -> None:
        super().fill(slot, grad)
        # copied into its bucket: the full-size gradient is not kept
        self._params[self.bucket.param_indices[slot]].grad = None

    def unpack(self, averaged: Tensor, params: Sequence[Parameter]) -> None:
        for piece in self.shard.pieces:
            piece.param.grad = averaged[piece.start - self.shard.chunk_start : piece.end - self.shard.chunk_start]


class ShardedSynchronizer:
    """Reduce-scatter / all-reduce gradient synchronisation with optimizer state split over the shard group.

    Args:
        named_parameters: the model's ``named_parameters()`` (tied weights once).
        optimizer: the one optimizer; :meth:`bind` re-points its param groups at this rank's pieces.
        shard_group: the mesh's ``dp_shard`` group (this rank's).
        replicate_group: the mesh's ``dp_replicate`` group (this rank's).
        group: every data-parallel rank (usage flags and the ranks' step check are reduced over it).

    Example::

        sync = ShardedSynchronizer(model.named_parameters(), optimizer, mesh.get_group("dp_shard"),
                                           mesh.get_group("dp_replicate"))
        sync.attach(); sync.bind()
        loss.backward(); sync.finish_if_pending(); optimizer.step(); sync.start_gather()
        sync.wait_gather()              # before the next forward reads the parameters
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Parameter]],
        optimizer: torch.optim.Optimizer,
        shard_group: Optional[dist.ProcessGroup],
        replicate_group: Optional[dist.ProcessGroup],
        group: Optional[dist.ProcessGroup] = None,
        capacity: BucketCapacity = DEFAULT_CAPACITY,
        check_each_collective: bool = False,
    ) -> None:
        reducer = ShardedMean(shard_group, replicate_group)
        self._rounds = GradientSynchronizer(named_parameters, group=group, reducer=reducer,
                                            capacity=capacity,
                                            check_each_collective=check_each_collective)
        self.optimizer = optimizer
        self.shard_group = shard_group
        self.shard_size = reducer.shard_size
        self.shard_rank = dist.get_rank(shard_group)
        params, names = self._rounds.parameters, self._rounds.parameter_names
        original_groups = [list(g["params"]) for g in optimizer.param_groups]
        where = {id(p): g for g, group_params in enumerate(original_groups) for p in group_params}
        group_of = {i: where.get(id(p), NOT_OPTIMIZED) for i, p in enumerate(params)}
        # a static plan: the optimizer must hold the shards before the first step (no usage-based adoption)
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        plan = plan_buckets(param_specs(params, trainable), capacity.first_bytes, capacity.bytes)
        plan = ordered_by_group(plan, group_of)
        self.shards = [shard_bucket(bucket, params, names, group_of, self.shard_size, self.shard_rank)
                       for bucket in plan.buckets]
        self.state_shard = OptimizerStateShard(optimizer, original_groups, self.shards, params, shard_group)
        """This rank's optimizer state in the forms checkpoints hold it (full, or this rank's own ranges)."""
        self._bound = False
        self.released = False
        """True after :meth:`release`: the parameters and the optimizer are whole again; nothing is sharded."""
        self._trainable = [p.requires_grad for p in params]
        self._rounds.fix_plan(plan, self)

    def pieces(self, optimized_only: bool = True) -> Iterator[Piece]:
        for shard in self.shards:
            for piece in shard.pieces:
                if piece.group != NOT_OPTIMIZED or not optimized_only:
                    yield piece

    # ------------------------------------------------------------------------------- the rounds (RoundSynchronizer)

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan, fixed at construction (each bucket's parameters ordered by optimizer param group)."""
        return self._rounds.plan

    @property
    def stats(self) -> SyncStats:
        return self._rounds.stats

    @property
    def reducer(self) -> BucketReducer:
        return self._rounds.reducer

    @property
    def parameters(self) -> Sequence[Parameter]:
        return self._rounds.parameters

    @property
    def parameter_names(self) -> Sequence[str]:
        return self._rounds.parameter_names

    @property
    def buffers(self) -> Sequence[BucketBuffer]:
        return self._rounds.buffers

    @property
    def recorder(self) -> Optional[SyncObserver]:
        return self._rounds.recorder

    @recorder.setter
    def recorder(self, recorder: Optional[SyncObserver]) -> None:
        self._rounds.recorder = recorder

    @property
    def ready_groups(self) -> Optional[Mapping[int, int]]:
        """Kept for the :class:`~lightning_static_dist.sync.contracts.RoundSynchronizer` readers; a fixed plan ignores it."""
        return self._rounds.ready_groups

    @ready_groups.setter
    def ready_groups(self, groups: Optional[Mapping[int, int]]) -> None:
        self._rounds.ready_groups = groups

    def attach(self) -> None:
        self._rounds.attach()

    def detach(self) -> None:
        self._rounds.detach()

    def no_sync(self) -> AbstractContextManager[None]:
        return self._rounds.no_sync()

    def finish(self) -> None:
        self._rounds.finish()

    def finish_if_pending(self) -> None:
        self._rounds.finish_if_pending()

    def abandon_round(self) -> None:
        self._rounds.abandon_round()

    def check_pending_rounds(self) -> None:
        self._rounds.check_pending_rounds()

    # ----------------------------------------------------------- the fixed plan's layout (BucketLayout)

    def make_buffer(self, bucket: GradBucket) -> BucketBuffer:
        """The bucket's padded buffer: its averaged chunk goes to this rank's pieces."""
        return _ShardBuffer(bucket, self._rounds.parameters, self.shards[bucket.index])

    def check_round(self) -> None:
        """Raise, naming it, if a parameter was frozen or unfrozen since the plan split them between the ranks."""
        for name, param, planned in zip(self._rounds.parameter_names, self._rounds.parameters, self._trainable):
            if param.requires_grad != planned:
                raise RuntimeError(
                    f"static_dist: {name!r} was {'unfrozen' if param.requires_grad else 'frozen'} during fit;"
                    " reduce_scatter splits the trainable parameters between ranks once, before the first step."
                    " Freeze or unfreeze before fit (a new fit plans again), or use strategy.sync.reduce='all_reduce'"
                )

    def round_done(self) -> None:
        for param in self._rounds.parameters:
            param.grad = None  # (the averages are the pieces'; a full-size gradient left here would only hold memory)

    # ---------------------------------------------------------------------------------------- the optimizer

    def bind(self) -> None:
        """Re-point the optimizer's param groups at this rank's pieces (in place: LR schedulers keep working)."""
        if self.optimizer.state:
            raise RuntimeError("static_dist: reduce_scatter re-points the optimizer before its first step; it already"
                               " has state (load a checkpoint through the Trainer instead)")
        for g, group in enumerate(self.optimizer.param_groups):
            group["params"] = [piece.param for piece in self.pieces() if piece.group == g]
        self._bound = True

    def unbind(self) -> None:
        """Give the optimizer its original parameters back, with its state in full form (collective)."""
        if not self._bound:
            return
        full = self.state_shard.full_optimizer_state()
        for group, params in zip(self.optimizer.param_groups, self.state_shard.original_groups):
            group["params"] = params
        self.optimizer.state.clear()
        self.optimizer.load_state_dict(full)
        self._bound = False

    # -------------------------------------------------------------------------------------- gathers, clipping

    def start_gather(self) -> None:
        """After the optimizer step: all-gather every bucket's updated chunk, asynchronously, in forward order."""
        if self.shard_size == 1:
            return  # the chunk *is* the parameters' storage
        for shard in reversed(self.shards):  # buckets are in backward order; the forward needs the last first
            if shard.work is not None:  # a bucket no forward waited for (a block skipped): finish it, then renew
                self.wait_gather([shard.bucket.index])
            shard.work = all_gather_single(shard.full, shard.chunk, group=self.shard_group, async_op=True)

    def wait_gather(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Wait for the gathers of ``buckets`` (all by default): their parameters are then current."""
        shards = self.shards if buckets is None else [self.shards[b] for b in buckets]
        for shard in shards:
            if shard.work is not None:
                with waiting_in(f"the all-gather of bucket {shard.bucket.index}'s parameters"):
                    shard.work.wait()
                shard.work = None

    def buckets_of(self, params: Iterable[Parameter]) -> list[int]:
        """The buckets holding any of ``params`` (to wait for before a module's forward)."""
        position = {id(p): i for i, p in enumerate(self.parameters)}
        location = self.plan.location
        found = {location[position[id(p)]][0] for p in params if id(p) in position and position[id(p)] in location}
        return sorted(found)

    def refresh_chunks(self) -> None:
        """After the parameters were overwritten (a checkpoint's weights loaded): copy them into the chunks."""
        self.wait_gather()
        if self.shard_size > 1:
            for shard in self.shards:
                shard.chunk.copy_(shard.full[shard.chunk_start : shard.chunk_start + shard.chunk.numel()])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the pieces' gradients by the global norm of the whole model's gradient (summed over the shard group;
        replica groups hold identical chunks). Equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""
        if norm_type != 2.0:
            raise ValueError(f"static_dist: reduce_scatter clips by the 2-norm only, got norm_type={norm_type}")
        grads = [piece.param.grad for piece in self.pieces() if piece.param.grad is not None]
        device = self.shards[0].full.device if self.shards else torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:  # a rank whose chunks are all padding still takes part in the sum
            squares += torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        if self.shard_size > 1:
            dist.all_reduce(squares, group=self.shard_group)
        total = squares.sqrt()[0]
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
        return total

    # ---------------------------------------------------------------------------------------------- teardown

    def release(self) -> None:
        """After training: wait for the gathers, give every parameter its own storage, the optimizer its original
        parameters and full state. Collective (the state is gathered)."""
        self.wait_gather()
        self.unbind()
        for param in self.parameters:
            param.data = param.data.clone()
        self.shards.clear()  # the flat buffers, chunks and pieces (the state shard's list too): nothing views them
        self._rounds.free_buffers()
        self.released = True
