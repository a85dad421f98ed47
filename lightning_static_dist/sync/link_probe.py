"""The link probe of ``sync.schedule: measured``: what this run's collectives cost on its own devices, at setup.

On every rank of the data-parallel group, over whatever carries its collectives (NCCL, Gloo, a simulated world's
emulated link), a few hundred milliseconds:

1. a small all-reduce (the ring's latency), and a bucket-sized one and its half with the compute stream waiting for
   them (the idle rate from their difference, and the fixed time each collective pays besides its bytes);
2. GEMMs alone, then the same GEMMs with the bucket-sized all-reduce issued beside them: when the collective ends
   (a side stream waits for its future and records an event; on CPUs the future's callback reads the clock) gives the
   rate beside compute, and how much longer the GEMMs took gives the slowdown per second of collective beside them;
3. a copy of the bucket (the device's memory rate: the optimizer's time per bucket and the bf16 casts).

Each figure is the median of its repetitions; the ranks then take the slowest rank's figures (one small all-reduce),
so that every rank predicts, and chooses, alike (:mod:`~lightning_static_dist.sync.schedule_choice`). What the run's
first step would pay anyway (the communicator's first collective, cuBLAS's first GEMM, a simulated link's kernel
compiled) happens first and is timed apart: ``first_use_s``, not ``probe_s``.

Example::

    measure = probe_link(group, torch.device("cuda", 0), nbytes=100 * 2**20, width=768)
    measure.rates.busy_gbps, measure.probe_s
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.sync.bucket_reducer import supports_avg
from lightning_static_dist.sync.schedule_choice import LinkRates

REPEATS = 3
"""Timed repetitions of each measurement (after one untimed)."""

PAIRS = 5
"""Turns of GEMMs alone and GEMMs beside the collective, for the slowdown and the rate beside compute."""

MAX_SLOWDOWN = 0.9
"""The most of the GEMMs' pace a collective is taken to cost (a difference of two noisy times can read more)."""

MESSAGE_S = 2e-3
"""About how long the probe's bucket-sized message may take alone (a slow link gets a smaller one, never under
:data:`MIN_MESSAGE_ELEMENTS`)."""

MIN_MESSAGE_ELEMENTS = 2**23
"""The smallest rate-probing message (32 MiB of fp32, unless the bucket is smaller): on a fast link a smaller one's
bytes take little longer than its latency, and the difference of two would be noise."""

HEAD_START_CYCLES = 2_000_000
"""GPU clock cycles (about a millisecond) the stream spins before a measurement starts: the host's head start."""


@dataclass(frozen=True)
class LinkMeasure:
    """What one probe measured (the slowest rank's figures)."""

    rates: LinkRates
    mem_gbps: float
    """Bytes read and written per second by a copy of the bucket (GB/s)."""
    nbytes: int
    """The bucket-sized message probed."""
    probe_s: float
    """Wall seconds the probe took (the slowest rank's), after its first use."""
    gemms: int
    """GEMMs run beside the collective (grown until they outlast it)."""
    first_use_s: float = 0.0
    """Wall seconds of the first collective and GEMM, which the run's first step would otherwise pay (the slowest
    rank's)."""


class _Clock:
    """Timestamps on the device's own timeline: CUDA events on the current stream (a collective's end: a side stream
    waits for its future, so the compute stream never waits); on CPUs, ``perf_counter`` (a collective's end: its
    future's callback, on Gloo's thread)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self.cuda else None

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> Any:
        """A timestamp that opens a measurement. On a GPU the stream first spins for a millisecond (why:
        docs/performance.md, "How the schedule is chosen")."""
        if self.cuda:
            torch.cuda._sleep(HEAD_START_CYCLES)
        return self.now()

    def end_of(self, work: Any) -> Any:
        """A timestamp taken when ``work`` completes, without making the caller's stream wait for it."""
        future = work.get_future()
        if not self.cuda:
            seen: dict[str, float] = {}
            done = threading.Event()

            def stamp(_: Any) -> None:
                seen["t"] = time.perf_counter()
                done.set()

            future.then(stamp)
            return (seen, done)
        assert self._side is not None
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            future.wait()  # (a CUDA future: the side stream waits for the collective's stream, the host does not)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (synchronises: call after the measurement)."""
        if not self.cuda:
            if isinstance(end, tuple):
                seen, done = end
                done.wait()
                end = seen["t"]
            return end - start
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3


def _median(run: Callable[[], float], repeats: int = REPEATS) -> float:
    run()  # untimed: first use (a communicator's buffers, cuBLAS's workspace, the caching allocator)
    return statistics.median(run() for _ in range(repeats))


def probe_link(group: Optional[dist.ProcessGroup], device: torch.device, nbytes: int, width: int,
               rows: Optional[int] = None, sms: Optional[int] = None, max_gemm_rounds: int = 4) -> LinkMeasure:
    """Probe the link of ``group`` on ``device`` with a message of ``nbytes`` and GEMMs of ``rows`` x ``width`` by
    ``width`` (a collective: every rank of the group calls it). ``sms``: the SM budget the rates are labelled with
    (the caller switched the link to it)."""
    first_used = time.perf_counter()
    world = dist.get_world_size(group)
    host = device if device.type == "cuda" else torch.device("cpu")  # (where the agreement's small tensors live)
    clock = _Clock(device)
    n = max(1, nbytes // 4)
    bucket = torch.zeros(n, dtype=torch.float32, device=device)
    small = torch.zeros(1024, dtype=torch.float32, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # (a generator of its own: drawing from the global one would change the user's data and initialisation after it)
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(rows or width, width, device=device, generator=generator).to(dtype)
    b = torch.randn(width, width, device=device, generator=generator).to(dtype)
    # the synchroniser's own collective (MeanAllReduce): a native average where the group has one. A sum would time
    # a pass the step never makes (a simulated world multiplies by N after the link: 13 % off a 317 GB/s link idle)
    op = dist.ReduceOp.AVG if supports_avg(group, device) else dist.ReduceOp.SUM

    def all_reduce(tensor: torch.Tensor) -> float:
        start = clock.start()
        with waiting_in("the link probe's all-reduce (sync.schedule measured)"):
            dist.all_reduce(tensor, op=op, group=group)
        return clock.seconds(start, clock.now())

    def gemms(count: int) -> None:
        for _ in range(count):
            torch.mm(a, b)

    def gemms_alone(count: int) -> float:
        start = clock.start()
        gemms(count)
        return clock.seconds(start, clock.now())

    def beside(count: int) -> tuple[float, float]:
        """(seconds until the collective ended, seconds the GEMMs took), both from the same start."""
        start = clock.start()
        work = dist.all_reduce(bucket, op=op, group=group, async_op=True)
        comm_end = clock.end_of(work)
        gemms(count)
        compute_end = clock.now()
        with waiting_in("the link probe's all-reduce beside compute (sync.schedule measured)"):
            work.wait()
        return clock.seconds(start, comm_end), clock.seconds(start, compute_end)

    # first use (the communicator, cuBLAS, a simulated link's kernel): what the first step would pay, timed apart
    all_reduce(small), all_reduce(bucket[: min(n, 2**18)]), gemms_alone(1)
    started = time.perf_counter()
    latency_s = _median(lambda: all_reduce(small))
    # a slow link need not move a whole bucket to show its rate: a message of about MESSAGE_S there, from a 1 MiB
    # one's time beyond the latency (its rate; a latency-bound estimate would size a fast link's message too small
    # for its rate to show). Agreed: the ranks must issue the same collectives
    sized = torch.tensor([max(0.0, _median(lambda: all_reduce(bucket[: min(n, 2**18)])) - latency_s)],
                         device=host)
    with waiting_in("the link probe's agreement on its message size (sync.schedule measured)"):
        dist.all_reduce(sized, op=dist.ReduceOp.MAX, group=group)
    per_element_s = sized.item() / min(n, 2**18)
    n = max(min(n, MIN_MESSAGE_ELEMENTS), min(n, int(MESSAGE_S / max(per_element_s, 1e-15))))
    bucket = bucket[:n]
    # the idle rate from two messages' difference (whatever each collective pays besides its bytes cancels: the
    # ring's latency, a launch, a stream's wait); that fixed part is then taken off the time beside compute too
    half_s = _median(lambda: all_reduce(bucket[: n // 2]))
    idle_s = _median(lambda: all_reduce(bucket))
    one_gemm = max(_median(lambda: gemms_alone(4)) / 4, 1e-7)
    # (beside compute the collective runs slower: grown below; agreed, so that every rank runs the same GEMMs)
    count_t = torch.tensor([max(4, int(2 * idle_s / one_gemm))], device=host)
    with waiting_in("the link probe's agreement on its GEMM count (sync.schedule measured)"):
        dist.all_reduce(count_t, op=dist.ReduceOp.MAX, group=group)
    count = int(count_t.item())
    comm_s = gemm_s = added_s = 0.0
    for _ in range(max_gemm_rounds):
        # alone and beside in turns, the slowdown the median of each turn's difference (a GPU's clock drifts)
        gemms_alone(count), beside(count)  # (untimed)
        turns = [(gemms_alone(count), *beside(count)) for _ in range(PAIRS)]
        comm_s = statistics.median(t[1] for t in turns)
        gemm_s = statistics.median(t[2] for t in turns)
        added_s = max(0.0, statistics.median(t[2] - t[0] for t in turns))
        # the collective ended while the GEMMs ran, on every rank (agreed: the ranks issue the same collectives)?
        outlasted = torch.tensor([float(comm_s >= 0.9 * gemm_s)], device=host)
        with waiting_in("the link probe's agreement on its GEMM count (sync.schedule measured)"):
            dist.all_reduce(outlasted, op=dist.ReduceOp.MAX, group=group)
        if not outlasted.item():
            break
        count *= 2
    copy_s = _median(lambda: _copy_seconds(bucket, clock))

    figures = torch.tensor([latency_s, half_s, idle_s, comm_s, added_s, copy_s,
                            time.perf_counter() - started, started - first_used], dtype=torch.float64,
                           device=host)
    with waiting_in("the all-reduce of the link probe's figures (sync.schedule measured)"):
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's (every rank alike)
    latency_s, half_s, idle_s, comm_s, added_s, copy_s, probe_s, first_use_s = figures.tolist()
    steps = 2 * (world - 1)

    def bus_bytes(elements: int) -> float:  # (of an fp32 all-reduce, as NCCL's tests count them)
        return steps / world * 4 * elements

    moved = bus_bytes(n)
    per_byte_s = max(idle_s - half_s, 1e-12) / (moved - bus_bytes(n // 2) or 1.0)
    fixed_s = idle_s - moved * per_byte_s  # (t = fixed + bytes x per byte, read from the two messages)
    if not 0.0 <= fixed_s < idle_s:  # (a noisy difference: the small all-reduce's time instead)
        fixed_s = min(latency_s, 0.5 * idle_s)
    rates = LinkRates(idle_gbps=1e-9 / per_byte_s,
                      busy_gbps=moved / max(comm_s - fixed_s, 1e-9) / 1e9,
                      latency_us=1e6 * fixed_s / steps if steps else 0.0,
                      slowdown=min(MAX_SLOWDOWN, added_s / max(comm_s, 1e-9)),
                      sms=sms)
    return LinkMeasure(rates=rates, mem_gbps=2 * 4 * n / max(copy_s, 1e-9) / 1e9, nbytes=4 * n,
                       probe_s=time.perf_counter() - started if probe_s <= 0 else probe_s, gemms=count,
                       first_use_s=first_use_s)


def _copy_seconds(bucket: torch.Tensor, clock: _Clock) -> float:
    target = torch.empty_like(bucket)
    start = clock.start()
    target.copy_(bucket)
    return clock.seconds(start, clock.now())
