"""``sync.schedule: auto``'s candidates: which ways of issuing the gradient collectives its trial times, and their names.

A candidate is a schedule (``overlap``: each bucket issued as it fills, during backward; ``after_backward``: all of
them once backward ends), the dtype the gradients are averaged in, and — for ``overlap``, whose collectives run
beside backward's kernels — the SMs a collective may use (``comm_sms``: ``None`` is the configured
``sync.comm_sms``, or the library's own choice). The set, in the order it is timed (the first is the baseline)::

    overlap/{dtype}/sms={default, 8, 4, 2}    for each dtype   (SMs only where they can be switched: NCCL, simulated)
    after_backward/{dtype}                    for each dtype

The dtypes are ``fp32`` and ``bf16`` only under ``sync.reduce_dtype: auto`` (bf16 rounds the sum: nobody gets it
without asking), else the configured one. SMs are switched only on NCCL (one communicator per budget) and in a
simulated world (the emulated link's SMs); Gloo has no such knob. (The sharded synchroniser has no ``auto``: it
issues its buckets during backward, ``overlap`` only.) Pure: no process, no group.

Example::

    [c.name for c in schedule_candidates("auto", None, "gloo")]     # sync.reduce_dtype auto, comm_sms default
    # ['overlap/fp32/sms=default', 'overlap/bf16/sms=default', 'after_backward/fp32', 'after_backward/bf16']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Transport = Literal["nccl", "simulated", "gloo"]
"""What carries the collectives, as far as the candidates care: NCCL, a simulated world, or anything else (Gloo)."""

SMS_CANDIDATES: tuple[Optional[int], ...] = (None, 8, 4, 2)
"""The SM budgets ``overlap`` is timed with where SMs can be switched (``None``: the default)."""


@dataclass(frozen=True)
class ScheduleCandidate:
    """One way of issuing a round's collectives that ``sync.schedule: auto`` times.

    Example::

        ScheduleCandidate("overlap", "bf16", comm_sms=4).name   # 'overlap/bf16/sms=4'
    """

    schedule: Literal["overlap", "after_backward"]
    reduce_dtype: Literal["fp32", "bf16"]
    comm_sms: Optional[int] = None
    """SMs a collective may use; ``None``: the default (``sync.comm_sms``, or the library's own choice)."""

    @property
    def name(self) -> str:
        """Stable and readable: in the printout, the checkpoint and the run summary."""
        if self.schedule == "after_backward":
            return f"after_backward/{self.reduce_dtype}"
        return f"overlap/{self.reduce_dtype}/sms={'default' if self.comm_sms is None else self.comm_sms}"


def schedule_candidates(reduce_dtype: str, comm_sms: Optional[int], transport: Transport) -> list[ScheduleCandidate]:
    """The candidates ``sync.schedule: auto`` times over ``transport`` with ``sync.reduce_dtype`` and
    ``sync.comm_sms`` (the default SMs), baseline first."""
    dtypes: tuple[Literal["fp32", "bf16"], ...]
    dtypes = ("fp32", "bf16") if reduce_dtype == "auto" else (_fixed_dtype(reduce_dtype),)
    sms: tuple[Optional[int], ...] = (None,)
    if transport in ("nccl", "simulated"):
        sms = tuple(n for n in SMS_CANDIDATES if n is None or n != comm_sms)  # (a budget equal to the default)
    overlap = [ScheduleCandidate("overlap", dtype, n) for dtype in dtypes for n in sms]
    return overlap + [ScheduleCandidate("after_backward", dtype) for dtype in dtypes]


def candidate_named(name: str, candidates: list[ScheduleCandidate],
                    reduce_dtype: str) -> Optional[ScheduleCandidate]:
    """The candidate a checkpoint's choice names; ``None`` if it is not among ``candidates``. Checkpoints made before
    the candidates had dtypes and SMs name a bare schedule (``overlap``, ``after_backward``): the configured dtype's
    (fp32 under ``auto``) with the default SMs."""
    if name in ("overlap", "after_backward"):
        name = ScheduleCandidate(name, _fixed_dtype(reduce_dtype)).name
    return next((c for c in candidates if c.name == name), None)


def _fixed_dtype(reduce_dtype: str) -> Literal["fp32", "bf16"]:
    return "bf16" if reduce_dtype == "bf16" else "fp32"
