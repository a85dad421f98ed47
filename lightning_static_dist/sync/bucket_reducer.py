"""The collective a full bucket launches: a pluggable operation (compression plugs in here).

A :class:`BucketReducer` turns a bucket's local flat gradients into a :class:`PendingReduction` whose ``wait()`` gives
back the averaged buffer of the same size, however many collectives it runs. The round's phases a reducer may take
part in are declared here with no-op defaults, so the synchroniser calls them on every reducer.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.simulate.group import BACKEND as SIMULATED_BACKEND
from lightning_static_dist.sync.plan import GradBucket


class PendingReduction(Protocol):
    """A reduction in flight. Subclass it (a protocol with a default) to inherit ``nbytes = None``."""

    nbytes: Optional[int] = None
    """This reduction's own count of the payload bytes this rank sends, when only the launch knew it (a compressing
    reducer chooses per bucket how to send it); ``None``: the reducer's :meth:`BucketReducer.payload_bytes`."""

    def wait(self) -> Tensor:
        """Block until the reduction is done; return the averaged flat buffer."""
        ...


class BucketReducer(Protocol):
    """Turns one bucket's local flat gradients into an asynchronous, averaging collective.

    ``launch`` and ``payload_bytes`` are what every reducer implements. The other three are phases of a round that a
    reducer with work spread over a round takes part in; subclass this protocol to inherit them as no-ops.

    Example::

        class MyReducer(BucketReducer):
            def launch(self, bucket, flat, group):
                ...  # start the collectives, return a PendingReduction whose wait() gives the averaged flat tensor
                return pending

            def payload_bytes(self, bucket, flat):
                return flat.numel() * flat.element_size()
    """

    def launch(self, bucket: GradBucket, flat: Tensor, group: Optional[dist.ProcessGroup]) -> PendingReduction:
        ...

    def payload_bytes(self, bucket: GradBucket, flat: Tensor) -> int:
        """Bytes this rank puts on the wire for this bucket (the payload, not the algorithm's traffic)."""
        ...

    def gradient_ready(self) -> None:
        """Called from every gradient-ready hook of a synchronised round, before the gradient's bucket is filled: work
        that must start from the hooks (the sharded reducer's replica all-reduces on Gloo). It runs once per
        parameter: keep it cheap."""

    def round_finished(self) -> None:
        """Called once a round's averages are written back: what a reducer does once per round."""

    def abandon_round(self) -> None:
        """Called when the synchroniser gives a round up after an exception: forget what is in flight, wait for
        nothing (a failed peer may never join it)."""


#: what the synchroniser calls on every reducer (the last three are phases :class:`BucketReducer` declares as no-ops)
REDUCER_METHODS = ("launch", "payload_bytes", "gradient_ready", "round_finished", "abandon_round")


def check_reducer(reducer: BucketReducer) -> BucketReducer:
    """``reducer``, if it has every method the synchroniser calls; else a ``TypeError`` naming the missing ones, where
    the reducer is plugged in rather than inside a gradient hook (where it would break backward, or hide the error
    a round was being given up for).

    Example::

        check_reducer(MeanAllReduce())    # returned as is
    """
    missing = [name for name in REDUCER_METHODS if not callable(getattr(reducer, name, None))]
    if missing:
        raise TypeError(f"static_dist: the bucket reducer {type(reducer).__name__} lacks {', '.join(missing)};"
                        " subclass lightning_static_dist.sync.BucketReducer to inherit the round phases as no-ops")
    return reducer


class _PendingWork(PendingReduction):
    def __init__(self, work: Optional[dist.Work], flat: Tensor) -> None:
        self.work = work
        """The collective's work handle (the overlap recorder reads its completion time)."""
        self._flat = flat
        self._waited = work is None

    def wait(self) -> Tensor:
        if not self._waited:
            assert self.work is not None
            self.work.wait()
            self._waited = True
        return self._flat


class MeanAllReduce(BucketReducer):
    """Average with one asynchronous ``all_reduce``: ``ReduceOp.AVG`` on NCCL (no separate division pass over the
    bucket), a sum of pre-divided values elsewhere (Gloo has no ``AVG``; why before the sum: docs/internals.md,
    "sync/bucket_reducer.py").

    Example::

        pending = MeanAllReduce().launch(bucket, flat, group)
        averaged = pending.wait()
    """

    def launch(self, bucket: GradBucket, flat: Tensor, group: Optional[dist.ProcessGroup]) -> PendingReduction:
        world = dist.get_world_size(group)
        if world == 1:
            return _PendingWork(None, flat)
        if supports_avg(group, flat.device):
            return _PendingWork(dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group, async_op=True), flat)
        flat.div_(world)
        return _PendingWork(dist.all_reduce(flat, group=group, async_op=True), flat)

    def payload_bytes(self, bucket: GradBucket, flat: Tensor) -> int:
        return flat.numel() * flat.element_size()


def supports_avg(group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """Whether the group averages tensors on ``device`` natively (``ReduceOp.AVG``): NCCL (CUDA tensors) and the
    simulated world do (so that a simulation takes NCCL's path), Gloo does not ("cpu:gloo,cuda:nccl" sends CPU
    tensors through Gloo)."""
    backend = dist.get_backend(group)
    return backend == SIMULATED_BACKEND or (device.type == "cuda" and "nccl" in backend)


def runs_on_device_streams(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether the group's collectives are queued on device streams and progress without the host (NCCL, and the
    simulated world, which stands for it), rather than on the backend's own threads that the host must poll (Gloo)."""
    backend = dist.get_backend(group)
    return "nccl" in backend or backend == SIMULATED_BACKEND


def all_reduce_sum(values: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Blocking sum over the group of a small bookkeeping tensor (usage masks): same dtype as given."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values
