"""The built-in compressors: fp16/bf16, PowerSGD, TopK and QSGD (see :mod:`.base` for the protocol).

Each one averages the gradients it takes over the group in place, in as few collectives as its algorithm needs,
all of them asynchronous. Gradients it does not take (1-D tensors, tensors under ``min_numel`` elements) travel
exact, in fp32, in the bucket's uncompressed all-reduce.

Byte counts are this rank's payload: what it hands to the collective, not the algorithm's traffic on the wire
(an all-gather of k values *receives* ``world * k``; it *sends* k).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Generator, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.compression.base import (
    Compressor,
    PerParameterState,
    Phase,
    all_gather,
    all_reduce,
    averaged,
    flat_float,
    scatter_into,
)


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def _takes_matrix(shape: torch.Size, min_numel: int) -> bool:
    return len(shape) >= 2 and math.prod(shape) >= min_numel


class LowPrecisionCompressor(PerParameterState):
    """fp16 or bf16 all-reduce: every gradient divided by the world size (before the cast: see ``base.averaged``),
    cast, summed, cast back. Takes every gradient (1-D ones too: halving them costs no accuracy worth keeping fp32
    for); only the usage flags stay fp32.

    Example::

        StaticDistStrategy(compression={"name": "bf16"})
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.phases_per_bucket = 1
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def takes(self, shape: torch.Size) -> bool:
        return True

    def payload_bytes(self, shapes: Sequence[torch.Size]) -> int:
        return sum(math.prod(s) for s in shapes) * self.dtype.itemsize

    def phases(self, keys: Sequence[int], grads: Sequence[Tensor], world: int) -> Generator[Phase, None, None]:
        return averaged(grads, world, self.dtype)

    def safer(self) -> Optional[Compressor]:
        return LowPrecisionCompressor(torch.bfloat16) if self.dtype == torch.float16 else None


class PowerSGDCompressor(PerParameterState):
    """PowerSGD (Vogels et al., NeurIPS 2019): each gradient matrix M (n x m) sent as a rank-r product P Q^T.

    Two phases per bucket, each one all-reduce of every matrix's factor at once: P = M Q (averaged), P
    orthogonalised in fp32, Q = M^T P (averaged); M is replaced by P Q^T. With ``error_feedback`` each rank adds
    what compression dropped last step (M - P Q^T, its own) to the next gradient; with ``warm_start`` Q starts
    from the previous step's instead of a fresh random matrix (one power iteration per step then converges over
    steps). A matrix is only compressed when it saves at least ``min_compression_rate`` x its bytes.

    Example::

        StaticDistStrategy(compression={"name": "powersgd", "rank": 4})
    """

    name = "powersgd"
    STATE = ("residuals", "q")
    phases_per_bucket = 2
    guard_max_rel_error = 0.4
    """The guard's threshold, for every rank and option: between the errors of the ranks that kept the loss within
    1.03x of exact and of the first that did not (the critical-point sweeps, ``benchmarks/README.md``)."""

    def __init__(self, rank: int = 4, warm_start: bool = True, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, min_numel: int = 1024, seed: int = 0) -> None:
        self.rank = rank
        self.warm_start = warm_start
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.min_numel = min_numel
        self.seed = seed
        self.residuals: dict[int, Tensor] = {}
        self.q: dict[int, Tensor] = {}

    def _r(self, shape: torch.Size) -> int:
        n, m = _matrix_shape(shape)
        return min(self.rank, n, m)

    def takes(self, shape: torch.Size) -> bool:
        if not _takes_matrix(shape, self.min_numel):
            return False
        n, m = _matrix_shape(shape)
        return n * m >= self.min_compression_rate * self._r(shape) * (n + m)

    def payload_bytes(self, shapes: Sequence[torch.Size]) -> int:
        return sum(self._r(s) * sum(_matrix_shape(s)) for s in shapes) * 4

    def _initial_q(self, key: int, m: int, r: int, device: torch.device) -> Tensor:
        # the same on every rank without a collective: seeded by the parameter, not by the rank
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(str(key).encode()))
        return torch.randn(m, r, generator=generator).to(device)

    def phases(self, keys: Sequence[int], grads: Sequence[Tensor], world: int) -> Generator[Phase, None, None]:
        # Same-shaped matrices (a model's repeated blocks) go through every step together, as one batch: one matmul
        # and one QR per shape instead of one per matrix, which is what paces PowerSGD on a GPU (kernel launches).
        groups: dict[tuple[int, int], list[int]] = {}
        for i, grad in enumerate(grads):
            groups.setdefault(_matrix_shape(grad.shape), []).append(i)
        batches = []
        for (n, m), members in groups.items():
            group_keys = [keys[i] for i in members]
            batch = torch.stack([grads[i].reshape(n, m) for i in members]).float()  # a new tensor: M (B, n, m)
            if self.error_feedback:
                residuals = [self.residuals.get(k) for k in group_keys]
                if all(r is not None and r.shape == (n, m) for r in residuals):
                    batch += torch.stack(residuals)
                else:  # the first step, or a state saved at another layout: whatever residual fits
                    for b, residual in enumerate(residuals):
                        if residual is not None and residual.shape == (n, m):
                            batch[b] += residual
            r = min(self.rank, n, m)
            qs = [self.q.get(k) if self.warm_start else None for k in group_keys]
            qs = [q if q is not None and q.shape == (m, r) else self._initial_q(k, m, r, batch.device)
                  for k, q in zip(group_keys, qs)]
            batches.append((members, group_keys, batch, torch.stack(qs)))
        # phase 1: P = M Q for every matrix, averaged in one all-reduce
        p_flat = torch.cat([torch.bmm(batch, q).reshape(-1) for _, _, batch, q in batches]).div_(world)
        yield all_reduce(p_flat), p_flat.numel() * 4
        ps = _split(p_flat, [(batch.shape[0], batch.shape[1], q.shape[2]) for _, _, batch, q in batches])
        ps = [torch.linalg.qr(p, mode="reduced").Q for p in ps]  # fp32: orthogonalising in bf16 loses the basis
        # phase 2: Q = M^T P, averaged
        q_flat = torch.cat([torch.bmm(batch.transpose(1, 2), p).reshape(-1)
                            for (_, _, batch, _), p in zip(batches, ps)]).div_(world)
        yield all_reduce(q_flat), q_flat.numel() * 4
        qs = _split(q_flat, [q.shape for _, _, _, q in batches])
        targets, approxes = [], []
        for (members, group_keys, batch, _), p, q in zip(batches, ps, qs):
            approx = torch.bmm(p, q.transpose(1, 2))
            if self.error_feedback:
                batch.sub_(approx)  # this rank's own loss: M (with last residual) - average
                self.residuals.update(zip(group_keys, batch.unbind(0)))
            if self.warm_start:
                self.q.update(zip(group_keys, q.unbind(0)))
            targets += [grads[i] for i in members]
            approxes += [a.view(grads[i].shape) for a, i in zip(approx.unbind(0), members)]
        torch._foreach_copy_(targets, approxes)

    def safer(self) -> Optional[Compressor]:
        if self.rank < 16:
            return PowerSGDCompressor(self.rank * 2, self.warm_start, self.min_compression_rate, self.error_feedback,
                                      self.min_numel, self.seed)
        return LowPrecisionCompressor(torch.bfloat16)


class TopKCompressor(PerParameterState):
    """TopK sparsification (Deep Gradient Compression, Lin et al. 2018): send the ``density`` fraction of largest
    entries of each bucket, as (value, index) pairs, by one all-gather; every rank sums all ranks' pairs.

    The indices are chosen on every step from that step's gradient (plus the residual): nothing about them is
    compiled or cached. With ``error_feedback`` what was not sent is kept and added to the next step's gradient,
    which is what makes 1 % density converge.

    Example::

        StaticDistStrategy(compression={"name": "topk", "density": 0.01})
    """

    name = "topk"
    STATE = ("residuals",)
    phases_per_bucket = 1
    guard_max_rel_error = 0.15
    """The guard's threshold, for every density (how it was chosen: docs/internals.md, "compression/compressors.py").
    """

    def __init__(self, density: float = 0.01, error_feedback: bool = True, min_numel: int = 1024) -> None:
        self.density = density
        self.error_feedback = error_feedback
        self.min_numel = min_numel
        self.residuals: dict[int, Tensor] = {}
        self.last_indices: Optional[Tensor] = None
        """The indices this rank sent last (tests check they follow the gradients)."""

    def takes(self, shape: torch.Size) -> bool:
        return _takes_matrix(shape, self.min_numel)

    def _k(self, numel: int) -> int:
        return max(1, math.ceil(self.density * numel))

    def payload_bytes(self, shapes: Sequence[torch.Size]) -> int:
        return self._k(sum(math.prod(s) for s in shapes)) * 8  # fp32 value + int32 index

    def phases(self, keys: Sequence[int], grads: Sequence[Tensor], world: int) -> Generator[Phase, None, None]:
        acc = flat_float(grads)
        if self.error_feedback:
            offset = 0
            for key, g in zip(keys, grads):
                residual = self.residuals.get(key)
                if residual is not None and residual.numel() == g.numel():
                    acc[offset : offset + g.numel()] += residual
                offset += g.numel()
        k = self._k(acc.numel())
        indices = acc.abs().topk(k, sorted=False).indices
        values = acc[indices]
        if self.error_feedback:
            acc[indices] = 0.0  # what was sent leaves the residual
            offset = 0
            for key, g in zip(keys, grads):
                self.residuals[key] = acc[offset : offset + g.numel()].clone()
                offset += g.numel()
        self.last_indices = indices
        # one collective: values and the indices' bits side by side in one fp32 tensor
        payload = torch.cat([values, indices.to(torch.int32).view(torch.float32)])
        gathered = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
        yield all_gather(gathered, payload), payload.numel() * 4
        gathered = gathered.view(world, 2 * k)
        all_values = gathered[:, :k].reshape(-1)
        all_indices = gathered[:, k:].contiguous().view(torch.int32).reshape(-1).long()
        dense = torch.zeros_like(acc).index_add_(0, all_indices, all_values).div_(world)
        scatter_into(dense, grads)

    def safer(self) -> Optional[Compressor]:
        if self.density < 0.25:
            return TopKCompressor(min(1.0, self.density * 4), self.error_feedback, self.min_numel)
        return LowPrecisionCompressor(torch.bfloat16)


class QSGDCompressor(PerParameterState):
    """QSGD (Alistarh et al., NeurIPS 2017): each chunk of ``chunk`` values sent as its fp32 norm and, per value, a
    sign and a level in 0..``levels`` (int8), rounded stochastically so the average is unbiased.

    One all-gather of every rank's quantised bucket; each rank dequantises and averages in fp32. Unbiased, so no
    error feedback. Why one all-gather: docs/internals.md, "compression/compressors.py".

    Example::

        StaticDistStrategy(compression={"name": "qsgd", "levels": 127})
    """

    name = "qsgd"
    phases_per_bucket = 1
    guard_max_rel_error = 1.3
    """The guard's threshold, for every level (how it was chosen: docs/internals.md, "compression/compressors.py")."""

    def __init__(self, levels: int = 127, chunk: int = 512, min_numel: int = 1024, seed: int = 0) -> None:
        self.levels = levels
        self.chunk = chunk
        self.min_numel = min_numel
        self.seed = seed
        self._generator: Optional[torch.Generator] = None

    def takes(self, shape: torch.Size) -> bool:
        return _takes_matrix(shape, self.min_numel)

    def _chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def payload_bytes(self, shapes: Sequence[torch.Size]) -> int:
        n = self._chunks(sum(math.prod(s) for s in shapes))
        return n * self.chunk + n * 4  # int8 levels (padded to whole chunks) + fp32 norms

    def phases(self, keys: Sequence[int], grads: Sequence[Tensor], world: int) -> Generator[Phase, None, None]:
        acc = flat_float(grads)
        n_chunks = self._chunks(acc.numel())
        padded = torch.zeros(n_chunks * self.chunk, device=acc.device)
        padded[: acc.numel()] = acc
        chunks = padded.view(n_chunks, self.chunk)
        norms = chunks.norm(dim=1)
        scaled = chunks.abs() / norms.clamp_min(torch.finfo(torch.float32).tiny)[:, None] * self.levels
        if self._generator is None or self._generator.device != acc.device:
            # per rank: the rounding noise must be independent across ranks to average out
            rank = dist.get_rank() if dist.is_initialized() else 0
            self._generator = torch.Generator(device=acc.device).manual_seed(self.seed * 7919 + rank)
        noise = torch.rand(scaled.shape, generator=self._generator, device=acc.device)
        levels = (scaled.floor() + (noise < scaled - scaled.floor()).float()).mul_(chunks.sign())
        payload = torch.cat([levels.to(torch.int8).reshape(-1), norms.view(torch.int8)])
        gathered = torch.empty(world * payload.numel(), dtype=torch.int8, device=acc.device)
        yield all_gather(gathered, payload), payload.numel()
        gathered = gathered.view(world, -1)
        q = gathered[:, : n_chunks * self.chunk].float().view(world, n_chunks, self.chunk)
        all_norms = gathered[:, n_chunks * self.chunk :].contiguous().view(torch.float32).view(world, n_chunks, 1)
        average = (q * all_norms).sum(dim=0).div_(self.levels * world).reshape(-1)
        scatter_into(average[: acc.numel()], grads)

    def safer(self) -> Optional[Compressor]:
        return LowPrecisionCompressor(torch.bfloat16)


def _split(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(*shape))
        offset += n
    return out
