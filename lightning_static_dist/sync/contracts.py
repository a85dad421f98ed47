"""What the synchronisers promise the rest of the package, and what they expect of it, as protocols.

All three synchronisers (hooks, sharded, graph) are put in place and taken out (:class:`Synchronizer`); the first two
run rounds a participant ends after each backward (:class:`RoundSynchronizer`), report their buckets to an observer
they do not know (:class:`SyncObserver`), and the sharded one fixes its plan up front (:class:`BucketLayout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from torch.nn import Parameter

from lightning_static_dist.sync.buffer import BucketBuffer
from lightning_static_dist.sync.plan import BucketPlan, GradBucket
from lightning_static_dist.sync.bucket_reducer import BucketReducer


@dataclass
class SyncStats:
    """Counters a user (and the run summary) can read: what the synchroniser did so far on this rank."""

    rounds: int = 0
    """Synchronised backward passes."""
    skipped_rounds: int = 0
    """Backward passes under ``no_sync`` (gradient accumulation)."""
    collectives: int = 0
    """Collectives launched (bucket reductions and usage masks)."""
    bytes_sent: int = 0
    """Payload bytes this rank put on the wire, over all rounds."""
    last_round_bytes: int = 0
    """Payload bytes of the most recent synchronised round."""
    last_round_dense_bytes: int = 0
    """What the most recent round would have sent uncompressed (``compression_ratio`` = this / ``last_round_bytes``)."""
    plan_rebuilds: int = 0
    """Times the bucket plan changed after the first round (parameter usage changed)."""


class SyncObserver(Protocol):
    """Who times a round's buckets (the overlap monitor's recorder): told when each bucket's gradients are all ready,
    when its collective is issued and when the round waited for it. Every call must be cheap: they run in the hooks.

    Example::

        class Log:
            def end(self, phase): ...
            def bucket_ready(self, bucket): print("ready", bucket)
            def bucket_issued(self, bucket, nbytes, pending, dense_nbytes=None): ...
            def bucket_waited(self, bucket): ...

        sync.recorder = Log()
    """

    def end(self, phase: str) -> None:
        """The phase ``phase`` ended (``"backward"``: the autograd engine finished; what follows is waiting)."""
        ...

    def bucket_ready(self, bucket: int) -> None:
        ...

    def bucket_issued(self, bucket: int, nbytes: int, pending: Any, dense_nbytes: Optional[int] = None) -> None:
        """``pending``: the reducer's :class:`~lightning_static_dist.sync.bucket_reducer.PendingReduction` (its ``work``, if
        any, tells when the collective completed); ``dense_nbytes``: the bucket's size uncompressed."""
        ...

    def bucket_waited(self, bucket: int) -> None:
        ...


@runtime_checkable
class Synchronizer(Protocol):
    """What every synchroniser offers the step participants: it is put in place before the first step and taken out
    after the last.

    Example::

        sync: Synchronizer = GraphSynchronizer(model)   # or either of the hook-driven synchronisers
        sync.attach()
        ...                                             # train
        sync.detach()
    """

    def attach(self) -> None:
        ...

    def detach(self) -> None:
        ...


@runtime_checkable
class RoundSynchronizer(Synchronizer, Protocol):
    """A synchroniser driven by gradient-ready hooks, one *round* per synchronised backward: what the participant that
    runs its rounds, and the strategy's readers of it, use.

    Example::

        sync: RoundSynchronizer = GradientSynchronizer(model.named_parameters())   # or ShardedSynchronizer(...)
        sync.attach()
        loss.backward()
        sync.finish_if_pending()        # the round ends here if no gradient became ready on this rank
        sync.check_pending_rounds()     # before a checkpoint: the ranks were in step
    """

    recorder: Optional[SyncObserver]
    """Told of every bucket ready, issued and waited (set by the overlap monitor)."""
    ready_groups: Optional[Mapping[int, int]]
    """``id(parameter)`` -> the compiled graph piece that readies its gradient (a plan made later follows them)."""

    @property
    def plan(self) -> BucketPlan:
        ...

    @property
    def stats(self) -> SyncStats:
        ...

    @property
    def reducer(self) -> BucketReducer:
        ...

    @property
    def parameters(self) -> Sequence[Parameter]:
        ...

    @property
    def parameter_names(self) -> Sequence[str]:
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate locally: the rounds inside launch nothing."""
        ...

    def finish(self) -> None:
        ...

    def finish_if_pending(self) -> None:
        """End the round unless the autograd engine already did (the strategy calls it after every backward)."""
        ...

    def abandon_round(self) -> None:
        """Forget the round in flight after an exception, without waiting for any collective."""
        ...

    def check_pending_rounds(self) -> None:
        """Raise if an earlier round found the ranks at different backward passes (waits for the last verdicts)."""
        ...


class BucketLayout(Protocol):
    """A bucket plan's own buffers and checks, for a synchroniser whose plan is fixed before the first round (the
    sharded one: its parameters live in the buckets). Given to
    :meth:`~lightning_static_dist.sync.synchronizer.GradientSynchronizer.fix_plan`.

    Example::

        class Padded:
            def make_buffer(self, bucket): return BucketBuffer(bucket, params, padded_numel=...)
            def check_round(self): ...      # raise if the plan no longer fits the model
            def round_done(self): ...

        sync.fix_plan(plan, Padded())
    """

    def make_buffer(self, bucket: GradBucket) -> BucketBuffer:
        """The buffer ``bucket`` is reduced in (its :meth:`~BucketBuffer.unpack` decides where the averages go)."""
        ...

    def check_round(self) -> None:
        """Raise if the plan no longer fits (a parameter frozen since it was made): called as a synchronised round is
        finished, before the round's last buckets are launched; the round is then abandoned."""
        ...

    def round_done(self) -> None:
        """Called after a synchronised round was finished and its averages written back."""
        ...
