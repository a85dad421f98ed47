"""A communication cost model: what one step's collectives cost on a link, and how much of that backward hides.

Ring collectives over ``p`` ranks, with ``α`` the latency of one ring step and ``β`` the bandwidth of one link
(the α-β model of Thakur, Rabenseifner and Gropp, which NCCL's and Gloo's ring algorithms follow)::

    all_reduce      (n bytes)           2(p-1)·α + 2(p-1)/p · n/β
    reduce_scatter  (n bytes)            (p-1)·α +  (p-1)/p · n/β
    all_gather      (n bytes per rank)   (p-1)·α +  (p-1)   · n/β

A step is predicted from a compute timeline and what each bucket puts on the wire (:func:`bucket_wire`, which runs
the compressor's own code): the collectives go out one at a time, in plan order, each once its bucket is ready and
the previous one is done; what runs past the end of backward is exposed. What it leaves out:
docs/performance.md, "The cost model".

Example::

    link = Link(latency_s=5e-6, bandwidth_Bps=50e9)                         # a 400 Gb/s network
    link.seconds("all_reduce", 500e6, world=8)
    step = predict_step([0.010, 0.020], [bucket_wire(None, [torch.Size([1024, 1024])])] * 2,
                        backward_end_s=0.022, compute_s=0.033, link=link, world=8)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Link:
    """α (seconds per ring step) and β (bytes per second of one link)."""

    latency_s: float
    bandwidth_Bps: float

    def seconds(self, kind: str, nbytes: float, world: int) -> float:
        """One collective of ``nbytes`` (per rank for ``all_gather``) over ``world`` ranks."""
        steps, volume = ring_terms(kind, nbytes, world)
        return steps * self.latency_s + volume / self.bandwidth_Bps


def ring_terms(kind: str, nbytes: float, world: int) -> tuple[int, float]:
    """(ring steps, bytes each rank sends over one link) of a ring collective: the model's two regressors."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: allowed: {', '.join(KINDS)}")
    if world <= 1:
        return 0, 0.0
    p = world
    if kind == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p * nbytes
    if kind == "reduce_scatter":
        return p - 1, (p - 1) / p * nbytes
    return p - 1, (p - 1) * nbytes


@dataclass(frozen=True)
class Sample:
    """One measured collective: its kind, payload bytes (per rank for ``all_gather``), world size and seconds."""

    kind: str
    nbytes: int
    world: int
    seconds: float


def fit_link(samples: Sequence[Sample]) -> tuple[Link, float]:
    """The (α, β) that fit ``samples`` best in relative terms (least squares on t/t_measured - 1, so a 4 KiB
    collective weighs as much as a 64 MiB one), and the largest relative error of the fit over the samples.

    Example::

        >>> link, error = fit_link([Sample("all_reduce", n, 2, 1e-5 * 2 + n / 1e9) for n in (1e3, 1e6, 1e8)])
        >>> round(link.latency_s, 9), round(link.bandwidth_Bps), error < 1e-9
        (1e-05, 1000000000, True)
    """
    rows = [(s, *ring_terms(s.kind, s.nbytes, s.world)) for s in samples if s.world > 1]
    if len(rows) < 2:
        raise ValueError("fit_link: needs at least two samples at world size > 1")
    a = torch.tensor([[steps / s.seconds, volume / s.seconds] for s, steps, volume in rows], dtype=torch.float64)
    b = torch.ones(len(rows), dtype=torch.float64)
    alpha, inv_beta = torch.linalg.lstsq(a, b).solution.tolist()
    if alpha < 0:  # no latency the data can see (or below its noise): the bandwidth alone
        alpha, inv_beta = 0.0, torch.linalg.lstsq(a[:, 1:], b).solution.item()
    elif inv_beta <= 0:  # no bandwidth term the data can see: the latency alone
        alpha, inv_beta = torch.linalg.lstsq(a[:, :1], b).solution.item(), 0.0
    link = Link(latency_s=alpha, bandwidth_Bps=1.0 / inv_beta if inv_beta > 0 else math.inf)
    error = max(abs(link.seconds(s.kind, s.nbytes, s.world) / s.seconds - 1) for s, _, _ in rows)
    return link, error


@dataclass(frozen=True)
class Wire:
    """What one bucket puts on the wire: its collectives in order, ``(kind, bytes)``, and the compute seconds its
    compressor spends on the critical path (encode and decode; 0 when not measured)."""

    phases: tuple[tuple[str, int], ...]
    encode_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.phases)

    def seconds(self, link: Link, world: int) -> float:
        return sum(link.seconds(kind, n, world) for kind, n in self.phases)


def bucket_wire(compressor: Optional[Any], shapes: Sequence[torch.Size], world: int = 2, encode_s: float = 0.0,
                exact_bytes_per_element: int = 4) -> Wire:
    """The collectives a bucket of gradients with ``shapes`` issues, as the reducer would: what the compressor takes
    goes through its own phases (run here, on zero-filled CPU tensors, to read each phase's kind and bytes; the
    generator is closed after its ``phases_per_bucket``-th phase, whose output was never filled), the rest and the
    bucket's usage flags (one value per gradient) in one exact all-reduce (``exact_bytes_per_element``: 4 for fp32,
    2 with ``sync.reduce_dtype: bf16``; the compressed path's is fp32). ``compressor=None``: the whole bucket exact,
    in one all-reduce."""
    taken = [s for s in shapes if compressor is not None and compressor.takes(s)]
    rest = [s for s in shapes if s not in taken or compressor is None]
    exact_elements = sum(math.prod(s) for s in rest) + len(shapes)  # the usage flags always travel exact
    if not taken:
        return Wire((("all_reduce", exact_bytes_per_element * exact_elements),), encode_s)
    phases: list[tuple[str, int]] = []
    grads = [torch.zeros(s) for s in taken]
    generator = compressor.phases(list(range(len(taken))), grads, world)
    for collective, nbytes in generator:  # the code between phases runs on zeros: nothing was averaged
        phases.append((getattr(collective, "kind", "all_reduce"), int(nbytes)))
        if len(phases) == getattr(compressor, "phases_per_bucket", math.inf):
            generator.close()  # what follows the last phase reads its (unissued) output
            break
    phases.append(("all_reduce", 4 * exact_elements))
    return Wire(tuple(phases), encode_s)


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    """Compute, plus the compressors' encode time, plus the exposed communication."""
    comm_s: float
    """All collectives' time, hidden or not."""
    exposed_s: float
    """Communication still running after backward ended."""


def predict_step(ready_s: Sequence[float], wires: Sequence[Wire], backward_end_s: float, compute_s: float, link: Link,
                 world: int) -> StepPrediction:
    """One step: bucket ``i`` is ready at ``ready_s[i]`` (seconds from the step's start), its collectives start when it
    is ready and encoded and the previous bucket's are done, one bucket at a time in plan order."""
    if len(ready_s) != len(wires):
        raise ValueError(f"{len(ready_s)} ready times for {len(wires)} buckets")
    encode = 0.0
    clock = 0.0
    comm = 0.0
    for ready, wire in zip(ready_s, wires):
        encode += wire.encode_s
        seconds = wire.seconds(link, world)
        clock = max(clock, ready + encode) + seconds  # encoding runs on the compute stream: it delays what follows
        comm += seconds
    exposed = max(0.0, clock - (backward_end_s + encode))
    return StepPrediction(step_s=compute_s + encode + exposed, comm_s=comm, exposed_s=exposed)


def critical_bandwidth(step_s: Callable[[float], float], reference_s: Callable[[float], float], min_gain: float = 0.01,
                       low_Bps: float = 1e6, high_Bps: float = 1e13) -> float:
    """The link bandwidth below which ``step_s`` (a contender's predicted step time at a bandwidth) beats
    ``reference_s`` by at least ``min_gain`` of the reference's step, at every bandwidth from ``low`` up (0.0: not
    even at ``low``; ``inf``: up to ``high``), found on a log-spaced grid and refined by bisection.

    Example::

        >>> # exact: 1 s of compute + 100 GB to send; compressed: 1.5 s (encoding included) + 10 GB; equal at 180 GB/s
        >>> round(critical_bandwidth(lambda bw: 1.5 + 10e9 / bw, lambda bw: 1.0 + 100e9 / bw, min_gain=0.0) / 1e9)
        180
    """
    gain = lambda bw: reference_s(bw) * (1 - min_gain) - step_s(bw)  # noqa: E731
    # a coarse scan first, from the slow end: the first grid bandwidth where it stops paying brackets the crossing,
    # whatever the gain does above it (a curve that pays at both ends but not in between is not "always")
    grid = [math.exp(math.log(low_Bps) + i * (math.log(high_Bps) - math.log(low_Bps)) / 64) for i in range(65)]
    stops = next((i for i, bw in enumerate(grid) if gain(bw) <= 0), None)
    if stops is None:
        return math.inf
    if stops == 0:
        return 0.0
    lo, hi = math.log(grid[stops - 1]), math.log(grid[stops])
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(math.exp(mid)) > 0 else (lo, mid)
    return math.exp((lo + hi) / 2)
