"""The ranks' step checks: are the ranks at the same backward pass, about to issue the same collective?

A rank that skipped a step, ran an extra backward or took another data-dependent branch would pair its gradient
collectives with another step's. The per-round check (:class:`_RoundCheck`) finds that with one small integer
all-reduce per round that nothing waits for; ``sync.check: collective`` (:func:`next_collective_mismatch`) compares
every bucket's collective before it is issued, a debugging aid that waits on each one.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.agreement.fingerprint import RankMismatchError
from lightning_static_dist.sync.buffer import BucketBuffer
from lightning_static_dist.wording import counted

ROUND_MODULUS = 1 << 20  # pass numbers in the step check: sums of their squares stay exact in int64 for any world


class _RoundCheck:  # (private to sync/; the host-read tests key on this qualified name)
    """One round's step check: the sums over the ranks of their backward-pass numbers and of their squares, reduced
    with one small asynchronous integer all-reduce and read on the host when the synchroniser asks.

    ``world * sum(p**2) == sum(p)**2`` exactly when every rank is at the same pass (Cauchy-Schwarz), and integers
    add exactly on any number of ranks.

    Example::

        check = _RoundCheck(own_pass=7, group=None, device=torch.device("cpu"))
        check.settle("bucket 3")  # after the round's buckets (the last one named) were waited for
        check.sums()          # None, or (sum of passes, sum of squares) when the ranks were at different passes
    """

    def __init__(self, own_pass: int, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        self.own_pass = own_pass
        self._world = dist.get_world_size(group)
        p = own_pass % ROUND_MODULUS
        values = torch.empty(2, dtype=torch.int64, device=device)
        values[0].fill_(p)  # fills, not a copy from the host: nothing waits
        values[1].fill_(p * p)
        self._values = values
        self._work = dist.all_reduce(values, group=group, async_op=True) if self._world > 1 else None
        self._host: Optional[Tensor] = None
        self._event: Optional[torch.cuda.Event] = None

    def settle(self, after: str = "the round's buckets") -> None:
        """Order the host copy after the all-reduce (a stream wait on CUDA) and start it. ``after``: what the round
        waited for before it (``bucket 3``), for the line a failed peer gets."""
        if self._work is not None:
            # (Gloo's wait raises where a peer is gone: marked, so that it is one line naming the check, not a
            # traceback; under sync.optimizer_overlap it is the step's last wait, after its buckets were stepped)
            with waiting_in(f"the ranks' backward-pass check after {after}"):
                self._work.wait()
        self._host = torch.empty(2, dtype=torch.int64, pin_memory=self._values.is_cuda)
        self._host.copy_(self._values, non_blocking=True)
        if self._values.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def sums(self) -> Optional[tuple[int, int]]:
        """``(sum of passes, sum of squares)`` if the ranks were at different passes, else ``None``; waits for the
        copy only if it has not reached the host yet."""
        assert self._host is not None, "settle() first"
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        total, total_sq = self._host.tolist()
        return None if self._world * total_sq == total * total else (total, total_sq)


class StepChecks:
    """The step checks of the rounds whose verdicts have not been read yet, oldest first.

    Example::

        checks = StepChecks()
        checks.append(check)                         # once the round's check has settled
        mismatch = checks.read(keep=1, group=group)  # every verdict but the newest; the error to raise, if any
    """

    def __init__(self) -> None:
        self._checks: deque[_RoundCheck] = deque()

    def append(self, check: _RoundCheck) -> None:
        self._checks.append(check)

    def clear(self) -> None:
        self._checks.clear()

    def read(self, keep: int, group: Optional[dist.ProcessGroup]) -> Optional[RankMismatchError]:
        """Read every verdict but the newest ``keep``, stopping at the first mismatch: the error naming it."""
        while len(self._checks) > keep:
            check = self._checks.popleft()
            with waiting_in("the ranks' backward-pass check"):
                sums = check.sums()
            if sums is not None:
                return desynchronised(*sums, check.own_pass, group)
        return None


def desynchronised(total: int, total_sq: int, own_pass: int,
                   group: Optional[dist.ProcessGroup]) -> RankMismatchError:
    """The error every rank raises on its own when a round's check found the ranks at different passes, naming what
    it knows (no collective: the ranks are out of step, so a collective to compare them could pair with anything).
    ``total``: the sum of the ranks' pass numbers modulo :data:`ROUND_MODULUS`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    own_mod = own_pass % ROUND_MODULUS
    listing = f"rank {rank} at backward pass {own_pass}, the mean over the {world} ranks {own_pass - own_mod + total / world:g}"
    if world == 2:  # the other rank's number follows from the sum
        other = own_pass + (total - 2 * own_mod)
        ranks = sorted([(rank, own_pass), (1 - rank, other)])
        listing = ", ".join(f"rank {r} at backward pass {n}" for r, n in ranks)
    return RankMismatchError(
        f"static_dist: ranks are in different steps — {listing} — seen in the step check of a synchronised round"
        " (a rank skipped a step, ran an extra backward, or took another data-dependent branch)"
    )


def next_collective_mismatch(record_as: int, buffer: BucketBuffer,
                             group: Optional[dist.ProcessGroup]) -> Optional[RankMismatchError]:
    """``sync.check: collective`` (debugging): before a bucket's collective, every rank compares what it is about to
    send — bucket, size, dtype, backward pass — in one small blocking all-gather. The error to raise if they differ."""
    world = dist.get_world_size(group)
    mine = torch.tensor([record_as, buffer.bucket.numel, len(buffer.bucket.param_indices), buffer.sealed_pass],
                        dtype=torch.int64, device=buffer.flat.device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(t.tolist()) for t in everyone]
    if len(set(rows)) == 1:
        return None
    listing = "; ".join(f"rank {r}: bucket {b}, {counted(n, 'value')}, {counted(p, 'parameter')}, backward pass {k}"
                        for r, (b, n, p, k) in enumerate(rows))
    return RankMismatchError(f"static_dist: ranks disagree on the next gradient collective — {listing}")
