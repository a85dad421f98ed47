"""The bucket reducer of ``sync.reduce: reduce_scatter``: each bucket is reduce-scattered over the shard group, then
this rank's chunk is all-reduced over the replica group, so every rank ends with the average over all ``R x S`` ranks
of its own ``1/S`` of every bucket.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.compat import reduce_scatter_single
from lightning_static_dist.sync.plan import GradBucket
from lightning_static_dist.sync.bucket_reducer import BucketReducer, PendingReduction, runs_on_device_streams


class _ShardPending(PendingReduction):
    """A bucket's reduce-scatter (shard group) -> all-reduce of the chunk (replica group); the usage flags
    all-reduced over the world beside them."""

    def __init__(self, reducer: ShardedMean, work: Optional[dist.Work], out: Tensor, chunk_numel: int,
                 tail_work: Optional[dist.Work], tail: Tensor) -> None:
        self.reducer = reducer
        self.work = work
        """The reduce-scatter (the overlap recorder reads its completion)."""
        self.out = out
        self.chunk_numel = chunk_numel
        self.tail_work = tail_work
        self.tail = tail
        self.replica_work: Optional[dist.Work] = None
        self.replica_issued = reducer.replicate_group is None

    def issue_replica(self) -> None:
        if not self.replica_issued:
            self.replica_issued = True
            self.replica_work = dist.all_reduce(self.out[: self.chunk_numel], group=self.reducer.replicate_group,
                                                async_op=True)

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        self.reducer.issue_in_order(until=self)
        if self.replica_work is not None:
            self.replica_work.wait()
        if self.tail_work is not None:  # (with S == 1, `out` is the flat buffer and holds its own tail)
            self.tail_work.wait()
            self.out[self.chunk_numel :].copy_(self.tail)
        return self.out


class ShardedMean(BucketReducer):
    """The bucket reducer of ``reduce_scatter``: averages over every rank, leaving this rank its chunk.

    ``launch`` gets the bucket's flat buffer ``[grads (padded to S * c) | usage flags]`` and returns a pending
    reduction whose ``wait()`` gives ``[averaged chunk (c) | averaged flags]``.
    The replica all-reduces are issued strictly in bucket order, from the gradient hooks (:meth:`gradient_ready`)
    once a reduce-scatter has completed, or at the latest from ``wait``.

    Example::

        reducer = ShardedMean(mesh.get_group("dp_shard"), mesh.get_group("dp_replicate"))
        chunk_and_flags = reducer.launch(bucket, flat, group=mesh.get_group("dp")).wait()
    """

    def __init__(self, shard_group: Optional[dist.ProcessGroup], replicate_group: Optional[dist.ProcessGroup]) -> None:
        self.shard_group = shard_group
        self.shard_size = dist.get_world_size(shard_group)
        self.replicate_group = replicate_group if dist.get_world_size(replicate_group) > 1 else None
        # Gloo: each group runs on its own threads, so issuing a replica all-reduce the moment its reduce-scatter is
        # done (a local, timing-dependent decision) cannot deadlock. NCCL warns that collectives on several
        # communicators must be issued in the same order on every rank: there they are all issued at the end of
        # backward, in bucket order (the reduce-scatters still overlap backward).
        self._poll_replicas = self.replicate_group is not None and not runs_on_device_streams(self.replicate_group)
        self._in_flight: list[_ShardPending] = []

    def launch(self, bucket: GradBucket, flat: Tensor, group: Optional[dist.ProcessGroup]) -> _ShardPending:
        world = dist.get_world_size(group)
        chunk = (flat.numel() - len(bucket.param_indices)) // self.shard_size
        flat.div_(world)
        grads, tail = flat[: chunk * self.shard_size], flat[chunk * self.shard_size :]
        if self.shard_size == 1:  # a 4 x 1 mesh: the chunk is the bucket; one all-reduce over everyone
            work = dist.all_reduce(flat, group=group, async_op=True) if world > 1 else None
            pending = _ShardPending(self, work, flat, chunk, None, tail)
            pending.replica_issued = True
        else:
            out = torch.empty(chunk + tail.numel(), dtype=flat.dtype, device=flat.device)
            work = reduce_scatter_single(out[:chunk], grads, group=self.shard_group, async_op=True)
            tail_work = dist.all_reduce(tail, group=group, async_op=True)
            pending = _ShardPending(self, work, out, chunk, tail_work, tail)
        self._in_flight.append(pending)
        return pending

    def payload_bytes(self, bucket: GradBucket, flat: Tensor) -> int:
        return flat.numel() * flat.element_size()

    def gradient_ready(self) -> None:
        """Issue, in bucket order, the replica all-reduce of every chunk whose reduce-scatter has completed."""
        if not self._poll_replicas:
            return
        for pending in self._in_flight:
            if pending.replica_issued:
                continue
            if pending.work is not None and not pending.work.is_completed():
                return  # later buckets wait their turn: every rank issues the replica group's collectives alike
            pending.issue_replica()

    def issue_in_order(self, until: _ShardPending) -> None:
        for pending in self._in_flight:
            if not pending.replica_issued:
                if pending.work is not None:
                    pending.work.wait()
                pending.issue_replica()
            if pending is until:
                return

    def round_finished(self) -> None:
        self._in_flight.clear()

    def abandon_round(self) -> None:
        self._in_flight.clear()
