"""The gradient synchroniser: post-accumulate-grad hooks fill flat buckets; a full bucket launches its collective.

A *round* is one backward pass and :meth:`GradientSynchronizer.finish`, queued by the pass's first hook. Buckets
launch strictly in plan order, so every rank issues the same collectives whatever order its hooks fire in; nothing in
a round waits on the host. Assumes ``requires_grad`` of each parameter is the same on every rank. How a round works,
and why: docs/synchroniser.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn import Parameter

from lightning_static_dist.sync.adoption import PlanMembership
from lightning_static_dist.sync.buffer import BucketBuffer
from lightning_static_dist.sync.contracts import BucketLayout, SyncObserver, SyncStats
from lightning_static_dist.sync.plan import DEFAULT_CAPACITY, BucketCapacity, BucketPlan, GradBucket
from lightning_static_dist.sync.bucket_reducer import BucketReducer, MeanAllReduce, PendingReduction, check_reducer
from lightning_static_dist.sync.round import RoundCollectives
from lightning_static_dist.sync.round_check import StepChecks, _RoundCheck, next_collective_mismatch
from lightning_static_dist.sync.round_state import OPEN_ROUND, OVERLAP, RoundSchedule, RoundState

log = logging.getLogger(__name__)


class GradientSynchronizer:
    """Averages gradients over a process group with bucketed asynchronous collectives that overlap backward.

    Args:
        named_parameters: the model's ``named_parameters()``; duplicates (tied weights) are synchronised once.
        group: the data-parallel process group (``mesh.get_group("dp")``); ``None`` means the default group.
        reducer: the collective each full bucket launches; :class:`MeanAllReduce` by default.
        capacity: the bytes of the first bucket and of every later one (DDP's ``bucket_cap_mb``).
        check_each_collective: before each bucket's collective, compare it across ranks (debugging; slow).
        reduce_dtype: the dtype gradients are averaged in (``torch.bfloat16`` halves the bytes); ``None``: their own.
        schedule: when the buckets are issued and who waits for them (:meth:`follow` changes it between rounds).

    Example::

        sync = GradientSynchronizer(model.named_parameters(), group=mesh.get_group("dp"))
        sync.attach()
        with sync.no_sync():            # accumulate locally, no communication
            model(x0).sum().backward()
            sync.finish_if_pending()      # a no-op inside no_sync
        model(x1).sum().backward()        # averaged over the group as backward returns
        sync.finish_if_pending()          # (finishes a round in which no gradient became ready here)
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Parameter]],
        group: Optional[dist.ProcessGroup] = None,
        reducer: Optional[BucketReducer] = None,
        capacity: BucketCapacity = DEFAULT_CAPACITY,
        check_each_collective: bool = False,
        reduce_dtype: Optional[torch.dtype] = None,
        schedule: RoundSchedule = OVERLAP,
    ) -> None:
        self._members = PlanMembership(named_parameters, capacity)
        self._params = self._members.params  # (the same list: a bucket's ``param_indices`` index it)
        self._group = group
        self._reducer: BucketReducer = check_reducer(reducer) if reducer is not None else MeanAllReduce()
        self._check_each_collective = check_each_collective
        self._reduce_dtype = reduce_dtype
        self._buffers: list[BucketBuffer] = []
        self._layout: Optional[BucketLayout] = None
        """With a plan fixed up front (:meth:`fix_plan`): who makes its buffers and checks its rounds."""
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._sync_enabled = True
        """Off inside :meth:`no_sync`: a mode that spans passes, not a state of one."""
        self._state = RoundState.IDLE
        self._pass_number = 0
        self.backward_passes = 0
        """Backward passes that produced a gradient here, with or without synchronisation (same on every rank)."""
        self.recorder: Optional[SyncObserver] = None
        """Set by the overlap monitor: marks buckets ready, issued and waited."""
        self._schedule = schedule
        self._unsettled: Optional[_RoundCheck] = None
        """The step check of a round whose waits :meth:`finish` left to :meth:`settle`; ``None``: none pending."""
        self._newcomers: list[int] = []
        self.stats = SyncStats()
        self._round = RoundCollectives()
        self._round_checks = StepChecks()
        self._reset_round()

    # ----------------------------------------------------------------------------------------------- lifecycle

    @property
    def state(self) -> RoundState:
        """Where the current backward pass and its round stand."""
        return self._state

    @property
    def plan(self) -> BucketPlan:
        """The current bucket plan (empty before the first synchronised round)."""
        return self._members.plan

    @property
    def capacity(self) -> BucketCapacity:
        """The bytes of the first bucket and of every later one."""
        return self._members.capacity

    @property
    def ready_groups(self) -> Optional[Mapping[int, int]]:
        """``id(parameter)`` -> the compiled graph piece that makes its gradient ready: each piece gets own buckets."""
        return self._members.ready_groups

    @ready_groups.setter
    def ready_groups(self, groups: Optional[Mapping[int, int]]) -> None:
        self._members.ready_groups = groups

    @property
    def usage_counts(self) -> Mapping[str, int]:
        """Ranks that produced a gradient, per parameter outside the plan, from the latest usage check."""
        return self._members.usage_counts

    @property
    def parameter_names(self) -> Sequence[str]:
        return tuple(self._members.names)

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
        self.settle()
        if self._round.in_flight:
            raise RuntimeError("static_dist: the bucket reducer cannot change while a round is in flight")
        self._reducer = check_reducer(reducer)

    def use_reduce_dtype(self, reduce_dtype: Optional[torch.dtype]) -> None:
        """Average in ``reduce_dtype`` (``None``: the gradients' own) from the next round on; between rounds."""
        self._between_rounds("the reduce dtype")
        self._reduce_dtype = reduce_dtype
        for buffer in self._buffers:
            buffer.use_reduce_dtype(reduce_dtype)

    @property
    def schedule(self) -> RoundSchedule:
        """When the buckets are issued and who waits for them (``sync.schedule``, ``sync.optimizer_overlap``)."""
        return self._schedule

    def follow(self, schedule: RoundSchedule) -> None:
        """Issue and wait as ``schedule`` says from the next round on (a round left to :meth:`settle` completes
        first): the one way the synchroniser's schedule changes."""
        self.settle()
        self._schedule = schedule

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group the rounds reduce over (``None``: the default group)."""
        return self._group

    @group.setter
    def group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Reduce over ``group`` (the same ranks, e.g. other NCCL options) from the next round on; between rounds."""
        self._between_rounds("the process group")
        self._group = group

    def _between_rounds(self, what: str) -> None:
        self.settle()  # (a round left to settle() is complete as far as a switch between rounds goes)
        if self._round.in_flight or self._layout is not None:
            raise RuntimeError(f"static_dist: {what} of the synchroniser changes between rounds only, and not under a"
                               " fixed plan")

    def attach(self) -> None:
        """Register the gradient-ready hooks on every parameter that requires grad."""
        if self._members.plan.buckets and not self._buffers:  # attached again after detach()
            self._buffers = [self._make_buffer(bucket) for bucket in self._members.plan.buckets]
            self._reset_round()
        for index, param in enumerate(self._params):
            if param.requires_grad and index not in self._hooks:
                self._hooks[index] = param.register_post_accumulate_grad_hook(partial(self._on_grad_ready, index))

    def detach(self) -> None:
        """Remove the hooks and drop any round in flight; a round left to :meth:`settle` completes first."""
        self.settle()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.abandon_round()
        self.free_buffers()

    def free_buffers(self) -> None:
        """Drop the bucket buffers (one copy of the gradients); the next :meth:`attach` makes them again."""
        self.settle()
        self._buffers = []

    @property
    def buffers(self) -> Sequence[BucketBuffer]:
        """The bucket buffers of the current plan (none before the first round and after :meth:`free_buffers`)."""
        return tuple(self._buffers)

    def fix_plan(self, plan: BucketPlan, layout: BucketLayout) -> None:
        """Reduce with ``plan`` in every round from now on, in the buffers ``layout`` makes; between rounds. The plan
        must cover every trainable parameter, and ``layout.check_round`` stop a round it no longer fits (the sharded
        synchroniser: its optimizer holds the buckets' shards before the first round could make a plan)."""
        self.settle()
        self._members.fix(plan)
        self._layout = layout
        self._buffers = [self._make_buffer(bucket) for bucket in plan.buckets]
        self._reset_round()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no collective is launched until the context exits."""
        self.settle()  # (the next backward accumulates into the gradients a pending round still writes)
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def abandon_round(self) -> None:
        """Forget the round after an exception, without waiting: a failed peer may never join what is in flight."""
        self._unsettled, self._newcomers = None, []
        self._state = RoundState.IDLE
        self._reducer.abandon_round()
        self._round_checks.clear()
        self._reset_round()

    # ------------------------------------------------------------------------------------------------- a round

    def _reset_round(self) -> None:
        self._round.reset(self._buffers, len(self._members.plan.buckets))

    def _on_grad_ready(self, index: int, param: Parameter) -> None:
        if self._state is not RoundState.BACKWARD:
            if self._unsettled is not None:  # too late to settle: this hook's gradient is in ``param.grad`` already
                raise RuntimeError(OPEN_ROUND)  # (the round stays pending: settle() still completes it)
            # count passes, synchronised or not, at the first hook: the number every bucket carries to check the ranks
            self._state = RoundState.BACKWARD
            self._pass_number = self.backward_passes
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
            if self._sync_enabled:
                self._read_round_checks()  # earlier rounds' verdicts, before this round launches anything
                # finish as the engine finishes this backward (as DDP's reducer does): on_after_backward sees averages
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_from_engine)
        if not self._sync_enabled:
            return
        location = self._members.plan.location.get(index)
        if location is None:  # not planned yet: finish() finds its gradient and decides with every rank
            self._round.observed_order.append(index)
            return
        self._reducer.gradient_ready()  # (the sharded reducer starts its replica all-reduces from here on Gloo)
        bucket_index, slot = location
        buffer = self._buffers[bucket_index]
        buffer.fill(slot, param.grad)
        if buffer.remaining == 0:
            if self.recorder is not None:
                self.recorder.bucket_ready(bucket_index)
            if self._schedule.launch_during_backward:
                self._round.launch_ready(self._buffers, self._launch)
            else:  # (after_backward) copied in now, while backward runs: its gradients are freed, only the issue waits
                buffer.pack(self._params)

    def _launch(self, buffer: BucketBuffer, record_as: int) -> PendingReduction:
        if not buffer.packed:
            buffer.pack(self._params)
        flat = buffer.seal(self._pass_number)
        if self._check_each_collective:
            self._stop_on(next_collective_mismatch(record_as, buffer, self._group))
        pending, nbytes, dense = self._round.issue(self._reducer, buffer.bucket, flat, self._group)
        self.stats.collectives += 1
        if self.recorder is not None:
            self.recorder.bucket_issued(record_as, nbytes, pending, dense_nbytes=dense)
        return pending

    def _end_pass(self) -> None:
        self._state = RoundState.PASS_ENDED
        self.backward_passes += 1

    def _finish_from_engine(self) -> None:
        if self.recorder is not None:
            self.recorder.end("backward")  # what follows is waiting, not backward compute
        self.finish()
        self._state = RoundState.FINISHED

    def finish_if_pending(self) -> None:
        """:meth:`finish`, unless the autograd engine already finished this backward's round (the usual case)."""
        if self._state is not RoundState.FINISHED:
            self.settle()  # (a pending round is an earlier backward's: this one made no gradient here)
        if not self._state.pass_ended:
            # a backward that produced no gradient on this rank still counts as a pass, as on the other ranks
            self._pass_number = self.backward_passes
            self.backward_passes += 1
            if self._sync_enabled:
                self._read_round_checks()
        finished, self._state = self._state is RoundState.FINISHED, RoundState.IDLE
        if not finished:
            self.finish()

    def finish(self) -> None:
        """End the round: launch what is left, make the compute stream wait for every collective, give the
        parameters their averages. Runs by itself as a backward with a gradient here returns; call it (or
        :meth:`finish_if_pending`) after one without, so every rank joins the round. A no-op inside :meth:`no_sync`."""
        self.settle()  # (a round still pending is an earlier backward's)
        if not self._sync_enabled:
            self.stats.skipped_rounds += 1
            return
        if self._layout is not None:
            try:
                self._layout.check_round()
            except BaseException:
                self.abandon_round()
                raise
        # 1. planned buckets: fill the slots no hook filled (unused on this rank), launch in plan order
        self._round.fill_unfilled(self._buffers, self._params, self.recorder)
        self._round.launch_ready(self._buffers, self._launch)
        # 2. parameters outside the plan: decide together whether any of them got a gradient anywhere
        newcomers, nbytes = self._members.reduce_usage(self._group)
        if nbytes:  # (a collective only while the plan leaves out a trainable parameter)
            self._round.count(nbytes, nbytes)
            self.stats.collectives += 1
        # 3. the ranks' step check, after the buckets (the same place in every rank's sequence), on the gradients'
        # device (NCCL reduces CUDA tensors only); its 16 bytes are not counted
        device = self._params[0].device if self._params else torch.device("cpu")
        self._unsettled = _RoundCheck(self._pass_number, self._group, device)
        self._newcomers = newcomers
        # 4. the waits: left to settle() where the optimizer steps bucket by bucket, else here (and where the plan changes)
        if not self._schedule.leaves_waits or newcomers or not self._members.planned:
            self.settle()

    @property
    def unsettled(self) -> bool:
        """Whether a round's waits are left to :meth:`settle` (the schedule's ``defer_waits``)."""
        return self._unsettled is not None

    @property
    def settled_buckets(self) -> int:
        """Buckets of the current round whose averages have landed in their parameters' gradients."""
        return self._round.settled

    def settle(self, bucket_index: Optional[int] = None) -> None:
        """Wait for the round's collectives in plan order up to bucket ``bucket_index`` (none named: all of them,
        and complete the round), giving their parameters the averages. A no-op when no round is pending."""
        check = self._unsettled
        if check is None:
            return
        last = len(self._buffers) - 1 if bucket_index is None else min(bucket_index, len(self._buffers) - 1)
        self._round.settle(last, self._buffers, self._params, self.recorder)
        if bucket_index is not None:
            return
        newcomers, self._unsettled, self._newcomers = self._newcomers, None, []
        check.settle(f"bucket {len(self._buffers) - 1}" if self._buffers else "the round's gradients")
        self._round_checks.append(check)
        if newcomers or not self._members.planned:
            self._adopt(newcomers)
        self._round.add_to(self.stats)
        self._reducer.round_finished()
        self._reset_round()
        if self._layout is not None:
            self._layout.round_done()

    def _read_round_checks(self, keep: int = 1) -> None:
        """Stop on a backward-pass mismatch seen in an earlier round: read every verdict but the newest ``keep``."""
        self._stop_on(self._round_checks.read(keep, self._group))

    def _stop_on(self, mismatch: Optional[Exception]) -> None:  # (the ranks' disagreement, if any)
        if mismatch is not None:
            self.abandon_round()
            raise mismatch

    def check_pending_rounds(self) -> None:
        """Read the verdicts of the rounds not checked yet, waiting for them (the end of fit, before a checkpoint)."""
        self.settle()
        self._read_round_checks(keep=0)

    def _adopt(self, newcomers: list[int]) -> None:
        """Reduce the newcomers' gradients in a one-off bucket this round, then rebuild the plan with them."""
        if newcomers:
            buffers = [self._make_buffer(bucket) for bucket in self._members.one_off_plan(newcomers).buckets]
            self._round.reduce_at_once(buffers, len(self._buffers), self._launch, self._params, self.recorder)
        if self._members.rebuild(newcomers, self._round.observed_order, self._group):
            self.stats.plan_rebuilds += 1
        self._buffers = [self._make_buffer(bucket) for bucket in self._members.plan.buckets]
        self.attach()  # parameters whose requires_grad was switched on since the last attach
        log.debug(f"{type(self).__name__}: plan {self._members.describe()}")

    def _make_buffer(self, bucket: GradBucket) -> BucketBuffer:
        if self._layout is not None:
            return self._layout.make_buffer(bucket)
        buffer = BucketBuffer(bucket, self._params, reduce_dtype=self._reduce_dtype)
        buffer.alias_grads = True  # the flat buffer holds the gradients in their own dtype: averaged in place
        return buffer

