"""``CompressingReducer``: the synchroniser's bucket reducer when ``strategy.compression`` is on.

Per bucket it splits the slots into the ones the compressor takes and the rest; the rest (1-D and small gradients)
and the usage flags go in one exact fp32 all-reduce beside the compressor's first phase. Before ``start_step`` rounds
the bucket is reduced exactly. A non-finite gradient on any rank makes the average non-finite on every rank, so
every rank reaches the same verdict with no extra collective, and the compressor's state is restored from a
snapshot. Phase k of every bucket goes on its own group in bucket order. Why, and NCCL's ordering:
docs/how-it-works.md, "Compression".
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.compression.base import (
    Compressor,
    PerParameterState,
    Phase,
    averaged,
)
from lightning_static_dist.sync.plan import GradBucket
from lightning_static_dist.sync.bucket_reducer import BucketReducer, MeanAllReduce, PendingReduction, runs_on_device_streams


class _Stream:
    """One generator of phases: the phase it issued last and that collective's work."""

    def __init__(self, generator: Generator[Phase, None, None]) -> None:
        self.generator = generator
        self.phase = -1
        self.work: Optional[dist.Work] = None
        self.pending: Optional[Phase] = None
        self.done = False

    def fetch(self) -> None:
        """Run the generator to its next collective (after the current one is done)."""
        try:
            self.pending = next(self.generator)
        except StopIteration:
            self.pending, self.done = None, True


class PhasedReduction(PendingReduction):
    """A bucket's reduction: streams of phases, issued in an order every rank shares (see the module docstring).

    ``work`` is ``None``: no single collective ends it, so the overlap recorder times it until ``wait()`` returns.
    """

    work = None

    def __init__(self, reducer: CompressingReducer, flat: Tensor, generators: Sequence[Generator[Phase, None, None]],
                 nbytes: int, compressed: Sequence[Tensor], snapshot: Any, gradients: Tensor,
                 reference: Optional[Sequence[Tensor]] = None) -> None:
        self._reducer = reducer
        self._reference = reference
        self._flat = flat
        self._gradients = gradients
        """The bucket's gradient slots (its flat buffer without the usage flags): checked finite in one pass."""
        self._compressed = compressed
        self._snapshot = snapshot
        self._checked = False
        self.nbytes = nbytes
        """Payload bytes this rank sends for the bucket (predicted at launch)."""
        self.sent = 0
        """Payload bytes handed to collectives so far (equals ``nbytes`` once done)."""
        self._streams = [_Stream(g) for g in generators]
        for stream in self._streams:
            stream.fetch()

    @property
    def issued_phase(self) -> float:
        """The phase every stream of this bucket has issued (``inf`` when all are done)."""
        return min((math.inf if s.done else s.phase) for s in self._streams)

    def advance(self, limit: float, block: bool) -> None:
        """Issue what may be issued: phase k only when ``k <= limit`` (earlier buckets issued theirs)."""
        progress = True
        while progress:
            progress = False
            for stream in self._streams:
                if stream.work is not None:
                    if not (block or stream.work.is_completed()):
                        continue
                    stream.work.wait()  # no-op on Gloo once complete; on NCCL it orders later work after it
                    stream.work = None
                    stream.fetch()
                    progress = True
                if stream.pending is not None and stream.phase + 1 <= limit:
                    collective, nbytes = stream.pending
                    stream.pending = None
                    stream.phase += 1
                    stream.work = collective(self._reducer.group_for_phase(stream.phase))
                    self.sent += nbytes
                    progress = True
        if block and not self._checked and all(stream.done for stream in self._streams):
            self._checked = True
            finite = torch.isfinite(self._gradients).all()  # one pass over the bucket, not one per gradient
            if self._reference is None:
                # read on the host once per round, at its end (round_finished): a read per bucket here would stall
                # the host on the GPU bucket after bucket while it still has decompression and the step to queue
                self._reducer.verdicts.append((finite, self._snapshot))
            elif not bool(finite):  # the guard's check round reads its error sums on the host anyway
                self._reducer.compressor.restore(self._snapshot)
                self._reducer.nonfinite_buckets += 1
            else:
                for exact, compressed in zip(self._reference, self._compressed):
                    self._reducer.error_sq[0] += float((compressed.float() - exact.float()).square().sum())
                    self._reducer.error_sq[1] += float(exact.float().square().sum())

    def wait(self) -> Tensor:
        # the synchroniser waits in bucket order, so every earlier bucket is done and nothing limits this one
        self._reducer.poll(until=self)
        return self._flat


class CompressingReducer(BucketReducer):
    """A :class:`~lightning_static_dist.sync.bucket_reducer.BucketReducer` that compresses what its compressor takes.

    Example::

        reducer = CompressingReducer(PowerSGDCompressor(rank=4), [p.shape for p in sync.parameters])
        sync.reducer = reducer
    """

    def __init__(self, compressor: Compressor, shapes: Sequence[torch.Size], start_step: int = 0,
                 names: Optional[Sequence[str]] = None) -> None:
        self.compressor = compressor
        self._shapes = list(shapes)
        self._names = list(names) if names is not None else None
        """Parameter names: per-parameter state is saved under them, so a resumed run whose parameter list shifted
        (embedding sharding switched on, a frozen layer) cannot hand one layer's residual to another."""
        self.start_step = start_step
        self.rounds = 0
        """Synchronised rounds finished so far (compression starts at ``start_step``)."""
        self.nonfinite_buckets = 0
        """Buckets whose average came out non-finite (their compressor state was restored)."""
        self._exact = MeanAllReduce()
        self.measure = False
        """Set by the compression guard for one round: also average the compressed gradients exactly, to compare."""
        self.error_sq = [0.0, 0.0]
        """The measured round's sum of |g_hat - g|^2 and of |g|^2 over every compressed gradient."""
        self._group: Optional[dist.ProcessGroup] = None
        self._device: Optional[torch.device] = None
        self._phase_groups: list[Optional[dist.ProcessGroup]] = []
        self._chain: list[PhasedReduction] = []
        self._later_phases_at_wait = False
        """NCCL: phases after the first are issued only while the round is waited for (module docstring)."""
        self.verdicts: list[tuple[Tensor, Any]] = []
        """(is the bucket's average finite — on the device —, its compressor-state snapshot) per bucket this round."""

    # ------------------------------------------------------------------------------------------------ groups

    def _setup_groups(self, group: Optional[dist.ProcessGroup], phases: int) -> None:
        """One extra process group per phase after the first: created at the first launch, the same point of the
        same round on every rank (``new_group`` is collective)."""
        if self._group is not group:
            self._phase_groups = []
        self._group = group
        self._later_phases_at_wait = runs_on_device_streams(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        while len(self._phase_groups) < phases:
            self._phase_groups.append(group if not self._phase_groups else dist.new_group(ranks))

    def group_for_phase(self, phase: int) -> Optional[dist.ProcessGroup]:
        if phase >= len(self._phase_groups):
            raise RuntimeError(
                f"static_dist: compressor {self.compressor.name!r} yielded more than its phases_per_bucket"
                f" ({self.compressor.phases_per_bucket}) collectives for one bucket"
            )
        return self._phase_groups[phase]

    # ------------------------------------------------------------------------------------------------ a round

    def launch(self, bucket: GradBucket, flat: Tensor, group: Optional[dist.ProcessGroup]) -> PendingReduction:
        world = dist.get_world_size(group)
        taken = [slot for slot, i in enumerate(bucket.param_indices) if self.compressor.takes(self._shapes[i])]
        if world == 1 or not taken or self.rounds < self.start_step:
            return self._exact.launch(bucket, flat, group)
        self._device = flat.device
        if len(self._phase_groups) < self.compressor.phases_per_bucket or self._group is not group:
            self._setup_groups(group, max(1, self.compressor.phases_per_bucket))
        views = [flat[o : o + n].view(self._shapes[i]) for i, o, n in zip(bucket.param_indices, bucket.offsets, bucket.numels)]
        taken_set = set(taken)
        exact = [v for slot, v in enumerate(views) if slot not in taken_set] + [flat[bucket.numel :]]
        keys = [bucket.param_indices[slot] for slot in taken]
        compressed = [views[slot] for slot in taken]
        nbytes = self.compressor.payload_bytes([c.shape for c in compressed]) + sum(t.numel() for t in exact) * 4
        generators = [averaged(exact, world), self.compressor.phases(keys, compressed, world)]
        reference = None
        if self.measure:
            # the compression guard's check: the same gradients averaged exactly, beside the compressed average
            reference = [c.detach().clone() for c in compressed]
            generators.insert(0, averaged(reference, world))
            nbytes += sum(r.numel() for r in reference) * 4
        reduction = PhasedReduction(self, flat, generators, nbytes, compressed, self.compressor.snapshot(keys),
                                    flat[: bucket.numel], reference)
        self._chain.append(reduction)
        # issues its phase 0 now, behind earlier buckets' (launch order), and the later phases of earlier buckets
        # whose previous phase is done: completion is checked here, at bucket boundaries, not from every gradient hook
        self.poll()
        return reduction

    def poll(self, until: Optional[PhasedReduction] = None) -> None:
        """Issue every phase that may go now; with ``until``, drive the chain up to that reduction to the end."""
        limit = 0 if until is None and self._later_phases_at_wait else math.inf
        for reduction in self._chain:
            block = until is not None
            reduction.advance(limit, block)
            if reduction is until:
                break
            limit = min(limit, reduction.issued_phase)

    def payload_bytes(self, bucket: GradBucket, flat: Tensor) -> int:
        return flat.numel() * flat.element_size()  # the exact path's; a compressed launch reports its own

    def round_finished(self) -> None:
        if self.verdicts:  # one host read per round: restore the state of every bucket whose average was non-finite
            for finite, (_, snapshot) in zip(torch.stack([f for f, _ in self.verdicts]).tolist(), self.verdicts):
                if not finite:
                    self.compressor.restore(snapshot)
                    self.nonfinite_buckets += 1
        self.rounds += 1
        self._chain = []
        self.verdicts = []
        self.measure = False

    def abandon_round(self) -> None:
        """Forget the round's reductions (the synchroniser gave up on the round after an exception)."""
        self._chain = []
        self.verdicts = []
        self.measure = False
        self.error_sq = [0.0, 0.0]

    def take_relative_error(self) -> Optional[float]:
        """|g_hat - g| / |g| of the last measured round (``None`` if nothing was measured); resets the sums."""
        (diff, ref), self.error_sq = self.error_sq, [0.0, 0.0]
        if ref == 0.0:
            return None
        return (diff / ref) ** 0.5

    def switch_to(self, compressor: Compressor) -> None:
        """Continue with another compressor; same-named state (PowerSGD's residuals at a higher rank) carries over."""
        if compressor.name == self.compressor.name:
            compressor.load_state_dict(self.compressor.state_dict())
            move = getattr(compressor, "to", None)
            if move is not None and self._device is not None:
                move(self._device)
        self.compressor = compressor

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        state = self.compressor.state_dict()
        if self._names is not None and isinstance(self.compressor, PerParameterState):
            state = {kind: {self._names[k]: v for k, v in entries.items()} for kind, entries in state.items()}
        return {"rounds": self.rounds, "compressor": self.compressor.name, "state": state}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.rounds = int(state.get("rounds", 0))
        self._device = device  # a compressor switched to before the first launch (guard replay) moves here too
        if state.get("compressor") == self.compressor.name:
            saved = state.get("state", {})
            if self._names is not None and isinstance(self.compressor, PerParameterState):
                index = {name: i for i, name in enumerate(self._names)}
                saved = {kind: {index[n]: v for n, v in entries.items() if n in index} for kind, entries in saved.items()}
            self.compressor.load_state_dict(saved)
            move = getattr(self.compressor, "to", None)
            if move is not None:
                move(device)
