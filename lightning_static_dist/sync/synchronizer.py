"""The gradient synchroniser: post-accumulate-grad hooks fill flat buckets; a full bucket launches its collective.

Usable without Lightning::

    sync = GradientSynchronizer(model.named_parameters(), group=dist.group.WORLD)
    sync.attach()
    for x, y in data:
        loss_fn(model(x), y).backward()   # gradients are averaged over the group when backward returns
        sync.finish_if_pending()          # (completes a round in which no gradient became ready)
        optimizer.step()
        optimizer.zero_grad()

One *round* is one backward pass followed by :meth:`GradientSynchronizer.finish`:

1. Each parameter's post-accumulate-grad hook copies its gradient into its slot of the bucket's flat buffer. When
   a bucket's last slot is filled, every full bucket from the *next bucket to launch* onwards is launched, in plan
   order. Launching strictly in plan order is what keeps every rank issuing the same collectives in the same
   order even when hooks fire in a different order, or a parameter gets no gradient on one rank.
2. ``finish()`` — queued on the autograd engine by the first hook, so it runs as backward returns — fills what the
   hooks did not (a parameter unused on this rank contributes zeros), launches the remaining buckets in order,
   waits for all of them and writes the averages back into ``param.grad``.

Unused parameters. Each bucket carries one usage flag per parameter after its gradients, reduced together with
them (a few bytes): a parameter that no rank used keeps ``grad = None`` instead of receiving an average of zeros,
so an optimizer with weight decay or momentum treats it exactly as it would without data parallelism.
Parameters that no rank used in the first round are left out of the plan. While the plan leaves out trainable
parameters, ``finish()`` runs one small all-reduce of their usage; when one of them gets a gradient on any rank
the plan is rebuilt — identically on every rank, from the same reduced mask — and the newcomers are reduced in a
one-off bucket in that same round. No hang, no dropped gradient. The first round is this same path with an empty
plan, so usage is decided collectively before the first bucket is planned.

Assumption: ``requires_grad`` of every parameter is the same on every rank (true when it is set by the same code).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_static_dist.faults import waiting_in
from lightning_static_dist.fingerprint import RankMismatchError
from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.sync.plan import BucketPlan, GradBucket, MiB, ParamSpec, plan_buckets
from lightning_static_dist.sync.reducer import BucketReducer, MeanAllReduce, PendingReduction, all_reduce_sum

log = logging.getLogger(__name__)


@dataclass
class SyncStats:
    """Counters a user (and the run summary) can read: what the synchroniser did so far on this rank."""

    rounds: int = 0
    """Synchronised backward passes."""
    skipped_rounds: int = 0
    """Backward passes under :meth:`GradientSynchronizer.no_sync` (gradient accumulation)."""
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


class GradientSynchronizer:
    """Averages gradients over a process group with bucketed asynchronous collectives that overlap backward.

    Args:
        named_parameters: the model's ``named_parameters()``; duplicates (tied weights) are synchronised once.
        group: the data-parallel process group (``mesh.get_group("dp")``); ``None`` means the default group.
        reducer: the collective each full bucket launches; :class:`MeanAllReduce` by default.
        first_bucket_mb: capacity of the first bucket in MiB.
        bucket_mb: capacity of every later bucket in MiB.

    Example::

        sync = GradientSynchronizer(model.named_parameters(), group=mesh.get_group("dp"), bucket_mb=25)
        sync.attach()
        with sync.no_sync():            # accumulate locally, no communication
            model(x0).sum().backward()
            sync.finish()                 # a no-op inside no_sync
        model(x1).sum().backward()
        sync.finish()                     # one synchronisation of the accumulated gradients
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Parameter]],
        group: Optional[dist.ProcessGroup] = None,
        reducer: Optional[BucketReducer] = None,
        first_bucket_mb: float = 1.0,
        bucket_mb: float = 25.0,
        check_each_collective: bool = False,
    ) -> None:
        seen: set[int] = set()
        self._names: list[str] = []
        self._params: list[Parameter] = []
        for name, param in named_parameters:
            if id(param) not in seen:
                seen.add(id(param))
                self._names.append(name)
                self._params.append(param)
        self._group = group
        self._reducer: BucketReducer = reducer if reducer is not None else MeanAllReduce()
        self._first_bucket_bytes = int(first_bucket_mb * MiB)
        self._bucket_bytes = int(bucket_mb * MiB)
        self._check_each_collective = check_each_collective
        self._plan = BucketPlan(buckets=(), location={})
        self._buffers: list[_BucketBuffer] = []
        self._ready_order: list[int] = []
        """Gradient-ready order the plan follows: rank 0's observation of the first synchronised backward."""
        self._first_round_done = False
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._sync_enabled = True
        self._finish_queued = False
        self._finished_by_engine = False
        self._in_pass = False
        self._pass_counted = False
        self._pass_number = 0
        self.backward_passes = 0
        """Backward passes that produced a gradient here, with or without synchronisation (same on every rank)."""
        self.recorder: Optional[StepRecorder] = None
        """Set by the overlap monitor: marks buckets ready, issued and waited."""
        self.usage_counts: dict[str, int] = {}
        """Ranks that produced a gradient, per parameter outside the plan, from the latest usage check."""
        self.stats = SyncStats()
        self._reset_round()

    # ----------------------------------------------------------------------------------------------- lifecycle

    @property
    def plan(self) -> BucketPlan:
        """The current bucket plan (empty before the first synchronised round)."""
        return self._plan

    @property
    def parameter_names(self) -> Sequence[str]:
        return tuple(self._names)

    @property
    def parameters(self) -> Sequence[Parameter]:
        """The synchronised parameters (tied ones once); a bucket's ``param_indices`` index this list."""
        return tuple(self._params)

    @property
    def reducer(self) -> BucketReducer:
        """The collective each full bucket launches; replace it only between rounds (the compression guard does)."""
        return self._reducer

    @reducer.setter
    def reducer(self, reducer: BucketReducer) -> None:
        if any(p is not None for p in self._pending):
            raise RuntimeError("static_dist: the bucket reducer cannot change while a round is in flight")
        self._reducer = reducer

    def attach(self) -> None:
        """Register the gradient-ready hooks on every parameter that requires grad."""
        if self._plan.buckets and not self._buffers:  # attached again after detach()
            self._buffers = [self._make_buffer(bucket) for bucket in self._plan.buckets]
            self._reset_round()
        for index, param in enumerate(self._params):
            if param.requires_grad and index not in self._hooks:
                self._hooks[index] = param.register_post_accumulate_grad_hook(partial(self._on_grad_ready, index))

    def detach(self) -> None:
        """Remove the hooks and drop any round in flight (its collectives are waited for, results discarded)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.abandon_round()
        self._buffers = []  # one copy of the gradients: freed; plan and stats stay readable

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no collective is launched until the context exits."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def abandon_round(self) -> None:
        """Forget the round after an exception, without waiting: a failed peer may never join what is in flight."""
        self._finish_queued = self._finished_by_engine = False
        self._in_pass = self._pass_counted = False
        abandon = getattr(self._reducer, "abandon_round", None)
        if abandon is not None:
            abandon()
        self._reset_round()

    # ------------------------------------------------------------------------------------------------- a round

    def _reset_round(self) -> None:
        for buffer in self._buffers:
            buffer.reset()
        self._pending: list[Optional[PendingReduction]] = [None] * len(self._plan.buckets)
        self._next_to_launch = 0
        self._round_bytes = 0
        self._round_dense_bytes = 0
        self._poll: Optional[Callable[[], None]] = None
        """Starts the next phases of multi-phase reductions in flight (a compressing reducer's), from the hooks."""
        self._observed_order = []

    def _on_grad_ready(self, index: int, param: Parameter) -> None:
        if not self._in_pass:
            # count backward passes, synchronised or not: the number every bucket carries to check the ranks agree
            # (taken here, at the pass's first hook: a bucket may be sealed during backward or after it)
            self._in_pass = True
            self._pass_number = self.backward_passes
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        if not self._sync_enabled:
            return
        if not self._finish_queued:
            # finish the round when the autograd engine finishes this backward (what DDP's reducer does): code that
            # runs right after backward — Lightning's on_after_backward, a bare loss.backward() — sees averages
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_from_engine)
            self._finish_queued = True
        location = self._plan.location.get(index)
        if location is None:  # not planned yet: finish() finds its gradient and decides with every rank
            self._observed_order.append(index)
            return
        if self._poll is not None:
            self._poll()  # start the next phase of multi-phase reductions whose current one is done
        bucket_index, slot = location
        buffer = self._buffers[bucket_index]
        buffer.pack(slot, param.grad)
        if buffer.remaining == 0:
            if self.recorder is not None:
                self.recorder.bucket_ready(bucket_index)
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_to_launch < len(self._buffers) and self._buffers[self._next_to_launch].remaining == 0:
            self._pending[self._next_to_launch] = self._launch(self._buffers[self._next_to_launch], self._next_to_launch)
            self._next_to_launch += 1

    def _launch(self, buffer: _BucketBuffer, record_as: int) -> PendingReduction:
        flat = buffer.seal(self._pass_number)
        if self._check_each_collective:
            self._check_collective(record_as, buffer)
        dense = flat.numel() * flat.element_size()
        pending = self._reducer.launch(buffer.bucket, flat, self._group)
        # a compressing reducer knows its payload only once it has chosen how to send this bucket
        nbytes = getattr(pending, "nbytes", None)
        if nbytes is None:
            nbytes = self._reducer.payload_bytes(buffer.bucket, flat)
        self._poll = getattr(pending, "poll", None) or self._poll
        self._round_bytes += nbytes
        self._round_dense_bytes += dense
        self.stats.collectives += 1
        if self.recorder is not None:
            self.recorder.bucket_issued(record_as, nbytes, pending, dense_nbytes=dense)
        return pending

    def _end_pass(self) -> None:
        self._in_pass = False
        self._pass_counted = True
        self.backward_passes += 1

    def _finish_from_engine(self) -> None:
        self._finish_queued = False
        if self.recorder is not None:
            self.recorder.end("backward")  # what follows is waiting, not backward compute
        self.finish()
        self._finished_by_engine = True

    def finish_if_pending(self) -> None:
        """:meth:`finish`, unless the autograd engine already finished this backward's round (the usual case)."""
        if not self._pass_counted:
            # a backward that produced no gradient on this rank still counts as a pass, as on the other ranks
            self._pass_number = self.backward_passes
            self.backward_passes += 1
        self._pass_counted = False
        if self._finished_by_engine:
            self._finished_by_engine = False
            return
        self.finish()

    def finish(self) -> None:
        """End the round: launch what is left, wait for every collective, write the averaged gradients back.

        Runs by itself at the end of every backward pass in which a gradient became ready (queued on the autograd
        engine); call it — or :meth:`finish_if_pending` — after a backward in which none did, so that every rank
        takes part in the round's collectives. A no-op inside :meth:`no_sync`.
        """
        if not self._sync_enabled:
            self.stats.skipped_rounds += 1
            return
        # 1. planned buckets: fill the slots no hook filled (unused on this rank), launch in plan order
        for bucket_index, buffer in enumerate(self._buffers):
            unfilled = buffer.unfilled()
            for slot in unfilled:
                buffer.pack(slot, self._params[buffer.bucket.param_indices[slot]].grad)
            if unfilled and self.recorder is not None:
                self.recorder.bucket_ready(bucket_index)
        self._launch_ready_buckets()
        # 2. parameters outside the plan: decide together whether any of them got a gradient anywhere
        newcomers = self._reduce_usage_of_unplanned()
        # 3. wait and write back
        for bucket_index, (buffer, pending) in enumerate(zip(self._buffers, self._pending)):
            assert pending is not None
            with waiting_in(f"the gradient collective of bucket {bucket_index}"):
                averaged = pending.wait()
            if self.recorder is not None:
                self.recorder.bucket_waited(bucket_index)
            if not buffer.agrees_on_round(averaged, dist.get_world_size(self._group)):
                self._stop_desynchronised(bucket_index)
            buffer.unpack(averaged, self._params)
        if newcomers or not self._first_round_done:
            self._adopt(newcomers)
        self.stats.rounds += 1
        self.stats.bytes_sent += self._round_bytes
        self.stats.last_round_bytes = self._round_bytes
        self.stats.last_round_dense_bytes = self._round_dense_bytes
        round_finished = getattr(self._reducer, "round_finished", None)
        if round_finished is not None:
            round_finished()
        self._reset_round()

    def _check_collective(self, record_as: int, buffer: _BucketBuffer) -> None:
        """``sync.check: collective`` (debugging): before each bucket's collective, every rank compares what it is
        about to send — bucket, size, dtype, backward pass — in one small blocking all-gather."""
        world = dist.get_world_size(self._group)
        mine = torch.tensor([record_as, buffer.bucket.numel, len(buffer.bucket.param_indices), buffer.sealed_round],
                            dtype=torch.int64, device=buffer.flat.device)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=self._group)
        rows = [tuple(t.tolist()) for t in everyone]
        if len(set(rows)) > 1:
            self.abandon_round()
            listing = "; ".join(f"rank {r}: bucket {b}, {n} values, {p} parameters, backward pass {k}"
                                for r, (b, n, p, k) in enumerate(rows))
            raise RankMismatchError(f"static_dist: ranks disagree on the next gradient collective — {listing}")

    def _stop_desynchronised(self, bucket_index: int) -> None:
        """Every rank sees the mismatch in the same collective: gather the round numbers and stop, naming them."""
        passes: list[Optional[int]] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(passes, self._buffers[bucket_index].sealed_round, group=self._group)
        self.abandon_round()
        listing = ", ".join(f"rank {r} at backward pass {n}" for r, n in enumerate(passes))
        raise RankMismatchError(
            f"static_dist: ranks are in different steps — {listing} — seen in the collective of bucket {bucket_index}"
            " (a rank skipped a step, ran an extra backward, or took another data-dependent branch)"
        )

    def _reduce_usage_of_unplanned(self) -> list[int]:
        """Indices of unplanned parameters that got a gradient on any rank this round (same list on every rank)."""
        unplanned = [i for i, p in enumerate(self._params) if i not in self._plan.location and p.requires_grad]
        if not unplanned:
            return []
        device = self._params[unplanned[0]].device
        used = torch.tensor([self._params[i].grad is not None for i in unplanned], dtype=torch.float32, device=device)
        with waiting_in("the all-reduce of parameter usage"):
            all_reduce_sum(used, self._group)
        self._round_bytes += used.numel() * used.element_size()
        self._round_dense_bytes += used.numel() * used.element_size()
        self.stats.collectives += 1
        counts = used.tolist()
        self.usage_counts = {self._names[i]: int(count) for i, count in zip(unplanned, counts)}
        return [i for i, count in zip(unplanned, counts) if count > 0]

    def _adopt(self, newcomers: list[int]) -> None:
        """Reduce the newcomers' gradients in a one-off bucket this round, then rebuild the plan with them."""
        if newcomers:
            one_off = plan_buckets(self._specs(newcomers), self._bucket_bytes, self._bucket_bytes)
            for i, bucket in enumerate(one_off.buckets):
                buffer = _BucketBuffer(bucket, self._params)
                for slot, index in enumerate(bucket.param_indices):
                    buffer.pack(slot, self._params[index].grad)
                record_as = len(self._buffers) + i  # after the planned buckets of this round
                if self.recorder is not None:
                    self.recorder.bucket_ready(record_as)
                averaged = self._launch(buffer, record_as).wait()
                if self.recorder is not None:
                    self.recorder.bucket_waited(record_as)
                buffer.unpack(averaged, self._params)
        members = sorted(set(self._plan.location) | set(newcomers))
        if self._first_round_done:
            self.stats.plan_rebuilds += 1
        self._first_round_done = True
        observed = _rank_zero_list(self._observed_order, self._group)
        self._ready_order = self._ready_order + [i for i in observed if i not in self._ready_order]
        self._plan = plan_buckets(self._specs(members), self._first_bucket_bytes, self._bucket_bytes, self._ready_order)
        self._buffers = [self._make_buffer(bucket) for bucket in self._plan.buckets]
        self.attach()  # parameters whose requires_grad was switched on since the last attach
        skipped = [self._names[i] for i, p in enumerate(self._params) if i not in self._plan.location and p.requires_grad]
        log.debug(
            f"{type(self).__name__}: plan {self._plan.describe()}"
            + (f"; unused so far: {', '.join(skipped)}" if skipped else "")
        )

    def _make_buffer(self, bucket: GradBucket) -> _BucketBuffer:
        return _BucketBuffer(bucket, self._params)

    def _specs(self, indices: Sequence[int]) -> list[ParamSpec]:
        return [ParamSpec(i, self._params[i].numel(), self._params[i].dtype, self._params[i].device) for i in indices]


def _rank_zero_list(values: list[int], group: Optional[dist.ProcessGroup]) -> list[int]:
    """Group rank 0's ``values`` on every rank (ranks may see hooks fire in different orders; plans must agree)."""
    if dist.get_world_size(group) == 1:
        return values
    holder = [values]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return holder[0]


_ROUND_MODULUS = 1 << 12  # pass numbers travel as floats, divided by the world size and summed: keep them small
# enough that fp32 rounding stays far below the 0.25 / world tolerance on any world size


class _BucketBuffer:
    """A bucket's flat buffer — its gradients, one usage flag per parameter, a pass number — with slot views.

    The pass number (this rank's count of backward passes, accumulation micro-batches included) makes every
    collective check that the ranks are in the same step: averaged, it equals each rank's own number only if all
    agree. A rank that skipped a step — or ran an extra backward — pairs its bucket with another step's, and every
    rank sees it in that same collective.

    The views are made once per plan, so a gradient-ready hook costs one ``copy_`` and the write-back one more.
    """

    def __init__(self, bucket: GradBucket, params: Sequence[Parameter], padded_numel: Optional[int] = None) -> None:
        self.bucket = bucket
        self.grad_numel = bucket.numel if padded_numel is None else padded_numel
        """Where the gradients end and the flags start: the bucket's size, or that padded (zeros) for sharding."""
        self.flat = torch.zeros(self.grad_numel + len(bucket.param_indices) + 1, dtype=bucket.dtype, device=bucket.device)
        self.views = self._slot_views(self.flat, params)
        self.sealed_round = 0
        self.reset()

    def _slot_views(self, flat: Tensor, params: Sequence[Parameter]) -> list[Tensor]:
        b = self.bucket
        return [flat[o : o + n].view(params[i].shape) for i, o, n in zip(b.param_indices, b.offsets, b.numels)]

    def reset(self) -> None:
        self.used = [False] * len(self.bucket.param_indices)
        self.filled = [False] * len(self.bucket.param_indices)
        self.remaining = len(self.bucket.param_indices)

    def unfilled(self) -> list[int]:
        return [slot for slot, filled in enumerate(self.filled) if not filled]

    def pack(self, slot: int, grad: Optional[Tensor]) -> None:
        """Copy one parameter's local gradient (zeros if it has none) into its slot."""
        if self.filled[slot]:
            raise RuntimeError(
                "static_dist: a gradient became ready twice in one round (backward called twice without a"
                " synchronisation in between?). Use manual_backward once per step, or accumulate under no_sync."
            )
        if grad is None:
            self.views[slot].zero_()
        else:
            self.views[slot].copy_(grad)
        self.used[slot] = grad is not None
        self.filled[slot] = True
        self.remaining -= 1

    def seal(self, round_number: int) -> Tensor:
        """Write the usage flags (one op for the bucket) and the round number; return the flat buffer to reduce."""
        self.sealed_round = round_number % _ROUND_MODULUS
        self.flat[-1:].fill_(float(self.sealed_round))
        flags = self.flat[self.grad_numel : -1]
        if all(self.used):
            flags.fill_(1.0)  # the usual case, and no host-to-device copy that would wait for the GPU
        else:
            flags.copy_(torch.tensor(self.used, dtype=self.flat.dtype), non_blocking=True)
        return self.flat

    def unpack(self, averaged: Tensor, params: Sequence[Parameter]) -> None:
        """Write the averaged gradients back into ``param.grad`` for parameters some rank used."""
        views = self.views if averaged is self.flat else self._slot_views(averaged, params)
        used_anywhere = (averaged[self.grad_numel : -1] > 0).tolist()
        for slot, index in enumerate(self.bucket.param_indices):
            if not used_anywhere[slot]:
                continue  # no rank produced a gradient: leave it as it is (None), like single-process training
            param = params[index]
            if param.grad is None:
                param.grad = views[slot].clone()
            else:
                param.grad.copy_(views[slot])

    def agrees_on_round(self, averaged: Tensor, world: int) -> bool:
        """Whether every rank sealed the number this rank did (checked where the dtype holds it exactly: fp32/64)."""
        if self.flat.dtype not in (torch.float32, torch.float64):
            return True
        return abs(float(averaged[-1]) - self.sealed_round) < 0.25 / world
