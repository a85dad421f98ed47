"""The compressor protocol: how a bucket's gradients become one or more *phases* of collectives.

A compressor averages this rank's gradients of the tensors it takes from one bucket *in place*. It is a generator:
each ``yield`` hands over one collective not yet issued (a function of the process group) and this rank's payload
bytes; the code after the ``yield`` runs once that collective is done. The reducer, not the compressor, issues the
collectives, so every rank issues each group's in one order (docs/how-it-works.md: Compression). State is kept per
parameter, not per bucket, so it survives a re-planned bucket layout and a checkpoint round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.compat import all_gather_single

Collective = Callable[[Optional[dist.ProcessGroup]], dist.Work]
"""Issues one asynchronous collective on the group it is given; returns its work handle."""

Phase = tuple[Collective, int]
"""A collective to issue and the payload bytes this rank sends with it."""


@runtime_checkable
class Compressor(Protocol):
    """Averages gradients over a process group with fewer bytes on the wire.

    Example::

        class SignCompressor:
            name = "sign"

            def takes(self, shape):
                return len(shape) >= 2

            def payload_bytes(self, shapes):
                return sum(s.numel() for s in shapes)

            def phases(self, keys, grads, world):
                signs = flat_float(grads).sign().to(torch.int8)
                gathered = torch.empty(world * signs.numel(), dtype=torch.int8)
                yield all_gather(gathered, signs), signs.numel()
                ...  # the collective is done here: write the average into grads

            def state_dict(self): return {}
            def load_state_dict(self, state): ...
            def snapshot(self, keys): return None
            def restore(self, snapshot): ...
            def safer(self): return None

        StaticDistStrategy(compression={"name": "my_pkg.SignCompressor"})

    Optional: ``guard_max_rel_error`` (a float), the relative gradient error above which the
    :class:`~lightning_static_dist.compression.guard.CompressionGuard` counts a check as bad when it was given no
    threshold of its own (``guard.DEFAULT_MAX_REL_ERROR`` for a class that names none).
    """

    name: str
    phases_per_bucket: int
    """How many collectives :meth:`phases` yields, one after the other (PowerSGD: 2)."""

    def takes(self, shape: torch.Size) -> bool:
        """Whether this compressor compresses a gradient of this shape (the rest travels exact, in fp32)."""
        ...

    def payload_bytes(self, shapes: Sequence[torch.Size]) -> int:
        """Bytes this rank sends for gradients of these shapes (what :meth:`phases` yields, summed)."""
        ...

    def phases(self, keys: Sequence[int], grads: Sequence[Tensor], world: int) -> Generator[Phase, None, None]:
        """Average ``grads`` (this rank's; ``keys`` name their parameters) over the ``world`` ranks in place."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (residuals, warm-start matrices), to be saved per rank."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    def snapshot(self, keys: Sequence[int]) -> Any:
        """What :meth:`restore` needs to undo one bucket's state update (the reducer calls it when the bucket's
        average came out non-finite: a residual must not carry a NaN into every later step)."""
        ...

    def restore(self, snapshot: Any) -> None:
        ...

    def safer(self) -> Optional["Compressor"]:
        """The next, less aggressive level (the compression guard's ladder); ``None``: no compression."""
        ...


def flat_float(grads: Sequence[Tensor]) -> Tensor:
    """The gradients concatenated into one new fp32 vector."""
    return torch.cat([g.reshape(-1).float() for g in grads])


def scatter_into(flat: Tensor, grads: Sequence[Tensor]) -> None:
    """Write consecutive pieces of ``flat`` back into ``grads`` (casting to their dtype)."""
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view(g.shape))
        offset += n


def contiguous_span(grads: Sequence[Tensor]) -> Optional[Tensor]:
    """One 1-D view covering ``grads`` when they lie one after the other in one storage (consecutive slots of a
    bucket's flat buffer), all of one dtype; ``None`` otherwise."""
    if not grads or any(g.dtype != grads[0].dtype or not g.is_contiguous() for g in grads):
        return None
    start = grads[0].storage_offset()
    offset = start
    for g in grads:
        if g.untyped_storage().data_ptr() != grads[0].untyped_storage().data_ptr() or g.storage_offset() != offset:
            return None
        offset += g.numel()
    return grads[0].as_strided((offset - start,), (1,), start)


def averaged(grads: Sequence[Tensor], world: int, dtype: torch.dtype = torch.float32) -> Generator[Phase, None, None]:
    """One phase: ``grads`` divided by the world size (before the cast: a large world's sum stays in fp16's range),
    sent as ``dtype``, summed, written back; slots that lie one after the other in the bucket's buffer are averaged
    where they are (docs/internals.md, "compression/base.py")."""
    span = contiguous_span(grads)
    if span is None:
        flat = flat_float(grads).div_(world).to(dtype)
    elif span.dtype == dtype:
        flat = span.div_(world)
    else:
        flat = torch.empty(span.numel(), dtype=dtype, device=span.device)
        torch.div(span, world, out=flat)
    yield all_reduce(flat), flat.numel() * flat.element_size()
    if flat is not span:
        if span is None:
            scatter_into(flat, grads)
        else:
            span.copy_(flat)


def all_reduce(tensor: Tensor) -> Collective:
    """A sum all-reduce of ``tensor`` in place, to be issued on a group (``.kind``: what the cost model prices)."""
    issue = lambda group: dist.all_reduce(tensor, group=group, async_op=True)  # noqa: E731
    issue.kind = "all_reduce"  # type: ignore[attr-defined]
    return issue


def all_gather(output: Tensor, tensor: Tensor) -> Collective:
    """Every rank's ``tensor`` concatenated into ``output`` (``world`` times its size), to be issued on a group."""
    issue = lambda group: all_gather_single(output, tensor, group=group, async_op=True)  # noqa: E731
    issue.kind = "all_gather"  # type: ignore[attr-defined]
    return issue


class PerParameterState:
    """State kept as dicts ``{parameter index: tensor}`` (attributes named in ``STATE``), *replaced* on update,
    never written in place — so a snapshot is a dict of references and costs no copy.

    Example::

        class MyCompressor(PerParameterState):
            STATE = ("residuals",)
    """

    STATE: tuple[str, ...] = ()

    def state_dict(self) -> dict[str, Any]:
        # a copy of each tensor's own elements: state may be views of a larger tensor (PowerSGD's batched residuals),
        # whose whole storage would otherwise be saved (and gathered) once per view
        return {name: {k: v.detach().to("cpu", copy=True) for k, v in getattr(self, name).items()}
                for name in self.STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.STATE:
            setattr(self, name, dict(state.get(name, {})))

    def to(self, device: torch.device) -> None:
        for name in self.STATE:
            setattr(self, name, {k: v.to(device) for k, v in getattr(self, name).items()})

    def snapshot(self, keys: Sequence[int]) -> Any:
        return {name: {k: getattr(self, name).get(k) for k in keys} for name in self.STATE}

    def restore(self, snapshot: Any) -> None:
        for name, entries in snapshot.items():
            state = getattr(self, name)
            for k, v in entries.items():
                if v is None:
                    state.pop(k, None)
                else:
                    state[k] = v
