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

1. Each parameter's post-accumulate-grad hook marks its slot of the bucket ready. When a bucket's last slot is
   ready, its gradients are copied into the bucket's flat buffer in one multi-tensor copy (cast to
   ``reduce_dtype`` if one is set) and every full bucket from the *next bucket to launch* onwards is launched, in
   plan order. Launching strictly in plan order is what keeps every rank issuing the same collectives in the same
   order even when hooks fire in a different order, or a parameter gets no gradient on one rank. With
   :attr:`~GradientSynchronizer.launch_during_backward` off (``sync.schedule: after_backward``) a full bucket is only
   copied into its buffer here (its gradients freed as with overlap), and step 2 issues them all.
2. ``finish()`` — queued on the autograd engine by the first hook, so it runs as backward returns — fills what the
   hooks did not (a parameter unused on this rank contributes zeros), launches the remaining buckets in order and
   makes the compute stream wait for each of them. Nothing in a round waits on the host.
3. With :attr:`~GradientSynchronizer.defer_waits` on (``sync.optimizer_overlap``, after_backward rounds only),
   ``finish()`` stops after the launches: :meth:`~GradientSynchronizer.settle` waits for the buckets in plan order up
   to one of them (the optimizer steps that bucket's parameters while later ones are in flight), and with no bucket
   named completes the round. Whatever may read the gradients next settles first (``no_sync``,
   ``finish_if_pending``, the step checks before a checkpoint, a switch between rounds, ``detach``; the strategy
   before each training batch); a round that adopts parameters into a new plan settles inside ``finish()``. A
   backward that starts with a round still pending is a ``RuntimeError``: by its first hook a new gradient is in
   ``param.grad`` already, and the pending averages would overwrite it (settle, or step, before the next backward).

Where the averages land. Without a ``reduce_dtype``, each ``param.grad`` *becomes a view of its slot* as soon as
its bucket is packed (the gradient autograd made is freed there), and the collective averages in place: there is
no copy back, and the model holds one copy of its gradients, not two. With ``reduce_dtype`` (bf16 for fp32
gradients) the same holds, and each bucket also has a persistent flat buffer in that dtype: sealing casts the bucket
into it (one kernel), the collective reduces it, and one more cast brings the averages back into the bucket. Keep that in mind when holding
on to ``param.grad`` across steps: like DDP's ``gradient_as_bucket_view``, it is reused by the next round.

No host synchronisation. A collective is averaged with ``ReduceOp.AVG`` on NCCL (pre-divided on Gloo, which has no
``AVG``). The usage flags are read on the host only for a bucket in which a parameter got no gradient on *this*
rank (otherwise every rank used it: nothing to read). The ranks check that they are in step with one small integer
all-reduce per round, issued after the round's buckets: the sums of their backward-pass numbers ``p`` and of
``p**2``. Integers add exactly, so ``world * sum(p**2) == sum(p)**2`` holds exactly when every rank is at the same
pass, and every rank sees the same sums — a rank whose pass equals the others' mean sees the spread too. The sums
reach the host asynchronously and are read at the start of the synchronised round two rounds later — long since
arrived, and at the same point of every rank's collective sequence — and on teardown or before a checkpoint is
written (waiting for them then); a mismatch stops every rank, each naming what it knows.

Unused parameters. Each bucket carries one usage flag per parameter after its gradients, reduced together with
them (a few bytes): a parameter that no rank used keeps ``grad = None`` instead of receiving an average of zeros,
so an optimizer with weight decay or momentum treats it exactly as it would without data parallelism.
Parameters that no rank used in the first round are left out of the plan. While the plan leaves out trainable
parameters, ``finish()`` runs one small all-reduce of their usage; when one of them gets a gradient on any rank
the plan is rebuilt — identically on every rank, from the same reduced mask — and the newcomers are reduced in a
one-off bucket in that same round. No hang, no dropped gradient. The first round is this same path with an empty
plan, so usage is decided collectively before the first bucket is planned.

A plan fixed up front (:meth:`GradientSynchronizer.fix_plan`) skips that: the sharded synchroniser runs its rounds
through this class with its own plan and buffers (:class:`~lightning_static_dist.sync.contracts.BucketLayout`).

Assumption: ``requires_grad`` of every parameter is the same on every rank (true when it is set by the same code).

Beside this module: the bucket buffer (:mod:`~lightning_static_dist.sync.buffer`), the ranks' step checks
(:mod:`~lightning_static_dist.sync.round_check`) and what a round expects of its reducer and its observer
(:mod:`~lightning_static_dist.sync.reducer`, :mod:`~lightning_static_dist.sync.contracts`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn import Parameter

from lightning_static_dist.processes.faults import waiting_in
from lightning_static_dist.sync.buffer import BucketBuffer
from lightning_static_dist.sync.contracts import BucketLayout, SyncObserver, SyncStats
from lightning_static_dist.sync.plan import (
    DEFAULT_CAPACITY,
    BucketCapacity,
    BucketPlan,
    GradBucket,
    param_specs,
    plan_buckets,
)
from lightning_static_dist.sync.reducer import BucketReducer, MeanAllReduce, PendingReduction, all_reduce_sum, check_reducer
from lightning_static_dist.sync.round_check import _RoundCheck, desynchronised, next_collective_mismatch

log = logging.getLogger(__name__)


class GradientSynchronizer:
    """Averages gradients over a process group with bucketed asynchronous collectives that overlap backward.

    Args:
        named_parameters: the model's ``named_parameters()``; duplicates (tied weights) are synchronised once.
        group: the data-parallel process group (``mesh.get_group("dp")``); ``None`` means the default group.
        reducer: the collective each full bucket launches; :class:`MeanAllReduce` by default.
        capacity: the bytes of the first bucket and of every later one (``BucketCapacity.from_mib(1, 25)``: 1 MiB,
            then 25 MiB, DDP's ``bucket_cap_mb``).
        check_each_collective: before each bucket's collective, compare it across ranks (debugging; slow).
        reduce_dtype: the dtype gradients are averaged in (``torch.bfloat16`` halves the bytes); ``None``: their own.

    Example::

        sync = GradientSynchronizer(model.named_parameters(), group=mesh.get_group("dp"),
                                    capacity=BucketCapacity.from_mib(first_mb=1, mb=25))
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
        capacity: BucketCapacity = DEFAULT_CAPACITY,
        check_each_collective: bool = False,
        reduce_dtype: Optional[torch.dtype] = None,
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
        self._reducer: BucketReducer = check_reducer(reducer) if reducer is not None else MeanAllReduce()
        self.capacity = capacity
        self._check_each_collective = check_each_collective
        self._reduce_dtype = reduce_dtype
        self._plan = BucketPlan(buckets=(), location={})
        self._buffers: list[BucketBuffer] = []
        self._layout: Optional[BucketLayout] = None
        """With a plan fixed up front (:meth:`fix_plan`): who makes its buffers and checks its rounds."""
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
        self.recorder: Optional[SyncObserver] = None
        """Set by the overlap monitor: marks buckets ready, issued and waited."""
        self.usage_counts: dict[str, int] = {}
        """Ranks that produced a gradient, per parameter outside the plan, from the latest usage check."""
        self.launch_during_backward = True
        """``strategy.sync.schedule``: ``True`` (``overlap``) issues each bucket's collective as soon as it is full;
        ``False`` (``after_backward``) fills the buckets during backward and issues them all, in plan order, when
        the round finishes. Between rounds only."""
        self.ready_groups: Optional[Mapping[int, int]] = None
        """``id(parameter)`` -> the compiled graph piece whose backward makes its gradient ready (set by the strategy
        when the model is compiled as one graph cut at the buckets): the plan puts each piece in a bucket of its own."""
        self.defer_waits = False
        """``strategy.sync.optimizer_overlap``: a round issued after backward (:attr:`launch_during_backward` off) leaves
        its waits to :meth:`settle`. Between rounds only."""
        self._unsettled: Optional[_RoundCheck] = None
        """The step check of a round whose waits :meth:`finish` left to :meth:`settle`; ``None``: none pending."""
        self._newcomers: list[int] = []
        self.stats = SyncStats()
        self._round_checks: deque[_RoundCheck] = deque()
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
        self.settle()
        if any(p is not None for p in self._pending):
            raise RuntimeError("static_dist: the bucket reducer cannot change while a round is in flight")
        self._reducer = check_reducer(reducer)

    def use_reduce_dtype(self, reduce_dtype: Optional[torch.dtype]) -> None:
        """Average in ``reduce_dtype`` (``None``: the gradients' own) from the next round on; between rounds. The
        buckets keep their gradients: only each bucket's cast buffer is made or freed."""
        self._between_rounds("the reduce dtype")
        self._reduce_dtype = reduce_dtype
        for buffer in self._buffers:
            buffer.use_reduce_dtype(reduce_dtype)

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group the rounds reduce over (``None``: the default group)."""
        return self._group

    @group.setter
    def group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Reduce over ``group`` — the same ranks, e.g. a communicator with other NCCL options — from the next round
        on; between rounds (the step checks already issued are read on the group they went out on)."""
        self._between_rounds("the process group")
        self._group = group

    def _between_rounds(self, what: str) -> None:
        self.settle()  # (a round left to settle() is complete as far as a switch between rounds goes)
        if any(p is not None for p in self._pending) or self._layout is not None:
            raise RuntimeError(f"static_dist: {what} of the synchroniser changes between rounds only, and not under a"
                               " fixed plan")

    def attach(self) -> None:
        """Register the gradient-ready hooks on every parameter that requires grad."""
        if self._plan.buckets and not self._buffers:  # attached again after detach()
            self._buffers = [self._make_buffer(bucket) for bucket in self._plan.buckets]
            self._reset_round()
        for index, param in enumerate(self._params):
            if param.requires_grad and index not in self._hooks:
                self._hooks[index] = param.register_post_accumulate_grad_hook(partial(self._on_grad_ready, index))

    def detach(self) -> None:
        """Remove the hooks and drop any round in flight (its collectives are waited for, results discarded); a round
        left to :meth:`settle` completes first."""
        self.settle()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.abandon_round()
        self.free_buffers()

    def free_buffers(self) -> None:
        """Drop the bucket buffers (one copy of the gradients); the plan and the counters stay readable, and the next
        :meth:`attach` makes the buffers again."""
        self.settle()
        self._buffers = []

    @property
    def buffers(self) -> Sequence[BucketBuffer]:
        """The bucket buffers of the current plan (empty before the first round and after :meth:`free_buffers`)."""
        return tuple(self._buffers)

    def fix_plan(self, plan: BucketPlan, layout: BucketLayout) -> None:
        """Reduce with ``plan`` in every round from now on, in the buffers ``layout`` makes; between rounds.

        The plan is not made from the first round's usage, so it must cover every trainable parameter, and the
        layout's :meth:`~BucketLayout.check_round` must stop a round that it no longer fits (a parameter unfrozen
        since would otherwise be adopted into a rebuilt plan). The sharded synchroniser fixes its plan this way: the
        optimizer holds the buckets' shards before the first step, so the plan cannot wait for the first round.
        """
        self.settle()
        self._plan = plan
        self._layout = layout
        self._first_round_done = True
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
        """Forget the round after an exception, without waiting: a failed peer may never join what is in flight (a round
        left to :meth:`settle` too: its gradients are not trusted)."""
        self._unsettled, self._newcomers = None, []
        self._finish_queued = self._finished_by_engine = False
        self._in_pass = self._pass_counted = False
        self._reducer.abandon_round()
        self._round_checks.clear()
        self._reset_round()

    # ------------------------------------------------------------------------------------------------- a round

    def _reset_round(self) -> None:
        for buffer in self._buffers:
            buffer.reset()
        self._pending: list[Optional[PendingReduction]] = [None] * len(self._plan.buckets)
        self._next_to_launch = 0
        self._settled = 0
        self._round_bytes = 0
        self._round_dense_bytes = 0
        self._observed_order = []

    def _on_grad_ready(self, index: int, param: Parameter) -> None:
        if not self._in_pass:
            if self._unsettled is not None:  # too late to settle: this hook's gradient is in ``param.grad`` already
                raise RuntimeError(_OPEN_ROUND)  # (the round stays pending: settle() still completes it)
            # count backward passes, synchronised or not: the number every bucket carries to check the ranks agree
            # (taken here, at the pass's first hook: a bucket may be sealed during backward or after it)
            self._in_pass = True
            self._pass_number = self.backward_passes
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
            if self._sync_enabled:
                self._read_round_checks()  # earlier rounds' verdicts, before this round launches anything
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
        self._reducer.gradient_ready()  # (the sharded reducer starts its replica all-reduces from here on Gloo)
        bucket_index, slot = location
        buffer = self._buffers[bucket_index]
        buffer.fill(slot, param.grad)
        if buffer.remaining == 0:
            if self.recorder is not None:
                self.recorder.bucket_ready(bucket_index)
            if self.launch_during_backward:
                self._launch_ready_buckets()
            else:  # (after_backward) copied in now, while backward runs: its gradients are freed, only the issue waits
                buffer.pack(self._params)

    def _launch_ready_buckets(self) -> None:
        while self._next_to_launch < len(self._buffers) and self._buffers[self._next_to_launch].remaining == 0:
            self._pending[self._next_to_launch] = self._launch(self._buffers[self._next_to_launch], self._next_to_launch)
            self._next_to_launch += 1

    def _launch(self, buffer: BucketBuffer, record_as: int) -> PendingReduction:
        if not buffer.packed:
            buffer.pack(self._params)
        flat = buffer.seal(self._pass_number)
        if self._check_each_collective:
            mismatch = next_collective_mismatch(record_as, buffer, self._group)
            if mismatch is not None:
                self.abandon_round()
                raise mismatch
        dense = flat.numel() * flat.element_size()
        pending = self._reducer.launch(buffer.bucket, flat, self._group)
        # a compressing reducer knows its payload only once it has chosen how to send this bucket
        # (a pending result that does not subclass PendingReduction has no ``nbytes``: the reducer's own count then)
        nbytes = getattr(pending, "nbytes", None)
        nbytes = nbytes if nbytes is not None else self._reducer.payload_bytes(buffer.bucket, flat)
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
        if not self._finished_by_engine:
            self.settle()  # (a pending round is an earlier backward's: this one made no gradient here)
        if not self._pass_counted:
            # a backward that produced no gradient on this rank still counts as a pass, as on the other ranks
            self._pass_number = self.backward_passes
            self.backward_passes += 1
            if self._sync_enabled:
                self._read_round_checks()
        self._pass_counted = False
        if self._finished_by_engine:
            self._finished_by_engine = False
            return
        self.finish()

    def finish(self) -> None:
        """End the round: launch what is left, make the compute stream wait for every collective (the host waits
        only on CPU, where the collective is the host's own work), give the parameters their averaged gradients.

        Runs by itself at the end of every backward pass in which a gradient became ready (queued on the autograd
        engine); call it — or :meth:`finish_if_pending` — after a backward in which none did, so that every rank
        takes part in the round's collectives. A no-op inside :meth:`no_sync`. With :attr:`defer_waits` on, a round
        issued after backward that adopts no parameter leaves its waits to :meth:`settle`.
        """
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
        for bucket_index, buffer in enumerate(self._buffers):
            unfilled = buffer.unfilled()
            for slot in unfilled:
                buffer.fill(slot, self._params[buffer.bucket.param_indices[slot]].grad)
            if unfilled and self.recorder is not None:
                self.recorder.bucket_ready(bucket_index)
        self._launch_ready_buckets()
        # 2. parameters outside the plan: decide together whether any of them got a gradient anywhere
        newcomers = self._reduce_usage_of_unplanned()
        # 3. the ranks' step check (after the buckets: the same place in every rank's sequence of collectives)
        self._unsettled = _RoundCheck(self._pass_number, self._group, self._check_device())  # (16 bytes: not counted)
        self._newcomers = newcomers
        # 4. the waits: left to settle() where the optimizer steps bucket by bucket, else here (a round that adopts
        # newcomers settles now: its plan changes before anyone could step by it)
        if not (self.defer_waits and not self.launch_during_backward) or newcomers or not self._first_round_done:
            self.settle()

    @property
    def unsettled(self) -> bool:
        """Whether a round's waits are left to :meth:`settle` (:attr:`defer_waits`)."""
        return self._unsettled is not None

    @property
    def settled_buckets(self) -> int:
        """Buckets of the current round whose averages have landed in their parameters' gradients."""
        return self._settled

    def settle(self, bucket_index: Optional[int] = None) -> None:
        """Make the compute stream wait for the round's collectives, in plan order, up to and including bucket
        ``bucket_index``, and give their parameters the averages; with no bucket named, all of them, and complete the
        round. A no-op when no round is pending (:meth:`finish` settles it unless :attr:`defer_waits` says not to)."""
        check = self._unsettled
        if check is None:
            return
        last = len(self._buffers) - 1 if bucket_index is None else min(bucket_index, len(self._buffers) - 1)
        while self._settled <= last:  # make the stream wait for each collective, and write back where a copy is needed
            bucket, pending = self._settled, self._pending[self._settled]
            assert pending is not None
            with waiting_in(f"the gradient collective of bucket {bucket}"):
                averaged = pending.wait()
            if self.recorder is not None:
                self.recorder.bucket_waited(bucket)
            self._buffers[bucket].unpack(averaged, self._params)
            self._settled += 1
        if bucket_index is not None:
            return
        newcomers, self._unsettled, self._newcomers = self._newcomers, None, []
        check.settle()
        self._round_checks.append(check)
        if newcomers or not self._first_round_done:
            self._adopt(newcomers)
        self.stats.rounds += 1
        self.stats.bytes_sent += self._round_bytes
        self.stats.last_round_bytes = self._round_bytes
        self.stats.last_round_dense_bytes = self._round_dense_bytes
        self._reducer.round_finished()
        self._reset_round()
        if self._layout is not None:
            self._layout.round_done()

    def _read_round_checks(self, keep: int = 1) -> None:
        """Stop on a backward-pass mismatch seen in an earlier round: read every verdict but the newest ``keep``.

        Called at the start of each synchronised round, before it issues anything (``keep=1``: the verdict of the
        round before last, which reached the host a whole step ago; the read waits only if the host is more than a
        step ahead). Rounds pair collectives, so every rank reads a given round's verdict at the same point of its
        collective sequence, even when the ranks' pass numbers differ; :meth:`check_pending_rounds` reads the rest."""
        while len(self._round_checks) > keep:
            check = self._round_checks.popleft()
            with waiting_in("the ranks' backward-pass check"):
                sums = check.sums()
            if sums is not None:
                self.abandon_round()
                raise desynchronised(*sums, check.own_pass, self._group)

    def check_pending_rounds(self) -> None:
        """Read the verdicts of the rounds not checked yet, waiting for them (the end of fit, before a checkpoint)."""
        self.settle()
        self._read_round_checks(keep=0)

    def _check_device(self) -> torch.device:
        """Where the step check's integers live: the gradients' device (NCCL reduces CUDA tensors only)."""
        return self._params[0].device if self._params else torch.device("cpu")

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
            one_off = plan_buckets(param_specs(self._params, newcomers), self.capacity.bytes, self.capacity.bytes)
            for i, bucket in enumerate(one_off.buckets):
                buffer = self._make_buffer(bucket)
                for slot, index in enumerate(bucket.param_indices):
                    buffer.fill(slot, self._params[index].grad)
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
        pieces = self.ready_groups or {}
        mine = (self._observed_order, {i: pieces[id(p)] for i, p in enumerate(self._params) if id(p) in pieces})
        observed, groups = _from_rank_zero(mine, self._group)
        self._ready_order = self._ready_order + [i for i in observed if i not in self._ready_order]
        self._plan = plan_buckets(param_specs(self._params, members), self.capacity.first_bytes, self.capacity.bytes,
                                  self._ready_order, groups=groups)
        self._buffers = [self._make_buffer(bucket) for bucket in self._plan.buckets]
        self.attach()  # parameters whose requires_grad was switched on since the last attach
        skipped = [self._names[i] for i, p in enumerate(self._params) if i not in self._plan.location and p.requires_grad]
        log.debug(
            f"{type(self).__name__}: plan {self._plan.describe()}"
            + (f"; unused so far: {', '.join(skipped)}" if skipped else "")
        )

    def _make_buffer(self, bucket: GradBucket) -> BucketBuffer:
        if self._layout is not None:
            return self._layout.make_buffer(bucket)
        buffer = BucketBuffer(bucket, self._params, reduce_dtype=self._reduce_dtype)
        buffer.alias_grads = True  # the flat buffer holds the gradients in their own dtype: averaged in place
        return buffer


_OPEN_ROUND = (
    "static_dist: a backward pass started while the previous round's gradient averages were still pending"
    " (sync.optimizer_overlap leaves them to the optimizer step): its new gradients would be overwritten by, or added"
    " to, the old averages. Step the optimizer (or call settle()) after every synchronised backward; in Lightning an"
    " overridden optimizer_step or backward that runs a backward without stepping needs"
    " strategy.sync.optimizer_overlap=false (auto turns it off)")


def _from_rank_zero(values: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """Rank 0's ``values`` on every rank (ranks may see hooks fire in different orders; plans must agree)."""
    if dist.get_world_size(group) == 1:
        return values
    holder = [values]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return holder[0]
