"""Bucket planning: which gradients travel together. Pure functions over parameter sizes; no processes, no hooks.

Buckets follow the order backward makes gradients ready (guessed as reverse registration order until the first
backward is observed), a small first bucket so that communication starts early, larger ones after; a compiled step's
pieces each get one bucket. A bucket holds one dtype on one device. The reasons: docs/synchroniser.md, "Buckets".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_static_dist.wording import counted

MiB = 1 << 20


@dataclass(frozen=True)
class BucketCapacity:
    """How many bytes of gradients a bucket holds: the first (small, so the first collective leaves early in
    backward) and every later one. The one place a size in MiB (``strategy.sync.first_bucket_mb`` / ``bucket_mb``,
    DDP's ``bucket_cap_mb``) becomes bytes; the synchronisers, the compiled step's cut and graph mode's inductor
    buckets all take it from here.

    Example::

        capacity = BucketCapacity.from_mib(first_mb=1, mb=25)
        plan = plan_buckets(specs, capacity.first_bytes, capacity.bytes)
    """

    first_bytes: int
    bytes: int

    @classmethod
    def from_mib(cls, first_mb: float, mb: float) -> BucketCapacity:
        return cls(int(first_mb * MiB), int(mb * MiB))

    @property
    def first_mib(self) -> float:
        return self.first_bytes / MiB

    @property
    def mib(self) -> float:
        return self.bytes / MiB


#: The one default bucket capacity: 1 MiB first (DDP's too), then 100 MiB (DDP's ``bucket_cap_mb`` is 25: fewer, larger
#: buckets cost less on fast links). ``strategy.sync.first_bucket_mb`` and ``bucket_mb`` default to it.
DEFAULT_CAPACITY = BucketCapacity.from_mib(1.0, 100.0)


@dataclass(frozen=True)
class ParamSpec:
    """What planning needs to know about a parameter: its position, size, dtype and device."""

    index: int
    """Position in the synchroniser's parameter list (registration order)."""
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class GradBucket:
    """One flat buffer of gradients that is reduced by one collective.

    ``offsets[i]`` is where the gradient of parameter ``param_indices[i]`` starts in the flat buffer.

    Example::

        bucket = plan.buckets[0]
        for index, offset, numel in zip(bucket.param_indices, bucket.offsets, bucket.numels): ...
    """

    index: int
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        """Number of gradient elements (the flat buffer may carry extra bookkeeping after them)."""
        return self.offsets[-1] + self.numels[-1] if self.offsets else 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of one model, in launch order, and where each parameter lives.

    Example::

        plan = plan_buckets(specs, first_bucket_bytes=1 << 20, bucket_bytes=25 << 20)
        bucket_index, slot = plan.location[param_index]
    """

    buckets: tuple[GradBucket, ...]
    location: dict[int, tuple[int, int]]
    """Parameter index -> (bucket index, slot within the bucket)."""

    @property
    def param_indices(self) -> frozenset[int]:
        return frozenset(self.location)

    def describe(self) -> str:
        """A one-line summary, identical on every rank for identical plans."""
        sizes = ", ".join(f"{b.nbytes / MiB:.2f}MiB/{len(b.param_indices)}p" for b in self.buckets)
        return f"{counted(len(self.buckets), 'bucket')} [{sizes}]"


def param_specs(params: Sequence[torch.Tensor], indices: Sequence[int]) -> list[ParamSpec]:
    """What planning needs to know of ``params[i]`` for each ``i`` in ``indices``."""
    return [ParamSpec(i, params[i].numel(), params[i].dtype, params[i].device) for i in indices]


def plan_buckets(
    params: Sequence[ParamSpec],
    first_bucket_bytes: int,
    bucket_bytes: int,
    ready_order: Sequence[int] = (),
    groups: Optional[Mapping[int, int]] = None,
) -> BucketPlan:
    """Group parameters into buckets in the order their gradients become ready.

    ``ready_order`` lists parameter indices in the order backward produced their gradients (observed on one rank and
    shared, so every rank plans alike); parameters missing from it follow in reverse registration order, which is
    also the whole order when ``ready_order`` is empty — backward's usual order without an observation. A bucket
    is closed when adding the next parameter would exceed its capacity (the first bucket's capacity is
    ``first_bucket_bytes``, every later one's ``bucket_bytes``) or when dtype or device change. A parameter larger
    than the capacity gets a bucket of its own.

    ``groups`` maps a parameter index to the graph piece whose backward makes its gradient ready: parameters of one
    piece share one bucket whatever its size, and a bucket never holds two pieces. Parameters without a group are
    bucketed by capacity as above, never together with grouped ones.

    Example::

        >>> specs = [ParamSpec(i, 1024, torch.float32, torch.device("cpu")) for i in range(4)]
        >>> [b.param_indices for b in plan_buckets(specs, 4096, 8192).buckets]
        [(3,), (2, 1), (0,)]
    """
    if first_bucket_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError(f"bucket capacities must be positive, got {first_bucket_bytes} and {bucket_bytes}")
    piece_of = groups or {}
    buckets_of_specs: list[list[ParamSpec]] = []
    filled = 0
    position = {index: i for i, index in enumerate(ready_order)}
    unobserved = len(position)
    for spec in sorted(params, key=lambda s: (position.get(s.index, unobserved), -s.index)):
        current = buckets_of_specs[-1] if buckets_of_specs else None
        capacity = first_bucket_bytes if len(buckets_of_specs) == 1 else bucket_bytes
        piece = piece_of.get(spec.index)
        if current is not None and current[0].dtype == spec.dtype and current[0].device == spec.device:
            same_piece = piece_of.get(current[0].index) == piece
            joins = same_piece and (piece is not None or filled + spec.nbytes <= capacity)
        else:
            joins = False
        if joins:
            current.append(spec)
            filled += spec.nbytes
        else:
            buckets_of_specs.append([spec])
            filled = spec.nbytes

    buckets = []
    location: dict[int, tuple[int, int]] = {}
    for b, group in enumerate(buckets_of_specs):
        offsets, numels, offset = [], [], 0
        for slot, spec in enumerate(group):
            offsets.append(offset)
            numels.append(spec.numel)
            offset += spec.numel
            location[spec.index] = (b, slot)
        buckets.append(
            GradBucket(
                index=b,
                param_indices=tuple(s.index for s in group),
                offsets=tuple(offsets),
                numels=tuple(numels),
                dtype=group[0].dtype,
                device=group[0].device,
            )
        )
    return BucketPlan(buckets=tuple(buckets), location=location)
