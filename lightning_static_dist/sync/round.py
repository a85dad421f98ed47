"""The bucket collectives of the round in flight: issued strictly in plan order, waited for in plan order (why:
docs/synchroniser.md, the round's steps 1 and 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.sync.buffer import BucketBuffer
from lightning_static_dist.sync.contracts import SyncObserver, SyncStats
from lightning_static_dist.sync.plan import GradBucket
from lightning_static_dist.sync.bucket_reducer import BucketReducer, PendingReduction


class RoundCollectives:
    """What one round has issued, waited for and sent; the synchroniser starts it afresh each round (:meth:`reset`).

    Example::

        collectives = RoundCollectives()
        collectives.reset(buffers, len(buffers))
        collectives.launch_ready(buffers, launch)                 # every full bucket from the next one to launch on
        collectives.settle(len(buffers) - 1, buffers, params, recorder=None)
    """

    def __init__(self) -> None:
        self.pending: list[Optional[PendingReduction]] = []
        self.next_to_launch = 0
        self.settled = 0
        """Buckets whose averages have landed in their parameters' gradients."""
        self.bytes = 0
        """What this rank put on the wire this round (compressed where a reducer compresses)."""
        self.dense_bytes = 0
        """What the same collectives would have sent uncompressed."""
        self.observed_order: list[int] = []
        """Parameters outside the plan, in the order their gradients became ready here."""

    def reset(self, buffers: Sequence[BucketBuffer], buckets: int) -> None:
        """Start a new round of ``buckets`` collectives, the buffers emptied."""
        for buffer in buffers:
            buffer.reset()
        self.pending = [None] * buckets
        self.next_to_launch = 0
        self.settled = 0
        self.bytes = 0
        self.dense_bytes = 0
        self.observed_order = []

    @property
    def in_flight(self) -> bool:
        """Whether any collective of this round has been issued (and not forgotten by :meth:`reset`)."""
        return any(p is not None for p in self.pending)

    def count(self, nbytes: int, dense_nbytes: int) -> None:
        self.bytes += nbytes
        self.dense_bytes += dense_nbytes

    def fill_unfilled(self, buffers: Sequence[BucketBuffer], params: Sequence[Parameter],
                      recorder: Optional[SyncObserver]) -> None:
        """Fill the slots no hook filled (a parameter unused on this rank: its gradient, or zeros)."""
        for bucket_index, buffer in enumerate(buffers):
            unfilled = buffer.unfilled()
            for slot in unfilled:
                buffer.fill(slot, params[buffer.bucket.param_indices[slot]].grad)
            if unfilled and recorder is not None:
                recorder.bucket_ready(bucket_index)

    def issue(self, reducer: BucketReducer, bucket: GradBucket, flat: Tensor,
              group: Optional[dist.ProcessGroup]) -> tuple[PendingReduction, int, int]:
        """Launch ``bucket``'s collective on its sealed ``flat`` buffer and count what it sends: the pending result,
        the bytes on the wire and the bytes uncompressed."""
        dense = flat.numel() * flat.element_size()
        pending = reducer.launch(bucket, flat, group)
        # a compressing reducer knows its payload only once it has chosen how to send this bucket
        # (a pending result that does not subclass PendingReduction has no ``nbytes``: the reducer's own count then)
        nbytes = getattr(pending, "nbytes", None)
        nbytes = nbytes if nbytes is not None else reducer.payload_bytes(bucket, flat)
        self.count(nbytes, dense)
        return pending, nbytes, dense

    def launch_ready(self, buffers: Sequence[BucketBuffer],
                     launch: Callable[[BucketBuffer, int], PendingReduction]) -> None:
        """Issue every full bucket from the next one to launch on, stopping at the first that is not full."""
        while self.next_to_launch < len(buffers) and buffers[self.next_to_launch].remaining == 0:
            self.pending[self.next_to_launch] = launch(buffers[self.next_to_launch], self.next_to_launch)
            self.next_to_launch += 1

    def reduce_at_once(self, buffers: Sequence[BucketBuffer], first: int,
                       launch: Callable[[BucketBuffer, int], PendingReduction], params: Sequence[Parameter],
                       recorder: Optional[SyncObserver]) -> None:
        """Fill, launch and wait for ``buffers`` one by one, recorded as buckets ``first``, ``first + 1`` ... (the
        one-off buckets of parameters adopted this round, after the planned ones)."""
        for i, buffer in enumerate(buffers):
            for slot, index in enumerate(buffer.bucket.param_indices):
                buffer.fill(slot, params[index].grad)
            if recorder is not None:
                recorder.bucket_ready(first + i)
            pending = launch(buffer, first + i)
            with waiting_in(f"the gradient collective of bucket {first + i}"):
                averaged = pending.wait()
            if recorder is not None:
                recorder.bucket_waited(first + i)
            buffer.unpack(averaged, params)

    def add_to(self, stats: SyncStats) -> None:
        """Count this round, complete, in ``stats``."""
        stats.rounds += 1
        stats.bytes_sent += self.bytes
        stats.last_round_bytes = self.bytes
        stats.last_round_dense_bytes = self.dense_bytes

    def settle(self, last: int, buffers: Sequence[BucketBuffer], params: Sequence[Parameter],
               recorder: Optional[SyncObserver]) -> None:
        """Make the compute stream wait for each collective up to bucket ``last``, in plan order, and give their
        parameters the averages (written back where the bucket is not the gradients' own memory)."""
        while self.settled <= last:
            bucket, pending = self.settled, self.pending[self.settled]
            assert pending is not None
            with waiting_in(f"the gradient collective of bucket {bucket}"):
                averaged = pending.wait()
            if recorder is not None:
                recorder.bucket_waited(bucket)
            buffers[bucket].unpack(averaged, params)
            self.settled += 1
