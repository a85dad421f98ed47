"""Where ``reduce_scatter`` puts each parameter: a bucket's flat buffer is the storage of its parameters, and each
rank of the shard group owns one ``1/S`` chunk of it, cut into one *piece* per optimizer param group.

Pure layout: no collectives. The sharded synchroniser (:mod:`~lightning_static_dist.sync.sharded_synchronizer`) builds it once,
before the first step; the optimizer-state forms of checkpoints (:mod:`~lightning_static_dist.sync.sharded_state`)
read it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_static_dist.sync.plan import BucketPlan, GradBucket

NOT_OPTIMIZED = -1
"""Group of a trainable parameter that no optimizer param group holds: reduced, never stepped."""


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
    """One bucket's parameter storage: the full flat buffer every parameter views, and this rank's chunk of it.

    Example::

        shard = shard_bucket(bucket, params, names, group_of, shard_size=2, shard_rank=0)
        shard.full          # every parameter of the bucket is a view into this
        shard.pieces[0].param   # what the optimizer steps
    """

    bucket: GradBucket
    full: Tensor
    """Length ``S * chunk_numel``; each parameter of the bucket is a view into it (the padding stays zero)."""
    chunk: Tensor
    """This rank's ``1/S`` (a copy when ``S > 1``, what the optimizer updates); the gather's input."""
    chunk_start: int
    pieces: list[Piece]
    work: Optional[dist.Work] = None
    """The all-gather in flight, if any."""


def ordered_by_group(plan: BucketPlan, group_of: dict[int, int]) -> BucketPlan:
    """The same buckets with each bucket's parameters stably sorted by optimizer param group (offsets recomputed):
    each group is one contiguous range of its bucket (why: docs/internals.md, "sync/shard_layout.py").
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


def shard_bucket(bucket: GradBucket, params: Sequence[Parameter], names: Sequence[str], group_of: dict[int, int],
                 shard_size: int, shard_rank: int) -> BucketShard:
    """Move the bucket's parameters into one flat buffer (each becomes a view of it) and cut this rank's chunk of it
    into pieces, one per optimizer param group it meets."""
    chunk_numel = math.ceil(bucket.numel / shard_size)
    full = torch.zeros(chunk_numel * shard_size, dtype=bucket.dtype, device=bucket.device)
    ranges: list[tuple[int, int, int]] = []
    for index, offset, numel in zip(bucket.param_indices, bucket.offsets, bucket.numels):
        param = params[index]
        full[offset : offset + numel].copy_(param.detach().reshape(-1))
        param.data = full[offset : offset + numel].view(param.shape)  # the parameter now lives in the bucket
        group = group_of[index]
        if ranges and ranges[-1][0] == group:
            ranges[-1] = (group, ranges[-1][1], offset + numel)
        else:
            ranges.append((group, offset, offset + numel))
    start = shard_rank * chunk_numel
    chunk = full[start : start + chunk_numel]
    if shard_size > 1:
        chunk = chunk.clone()  # the gather writes `full`; the optimizer updates this
    pieces = []
    for group, lo, hi in ranges:
        lo, hi = max(lo, start), min(hi, start + chunk_numel)
        if lo < hi:
            held = tuple(names[i] for i, o, n in zip(bucket.param_indices, bucket.offsets, bucket.numels)
                         if o < hi and o + n > lo)
            pieces.append(Piece(group, Parameter(chunk[lo - start : hi - start]), lo, hi, held))
    return BucketShard(bucket, full, chunk, start, pieces)


def overlaps(shard: BucketShard, piece: Piece,
             params: Sequence[Parameter]) -> list[tuple[Parameter, int, int, int]]:
    """``(parameter, offset in the bucket, lo, hi)`` for each parameter the piece holds elements ``lo..hi`` of
    (bucket coordinates)."""
    found = []
    for param_index, offset, numel in zip(shard.bucket.param_indices, shard.bucket.offsets, shard.bucket.numels):
        lo, hi = max(offset, piece.start), min(offset + numel, piece.end)
        if lo < hi:
            found.append((params[param_index], offset, lo, hi))
    return found
