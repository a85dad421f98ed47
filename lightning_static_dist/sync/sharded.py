"""``sync.reduce: reduce_scatter``: gradients reduce-scattered in a shard group, optimizer state split, parameters
all-gathered back — hybrid-sharded data parallelism from the same bucket plan as the all-reduce path.

Over a ``(dp_replicate, dp_shard)`` mesh of ``R x S`` ranks, one step is:

1. **backward** — the same gradient-ready hooks fill the same flat buckets (each padded to a multiple of ``S``). A
   full bucket is reduce-scattered over its shard group; its chunk is then all-reduced over the replica group — on
   Gloo as soon as the reduce-scatter completes (checked from later hooks), on NCCL at the end of backward in
   bucket order (NCCL needs collectives on several communicators issued in one order on every rank). Each rank ends backward holding the *average over all R x S ranks* of
   one ``1/S`` chunk of every bucket, written into the ``.grad`` of that chunk's optimizer parameters. The
   model's full ``param.grad`` is freed as soon as it is copied into its bucket.
2. **optimizer step** — the optimizer was re-pointed at the chunks: it holds state for ``1/S`` of every
   parameter. Within a bucket, parameters are ordered by optimizer param group, so a rank's chunk is at most one
   contiguous *piece* per group: each piece is one optimizer parameter in its own group, and weight decay,
   learning rate and every other group option apply exactly as before (any element-wise ``torch.optim``
   optimizer steps a piece exactly as it would step the slice of the whole tensor).
3. **all-gather** — after the step every bucket's updated chunks are all-gathered, asynchronously, into the flat
   buffer that *is* the parameters' storage (each parameter is a view of its bucket's buffer). The strategy waits
   for a bucket only where the next forward first needs it: in forward pre-hooks of the repeated blocks (the
   regions regional compile uses), everything else at the start of the training step.

Checkpoints hold the optimizer state in the *full* form an unsharded optimizer would write (gathered at save,
cut again at load), so a checkpoint resumes at any world size or mesh, and a plain Lightning run loads it.

Differences from DDP to know:

- every planned parameter is treated as used (a parameter that no rank used gets a zero gradient, not ``None``:
  with weight decay it decays), and freezing or unfreezing a parameter during ``fit`` is an error naming it;
- the model's ``param.grad`` is ``None`` after backward (the averaged gradients are the pieces' ``.grad``);
- between the optimizer step and the next forward the parameters are being gathered: a callback that reads them
  there (an EMA in ``on_train_batch_end``) must call :meth:`ShardedGradientSynchronizer.wait_gather` first;
- the optimizer sees flat pieces, so it must update each element from that element's gradient and state alone
  (SGD, Adam, AdamW, ... ; the strategy refuses LBFGS, Adafactor and SparseAdam; per-tensor trust ratios such
  as LAMB's would be computed per piece);
- gradient clipping by norm goes through :meth:`ShardedGradientSynchronizer.clip_grad_norm_`, which the strategy
  installs in place of the precision plugin's: the norm is summed over the shard group;
- at the end of ``fit`` (:meth:`ShardedGradientSynchronizer.release`) every rank holds the full optimizer state
  again, so that the optimizer is usable after ``fit``: a model whose state fits only sharded needs the memory
  for that once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_static_dist.checkpoint import FullSource, PieceSource, full_state_from_pieces, range_key, scalar_key
from lightning_static_dist.compat import all_gather_single, reduce_scatter_single
from lightning_static_dist.faults import waiting_in
from lightning_static_dist.sync.plan import BucketPlan, GradBucket, plan_buckets
from lightning_static_dist.sync.synchronizer import GradientSynchronizer, _BucketBuffer

NOT_OPTIMIZED = -1
"""Group of a trainable parameter that no optimizer param group holds: reduced, never stepped."""


# ---------------------------------------------------------------------------------------------------- layout


@dataclass
class Piece:
    """The part of this rank's chunk of a bucket that belongs to one optimizer param group: one optimizer parameter."""

    group: int
    param: Parameter
    start: int
    """Offset of the piece in the bucket's flat (padded) buffer."""
    end: int
    names: tuple[str, ...] = ()
    """The parameters the piece holds elements of."""


@dataclass
class BucketShard:
    """One bucket's parameter storage: the full flat buffer every parameter views, and this rank's chunk of it."""

    bucket: GradBucket
    full: Tensor
    """Length ``S * chunk_numel``; each parameter of the bucket is a view into it (the padding stays zero)."""
    chunk: Tensor
    """This rank's ``1/S`` (a copy when ``S > 1``, what the optimizer updates); the gather's input."""
    chunk_start: int
    pieces: list[Piece]
    work: Optional[dist.Work] = None
    """The all-gather in flight, if any."""


def _ordered_by_group(plan: BucketPlan, group_of: dict[int, int]) -> BucketPlan:
    """The same buckets with each bucket's parameters stably sorted by optimizer param group (offsets recomputed).

    Sorting inside a bucket changes no launch time (a bucket launches when *all* its gradients are ready) and
    makes each group one contiguous range, so a rank's chunk meets each group in at most one piece.
    """
    buckets, location = [], {}
    for bucket in plan.buckets:
        order = sorted(range(len(bucket.param_indices)), key=lambda s: group_of[bucket.param_indices[s]])
        indices = tuple(bucket.param_indices[s] for s in order)
        numels = tuple(bucket.numels[s] for s in order)
        offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
        for slot, index in enumerate(indices):
            location[index] = (bucket.index, slot)
        buckets.append(GradBucket(bucket.index, indices, offsets, numels, bucket.dtype, bucket.device))
    return BucketPlan(buckets=tuple(buckets), location=location)


# ---------------------------------------------------------------------------------------------- the reducer


class _ShardPending:
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
        self.poll = reducer.poll

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


class ShardedMean:
    """The bucket reducer of ``reduce_scatter``: averages over every rank, leaving this rank its chunk.

    ``launch`` gets the bucket's flat buffer ``[grads (padded to S * c) | usage flags]`` and returns a pending
    reduction whose ``wait()`` gives ``[averaged chunk (c) | averaged flags]``.
    The replica all-reduces are issued strictly in bucket order, from the gradient hooks (``poll``) once a
    reduce-scatter has completed, or at the latest from ``wait``.
    """

    def __init__(self, shard_group: Optional[dist.ProcessGroup], replicate_group: Optional[dist.ProcessGroup]) -> None:
        self.shard_group = shard_group
        self.shard_size = dist.get_world_size(shard_group)
        self.replicate_group = replicate_group if dist.get_world_size(replicate_group) > 1 else None
        # Gloo: each group runs on its own threads, so issuing a replica all-reduce the moment its reduce-scatter is
        # done (a local, timing-dependent decision) cannot deadlock. NCCL warns that collectives on several
        # communicators must be issued in the same order on every rank: there they are all issued at the end of
        # backward, in bucket order (the reduce-scatters still overlap backward).
        self._poll_replicas = self.replicate_group is not None and "nccl" not in dist.get_backend(self.replicate_group)
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

    def poll(self) -> None:
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


# ------------------------------------------------------------------------------------------- the synchroniser


class _ShardBuffer(_BucketBuffer):
    """A bucket buffer padded to a multiple of the shard size; the averaged chunk goes to the pieces' ``.grad``."""

    def __init__(self, bucket: GradBucket, params: Sequence[Parameter], shard: BucketShard) -> None:
        super().__init__(bucket, params, padded_numel=shard.full.numel())
        self.shard = shard

    def unpack(self, averaged: Tensor, params: Sequence[Parameter]) -> None:
        for piece in self.shard.pieces:
            piece.param.grad = averaged[piece.start - self.shard.chunk_start : piece.end - self.shard.chunk_start]


class ShardedGradientSynchronizer(GradientSynchronizer):
    """Reduce-scatter / all-reduce gradient synchronisation with optimizer state split over the shard group.

    Args:
        named_parameters: the model's ``named_parameters()`` (tied weights once).
        optimizer: the one optimizer; :meth:`bind` re-points its param groups at this rank's pieces.
        shard_group: the mesh's ``dp_shard`` group (this rank's).
        replicate_group: the mesh's ``dp_replicate`` group (this rank's).
        group: every data-parallel rank (usage flags and the ranks' step check are reduced over it).

    Example::

        sync = ShardedGradientSynchronizer(model.named_parameters(), optimizer, mesh.get_group("dp_shard"),
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
        first_bucket_mb: float = 1.0,
        bucket_mb: float = 25.0,
        check_each_collective: bool = False,
    ) -> None:
        reducer = ShardedMean(shard_group, replicate_group)
        super().__init__(named_parameters, group=group, reducer=reducer, first_bucket_mb=first_bucket_mb,
                         bucket_mb=bucket_mb, check_each_collective=check_each_collective)
        self.optimizer = optimizer
        self.shard_group = shard_group
        self.shard_size = reducer.shard_size
        self.shard_rank = dist.get_rank(shard_group)
        self._original_groups = [list(g["params"]) for g in optimizer.param_groups]
        self._original_index = {id(p): i for i, p in enumerate(p for params in self._original_groups for p in params)}
        """id(parameter) -> its index in the optimizer's own numbering (what a full-form state dict is keyed by)."""
        where = {id(p): g for g, params in enumerate(self._original_groups) for p in params}
        group_of = {i: where.get(id(p), NOT_OPTIMIZED) for i, p in enumerate(self._params)}
        # a static plan: the optimizer must hold the shards before the first step (no usage-based adoption)
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        plan = plan_buckets(self._specs(trainable), self._first_bucket_bytes, self._bucket_bytes)
        self._plan = _ordered_by_group(plan, group_of)
        self._first_round_done = True
        self.shards = [self._shard_bucket(bucket, group_of) for bucket in self._plan.buckets]
        self._buffers = [self._make_buffer(bucket) for bucket in self._plan.buckets]
        self._bound = False
        self.released = False
        """True after :meth:`release`: the parameters and the optimizer are whole again; nothing is sharded."""
        self._trainable = [p.requires_grad for p in self._params]
        self._reset_round()

    # -------------------------------------------------------------------------------------------- layout

    def _shard_bucket(self, bucket: GradBucket, group_of: dict[int, int]) -> BucketShard:
        chunk_numel = math.ceil(bucket.numel / self.shard_size)
        full = torch.zeros(chunk_numel * self.shard_size, dtype=bucket.dtype, device=bucket.device)
        ranges: list[tuple[int, int, int]] = []
        for index, offset, numel in zip(bucket.param_indices, bucket.offsets, bucket.numels):
            param = self._params[index]
            full[offset : offset + numel].copy_(param.detach().reshape(-1))
            param.data = full[offset : offset + numel].view(param.shape)  # the parameter now lives in the bucket
            group = group_of[index]
            if ranges and ranges[-1][0] == group:
                ranges[-1] = (group, ranges[-1][1], offset + numel)
            else:
                ranges.append((group, offset, offset + numel))
        start = self.shard_rank * chunk_numel
        chunk = full[start : start + chunk_numel]
        if self.shard_size > 1:
            chunk = chunk.clone()  # the gather writes `full`; the optimizer updates this
        pieces = []
        for group, lo, hi in ranges:
            lo, hi = max(lo, start), min(hi, start + chunk_numel)
            if lo < hi:
                names = tuple(self._names[i] for i, o, n in zip(bucket.param_indices, bucket.offsets, bucket.numels)
                              if o < hi and o + n > lo)
                pieces.append(Piece(group, Parameter(chunk[lo - start : hi - start]), lo, hi, names))
        return BucketShard(bucket, full, chunk, start, pieces)

    def _make_buffer(self, bucket: GradBucket) -> _BucketBuffer:
        return _ShardBuffer(bucket, self._params, self.shards[bucket.index])

    def pieces(self, optimized_only: bool = True) -> Iterator[Piece]:
        for shard in self.shards:
            for piece in shard.pieces:
                if piece.group != NOT_OPTIMIZED or not optimized_only:
                    yield piece

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
        full = self.full_optimizer_state()
        for group, params in zip(self.optimizer.param_groups, self._original_groups):
            group["params"] = params
        self.optimizer.state.clear()
        self.optimizer.load_state_dict(full)
        self._bound = False

    def full_optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` as an unsharded optimizer over the original parameters would give it.

        Every rank of the shard group contributes its :meth:`piece_tensors` (replica groups hold the same ones) and
        the whole is assembled the way a sharded checkpoint is consolidated. Collective over the shard group (every
        rank of it calls this: Lightning dumps checkpoints on every rank); the state comes back on the CPU.
        """
        pieces = {name: t.detach().to("cpu", copy=True) for name, t in self.piece_tensors().items()}
        if self.shard_size > 1:
            everyone: list[Any] = [None] * self.shard_size
            dist.all_gather_object(everyone, pieces, group=self.shard_group)
            pieces = {name: t for rank in everyone for name, t in rank.items()}
        state = full_state_from_pieces(PieceSource(pieces), self.original_shapes())
        return {"state": state, "param_groups": self.full_param_groups()}

    def load_full_optimizer_state(self, full: dict[str, Any]) -> None:
        """Load a full-form optimizer state (any world size or mesh wrote it, or an unsharded run): cut this rank's
        pieces out of it."""
        numels = {i: p.numel() for i, p in enumerate(self._originals())}
        self.load_optimizer_state(FullSource(full["state"], numels), full["param_groups"])

    def load_optimizer_state(self, source: Any, param_groups: list[dict[str, Any]]) -> None:
        """Cut this rank's pieces out of ``source`` (a :class:`~lightning_static_dist.checkpoint.FullSource` or
        :class:`~lightning_static_dist.checkpoint.PieceSource`) and load them with the saved group options."""
        if len(param_groups) != len(self._original_groups):
            raise ValueError(f"static_dist: the checkpoint's optimizer has {len(param_groups)} param groups,"
                             f" this one {len(self._original_groups)}")
        index = self._original_index
        owner = {id(piece.param): (shard, piece) for shard in self.shards for piece in shard.pieces}
        piece_state: dict[int, dict[str, Any]] = {}
        flat_index = 0
        groups = []
        for g, group in enumerate(self.optimizer.param_groups):
            ids = []
            for param in group["params"]:
                shard, piece = owner[id(param)]
                entry = self._cut_piece(shard, piece, source, index)
                if entry:
                    piece_state[flat_index] = entry
                ids.append(flat_index)
                flat_index += 1
            options = {k: v for k, v in param_groups[g].items() if k != "params"}
            groups.append({**options, "params": ids})
        self.optimizer.load_state_dict({"state": piece_state, "param_groups": groups})

    def _overlaps(self, shard: BucketShard, piece: Piece) -> Iterator[tuple[Parameter, int, int, int]]:
        """``(parameter, offset in the bucket, lo, hi)`` for each parameter the piece holds elements ``lo..hi`` of
        (bucket coordinates)."""
        for param_index, offset, numel in zip(shard.bucket.param_indices, shard.bucket.offsets, shard.bucket.numels):
            lo, hi = max(offset, piece.start), min(offset + numel, piece.end)
            if lo < hi:
                yield self._params[param_index], offset, lo, hi

    def _cut_piece(self, shard: BucketShard, piece: Piece, source: Any, index: dict[int, int]) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        for param, offset, lo, hi in self._overlaps(shard, piece):
            i = index[id(param)]
            for key, elementwise in source.keys(i).items():
                if not elementwise:
                    entry.setdefault(key, source.scalar(i, key))
                    continue
                values = source.elements(i, key, lo - offset, hi - offset)
                if key not in entry:
                    entry[key] = torch.zeros(piece.end - piece.start, dtype=values.dtype, device=piece.param.device)
                entry[key][lo - piece.start : hi - piece.start].copy_(values)
        return entry

    def _originals(self) -> list[Parameter]:
        return [p for params in self._original_groups for p in params]

    def wanted_ranges(self) -> list[tuple[int, int, int]]:
        """``(original parameter index, lo, hi)`` of every element this rank's optimizer state covers."""
        index = self._original_index
        return [(index[id(param)], lo - offset, hi - offset)
                for shard in self.shards for piece in shard.pieces if piece.group != NOT_OPTIMIZED
                for param, offset, lo, hi in self._overlaps(shard, piece)]

    def piece_tensors(self) -> dict[str, Tensor]:
        """This rank's optimizer state as ranges of the flattened original parameters (for a sharded checkpoint)."""
        index = self._original_index
        out: dict[str, Tensor] = {}
        for shard in self.shards:
            for piece in shard.pieces:
                state = self.optimizer.state.get(piece.param) if piece.group != NOT_OPTIMIZED else None
                for param, offset, lo, hi in self._overlaps(shard, piece) if state else ():
                    i = index[id(param)]
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece.param.numel():
                            out[range_key(i, key, lo - offset, hi - offset)] = value[lo - piece.start : hi - piece.start]
                        else:
                            out[scalar_key(i, key)] = value if torch.is_tensor(value) else torch.tensor(value)
        return out

    def full_param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups in full form: options, and the original parameters' indices."""
        index = self._original_index
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in params]}
                for group, params in zip(self.optimizer.param_groups, self._original_groups)]

    def original_shapes(self) -> dict[int, torch.Size]:
        return {i: p.shape for i, p in enumerate(self._originals())}

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
        position = {id(p): i for i, p in enumerate(self._params)}
        found = {self._plan.location[position[id(p)]][0] for p in params
                 if id(p) in position and position[id(p)] in self._plan.location}
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

    # --------------------------------------------------------------------------------------------- a round

    def _on_grad_ready(self, index: int, param: Parameter) -> None:
        super()._on_grad_ready(index, param)
        if self._sync_enabled and index in self._plan.location:
            param.grad = None  # copied into its bucket: the full-size gradient is not kept

    def finish(self) -> None:
        for name, param, planned in zip(self._names, self._params, self._trainable):
            if self._sync_enabled and param.requires_grad != planned:
                self.abandon_round()
                raise RuntimeError(
                    f"static_dist: {name!r} was {'unfrozen' if param.requires_grad else 'frozen'} during fit;"
                    " reduce_scatter splits the trainable parameters between ranks once, before the first step."
                    " Freeze or unfreeze before fit (a new fit plans again), or use strategy.sync.reduce='all_reduce'"
                )
        super().finish()
        if self._sync_enabled:
            for param in self._params:
                param.grad = None  # parameters whose gradient the hooks did not see (packed by finish)

    def release(self) -> None:
        """After training: wait for the gathers, give every parameter its own storage, the optimizer its original
        parameters and full state. Collective (the state is gathered)."""
        self.wait_gather()
        self.unbind()
        for param in self._params:
            param.data = param.data.clone()
        self.shards = []  # the flat buffers, chunks and pieces: nothing views them any more
        self._buffers = []
        self.released = True
