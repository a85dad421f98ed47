"""A bucket's flat buffer: the gradients of one bucket side by side, then one usage flag per parameter.

Each parameter's slot is a view into it, made once per plan, so filling a bucket is one multi-tensor copy and the
averages land in place. With a reduce dtype a second, persistent buffer in that dtype is what travels, cast per
bucket in one kernel, not per parameter (docs/synchroniser.md: where the averages land).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_static_dist.sync.plan import GradBucket


class BucketBuffer:
    """A bucket's flat buffer — its gradients and one usage flag per parameter — with slot views.

    The views are made once per plan. A round marks slots ready (:meth:`fill`, host-only), copies the bucket's
    gradients in with one multi-tensor copy once all are ready (:meth:`pack`), and — unless ``alias_grads`` made the
    gradients views of their slots — copies the averages back with one more (:meth:`unpack`). With ``reduce_dtype``
    (different from the gradients'), :meth:`seal` returns :attr:`wire`, the bucket cast in one kernel, and
    :meth:`unpack` casts the averages back into the flat buffer in one more.

    Example::

        buffer = BucketBuffer(bucket, params)
        for slot, index in enumerate(bucket.param_indices):
            buffer.fill(slot, params[index].grad)
        buffer.pack(params)
        averaged = reducer.launch(bucket, buffer.seal(round_number), group).wait()
        buffer.unpack(averaged, params)
    """

    def __init__(self, bucket: GradBucket, params: Sequence[Parameter], padded_numel: Optional[int] = None,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.bucket = bucket
        self.grad_numel = bucket.numel if padded_numel is None else padded_numel
        """Where the gradients end and the flags start: the bucket's size, or that padded (zeros) for sharding."""
        self.flat = torch.zeros(self.grad_numel + len(bucket.param_indices), dtype=bucket.dtype, device=bucket.device)
        self.views = self._slot_views(self.flat, params)
        self.wire: Optional[Tensor] = None
        """The flat buffer in the reduce dtype, what the collective reduces (``None``: :attr:`flat` itself)."""
        self.use_reduce_dtype(reduce_dtype)
        self.alias_grads = False
        """Make each used parameter's ``.grad`` its slot's view when packing (the collective then averages in place)."""
        self.sealed_pass = 0
        self.used: list[bool] = []
        self.reset()

    def use_reduce_dtype(self, reduce_dtype: Optional[torch.dtype]) -> None:
        """Reduce in ``reduce_dtype`` from the next round on (``None`` or the gradients' own: in :attr:`flat`).
        Between rounds: the gradients stay views of :attr:`flat`; only the persistent cast buffer is made or freed."""
        if reduce_dtype is None or reduce_dtype == self.flat.dtype:
            self.wire = None
        elif self.wire is None or self.wire.dtype != reduce_dtype:
            self.wire = torch.empty_like(self.flat, dtype=reduce_dtype)

    def _slot_views(self, flat: Tensor, params: Sequence[Parameter]) -> list[Tensor]:
        b = self.bucket
        return [flat[o : o + n].view(params[i].shape) for i, o, n in zip(b.param_indices, b.offsets, b.numels)]

    def reset(self) -> None:
        self.packed = False
        """Whether this round's gradients are in the flat buffer already (:meth:`pack` ran)."""
        self.grads: list[Optional[Tensor]] = [None] * len(self.bucket.param_indices)
        self.filled = [False] * len(self.bucket.param_indices)
        self.remaining = len(self.bucket.param_indices)

    def unfilled(self) -> list[int]:
        return [slot for slot, filled in enumerate(self.filled) if not filled]

    def fill(self, slot: int, grad: Optional[Tensor]) -> None:
        """Mark one parameter's local gradient (``None``: it has none, zeros are sent) ready for its slot."""
        if self.filled[slot]:
            raise RuntimeError(
                "static_dist: a gradient became ready twice in one round (backward called twice without a"
                " synchronisation in between?). Use manual_backward once per step, or accumulate under no_sync."
            )
        self.grads[slot] = grad
        self.filled[slot] = True
        self.remaining -= 1

    def pack(self, params: Sequence[Parameter]) -> None:
        """Copy the bucket's gradients into the flat buffer: one multi-tensor copy (a cast, with a reduce dtype)."""
        self.used = [g is not None for g in self.grads]
        dst = [v for v, g in zip(self.views, self.grads) if g is not None]
        src = [g for g in self.grads if g is not None]
        if src:
            foreach_copy(dst, src)
        for slot, grad in enumerate(self.grads):
            if grad is None:
                self.views[slot].zero_()
            elif self.alias_grads:
                params[self.bucket.param_indices[slot]].grad = self.views[slot]
        self.grads = [None] * len(self.grads)  # the references the hooks handed over: freed now
        self.packed = True

    def seal(self, round_number: int) -> Tensor:
        """Write the usage flags (device ops only); return the flat buffer to reduce (with a reduce dtype: the whole
        bucket, gradients and flags, cast into :attr:`wire` by one kernel)."""
        self.sealed_pass = round_number
        flags = self.flat[self.grad_numel :]
        flags.fill_(1.0)
        for slot, used in enumerate(self.used):
            if not used:  # a parameter with no gradient on this rank (rare): one small op each, no host-to-device copy
                flags[slot].zero_()
        if self.wire is None:
            return self.flat
        self.wire.copy_(self.flat)
        return self.wire

    def unpack(self, averaged: Tensor, params: Sequence[Parameter]) -> None:
        """Give every parameter some rank used its averaged gradient: already in place (``alias_grads``), or copied.

        The averaged usage flags are read on the host only when a parameter of this bucket got no gradient on this
        rank: otherwise this rank used them all, so every parameter was used somewhere. Averages in :attr:`wire` are
        cast back into the flat buffer first (one kernel), and are then in place as well."""
        if self.wire is not None and averaged is self.wire:
            self.flat.copy_(averaged)
            averaged = self.flat
        in_place = self.alias_grads and averaged is self.flat
        views = self.views if averaged is self.flat else self._slot_views(averaged, params)
        if all(self.used):
            used_anywhere = self.used
        else:
            used_anywhere = (averaged[self.grad_numel :] > 0).tolist()
        dst, src = [], []
        for slot, index in enumerate(self.bucket.param_indices):
            if not used_anywhere[slot]:
                continue  # no rank produced a gradient: leave it as it is (None), like single-process training
            param = params[index]
            if in_place:
                param.grad = views[slot]  # (already, unless this rank had no gradient for it)
            elif param.grad is None:  # no gradient here, one elsewhere
                param.grad = views[slot].to(param.dtype, copy=True)
            else:
                dst.append(param.grad)
                src.append(views[slot])
        if src:
            foreach_copy(dst, src)


def foreach_copy(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all ``i`` in one multi-tensor launch where this torch has it."""
    copy_all = getattr(torch, "_foreach_copy_", None)
    if copy_all is not None:
        copy_all(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s)
