"""``sync.schedule: measured``: the predicted step of each schedule on this run's link, and the choice.

The link probe (:mod:`~lightning_static_dist.sync.link_probe`) measures four figures of a bucket-sized all-reduce on
the run's own devices: its rate with the compute stream waiting (``idle``), its rate beside GEMMs (``busy``), the
ring's latency, and how much it slows the GEMMs (``slowdown``: compute seconds added per second the collective runs
beside them). From these and the run's buckets, :func:`predict_extra_s` plays one step's timeline for a candidate and
returns what the step costs beyond its compute; :func:`choose` keeps the cheapest.

Why these four figures are enough, the model and what it leaves out: docs/performance.md, "How the schedule is
chosen".

Pure: no process, no device. Example::

    rates = {None: LinkRates(idle_gbps=308, busy_gbps=110, latency_us=5, slowdown=0.15)}
    choice = choose_schedule(rates, buckets=[2**20] + [100 * 2**20] * 4, world=8, dtypes=("fp32",),
                             step_per_bucket=True, mem_gbps=3000, cut_s_per_piece=CUT_S_PER_PIECE)
    choice.choice, choice.predicted_ms
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

CUT_S_PER_PIECE = 90e-6
"""What one more piece of the cut compiled step costs (its launch, the graph boundary, a bucket's bookkeeping); how
it was measured: docs/performance.md, "How the schedule is chosen"."""

OPTIMIZER_BYTES_PER_GRAD_BYTE = 7.0
"""Bytes an Adam-family step reads and writes per gradient byte (parameter, gradient, two moments read; parameter
and two moments written): the optimizer's time per bucket is this over the device's memory rate."""

BF16_CAST_BYTES_PER_GRAD_BYTE = 3.0
"""Bytes ``reduce_dtype: bf16`` moves per fp32 gradient byte (read fp32, write bf16, read bf16, write fp32)."""

SMS_CANDIDATE = 8
"""The SM budget ``overlap`` is also predicted with where the probe can switch SMs (a simulated world)."""


@dataclass(frozen=True)
class LinkRates:
    """What the probe measured of the link with one SM budget (the slowest rank's figures).

    Example::

        LinkRates(idle_gbps=308, busy_gbps=110, latency_us=5, slowdown=0.15).bucket_s(100 * 2**20, 2, busy=True)
    """

    idle_gbps: float
    """Bus bandwidth (GB/s, as NCCL's tests count it) of an all-reduce while the compute stream waits for it."""
    busy_gbps: float
    """The same, while GEMMs run beside it."""
    latency_us: float
    """Per ring step."""
    slowdown: float
    """Compute seconds added per second the collective runs beside compute (0: it costs compute nothing)."""
    sms: Optional[int] = None
    """The SM budget probed (``None``: the default)."""

    def bucket_s(self, nbytes: float, world: int, busy: bool) -> float:
        """A ring all-reduce of ``nbytes`` over ``world`` ranks at one rate: ``2(p-1)`` latencies and
        ``2(p-1)/p * nbytes`` moved."""
        if world < 2:
            return 0.0
        rate = (self.busy_gbps if busy else self.idle_gbps) * 1e9
        return 2 * (world - 1) * self.latency_us * 1e-6 + 2 * (world - 1) / world * nbytes / rate


@dataclass(frozen=True)
class Candidate:
    """One way of issuing the round that the model predicts."""

    schedule: Literal["overlap", "after_backward"]
    reduce_dtype: Literal["fp32", "bf16"]
    comm_sms: Optional[int] = None
    step_per_bucket: bool = False
    """``after_backward`` with ``optimizer_overlap``: each bucket's parameters step as soon as it lands."""

    @property
    def name(self) -> str:
        if self.schedule == "after_backward":
            return f"after_backward/{self.reduce_dtype}" + ("+optimizer_overlap" if self.step_per_bucket else "")
        return f"overlap/{self.reduce_dtype}/sms={'default' if self.comm_sms is None else self.comm_sms}"


def _stretch(rates: LinkRates) -> float:
    """Wall seconds per second of compute work while a collective runs beside it: the probe's slowdown is the share of
    the GEMMs' pace the collective took (``added / collective`` seconds), so the work goes at ``1 - slowdown``."""
    return 1.0 / max(0.05, 1.0 - rates.slowdown)


def _beside(latency: float, moved: float, left: float, rates: LinkRates) -> tuple[float, float, float]:
    """One stretch of a collective beside compute that has ``left`` wall seconds to go: the latency first, then bytes
    at the busy rate, until either is done. Returns (the stretch's seconds, latency left, bytes left); a stretch that
    ends the compute is exactly ``left`` (no endless sliver of float error)."""
    if latency > 0:
        step = min(latency, left)
        return step, (0.0 if step == latency else latency - step), moved
    step = min(moved / (rates.busy_gbps * 1e9), left)
    return step, 0.0, (0.0 if step < left else max(0.0, moved - step * rates.busy_gbps * 1e9))


def _overlap_end(buckets: Sequence[float], world: int, rates: LinkRates, backward_s: float) -> float:
    """``overlap``: bucket ``i`` ready once the share of backward's work up to its last gradient is done (gradient
    bytes stand for work), issued when ready and the previous is done; busy beside backward, idle after it."""
    total = float(sum(buckets)) or 1.0
    ready, done = [], 0.0
    for nbytes in buckets:
        done += nbytes
        ready.append(backward_s * done / total)
    slow = _stretch(rates)
    now, work = 0.0, 0.0
    for nbytes, ready_at in zip(buckets, ready):
        if work < ready_at:  # no collective in flight: compute runs at full speed until the bucket is ready
            now, work = now + (ready_at - work), ready_at
        latency = 2 * (world - 1) * rates.latency_us * 1e-6
        moved = 2 * (world - 1) / world * nbytes
        while latency > 0 or moved > 0:
            if work < backward_s:  # beside compute: busy rate, compute slowed
                left = (backward_s - work) * slow  # wall seconds until backward ends at the slowed pace
                step, latency, moved = _beside(latency, moved, left, rates)
                now += step
                work = backward_s if step == left else work + step / slow  # (exact: no endless sliver)
            else:  # backward done: the step waits, the link runs at the idle rate
                now += latency + moved / (rates.idle_gbps * 1e9)
                latency = moved = 0.0
    return max(now, now + (backward_s - work))  # compute left after the last collective runs unslowed


def _after_end(buckets: Sequence[float], world: int, rates: LinkRates, optimizer_s: Sequence[float]) -> float:
    """``after_backward`` from backward's end: one collective at a time; with ``optimizer_s`` (the step per bucket),
    bucket ``i``'s parameters step once it lands and the previous bucket's step is done, and a collective beside a step
    runs at the busy rate. Returns when the last step (or collective) ends."""
    slow = _stretch(rates)
    now = 0.0
    pending: list[float] = []  # optimizer work queued on the compute stream, in order
    for i, nbytes in enumerate(buckets):
        latency = 2 * (world - 1) * rates.latency_us * 1e-6
        moved = 2 * (world - 1) / world * nbytes
        while latency > 0 or moved > 0:
            if pending:  # the compute stream steps earlier buckets: busy rate, the step slowed
                left = pending[0] * slow
                step, latency, moved = _beside(latency, moved, left, rates)
                if step == left:
                    pending.pop(0)
                else:
                    pending[0] -= step / slow
                now += step
            else:
                now += latency + moved / (rates.idle_gbps * 1e9)
                latency = moved = 0.0
        if optimizer_s:
            pending.append(optimizer_s[i])
    return now + sum(pending)  # the steps left run alone


def predict_extra_s(candidate: Candidate, buckets: Sequence[float], world: int, rates: LinkRates, *,
                    backward_s: Optional[float] = None, mem_gbps: Optional[float] = None,
                    cut_s_per_piece: float = 0.0) -> float:
    """Seconds a step under ``candidate`` takes beyond its compute (backward and the optimizer step as they run
    alone): the exposed communication, the compute the collectives slowed, the cut (``overlap`` compiled:
    ``cut_s_per_piece`` per piece beyond the first), the bf16 casts. ``buckets``: fp32 bytes, in the order they are
    issued. ``backward_s``: the backward's compute, ``None`` where not known (then every collective but the last
    finds backward still running: the slowdown is charged in full, nothing spills). ``mem_gbps``: the device's memory
    rate (the optimizer's time per bucket, the casts); ``None``: both free.

    Example::

        >>> rates = LinkRates(idle_gbps=100, busy_gbps=100, latency_us=0, slowdown=0.0)
        >>> round(1e3 * predict_extra_s(Candidate("after_backward", "fp32"), [1e9], 2, rates), 3)
        10.0
    """
    scale = 0.5 if candidate.reduce_dtype == "bf16" else 1.0
    wire = [scale * n for n in buckets]
    extra = 0.0
    if candidate.reduce_dtype == "bf16" and mem_gbps:
        extra += BF16_CAST_BYTES_PER_GRAD_BYTE * sum(buckets) / (mem_gbps * 1e9)
    if candidate.schedule == "overlap":
        # (backward unknown: long enough that every bucket but the last, ready as it ends, goes out beside it)
        backward = backward_s if backward_s is not None else 1e3
        return extra + _overlap_end(wire, world, rates, backward) - backward + cut_s_per_piece * (len(buckets) - 1)
    optimizer = [OPTIMIZER_BYTES_PER_GRAD_BYTE * n / (mem_gbps * 1e9) for n in buckets] \
        if candidate.step_per_bucket and mem_gbps else []
    return extra + _after_end(wire, world, rates, optimizer) - sum(optimizer)


@dataclass(frozen=True)
class MeasuredChoice:
    """What ``sync.schedule: measured`` chose and its evidence: printed at fit start, kept in the run summary, the
    offer and the checkpoint.

    Example::

        choice.describe()   # 'after_backward/fp32+optimizer_overlap (predicted +1.10 ms; overlap/fp32/sms=default ...'
    """

    choice: str
    """The chosen candidate's name."""
    predicted_ms: Mapping[str, float]
    """Each candidate's predicted ms beyond the step's compute."""
    rates: tuple[LinkRates, ...]
    """What the probe measured, per SM budget."""
    world: int
    """The world size it was chosen for (a resumed run in another world probes again)."""
    device_type: str
    probe_s: float = 0.0
    """Seconds the probe took (the slowest rank's); 0 when the choice came from a checkpoint."""
    source: str = "probe"
    """``probe``, or ``checkpoint`` (a resumed run applying a saved choice)."""
    backward_ms: Optional[float] = None
    """The backward the prediction assumed (``None``: not known at setup)."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """The probe's raw figures (message bytes, repetitions, memory rate ...)."""

    @property
    def candidate(self) -> Candidate:
        return parse_candidate(self.choice)

    def describe(self) -> str:
        """One line: the choice, the evidence (rates, slowdown), the prediction per candidate."""
        default = next((r for r in self.rates if r.sms is None), self.rates[0] if self.rates else None)
        evidence = (f"idle {default.idle_gbps:.3g} GB/s, beside compute {default.busy_gbps:.3g} GB/s,"
                    f" compute slowed {100 * default.slowdown:.0f}% while a collective runs, {default.latency_us:.3g} us")\
            if default is not None else "no figures"
        ranked = ", ".join(f"{name} +{ms:.3g} ms" for name, ms in sorted(self.predicted_ms.items(), key=lambda kv: kv[1]))
        first_use = self.details.get("first_use_s")
        how = f"probe {self.probe_s:.2f} s" + (f" after {first_use:.2f} s of first use" if first_use else "") \
            if self.source == "probe" else "from the checkpoint, not probed again"
        return f"{self.choice} ({how}: {evidence}; predicted beyond compute: {ranked})"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rates": [asdict(r) for r in self.rates], "predicted_ms": dict(self.predicted_ms),
                "details": dict(self.details)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeasuredChoice:
        return cls(**{**data, "rates": tuple(LinkRates(**r) for r in data.get("rates", ())),
                      "predicted_ms": dict(data.get("predicted_ms", {})), "details": dict(data.get("details", {}))})


def parse_candidate(name: str) -> Candidate:
    """The candidate a name stands for (:attr:`Candidate.name` read back)."""
    if name.startswith("after_backward/"):
        dtype, _, overlap = name.removeprefix("after_backward/").partition("+")
        return Candidate("after_backward", dtype, step_per_bucket=overlap == "optimizer_overlap")  # type: ignore[arg-type]
    _, dtype, sms = name.split("/")
    budget = sms.removeprefix("sms=")
    return Candidate("overlap", dtype, None if budget == "default" else int(budget))  # type: ignore[arg-type]


def candidates(rates: Mapping[Optional[int], LinkRates], dtypes: Sequence[str],
               step_per_bucket: bool) -> list[Candidate]:
    """What is predicted: ``overlap`` at each probed SM budget, ``after_backward`` with the optimizer stepping per
    bucket (where it can) and without, in each dtype."""
    found: list[Candidate] = []
    for dtype in dtypes:
        found += [Candidate("overlap", dtype, sms) for sms in rates]  # type: ignore[arg-type]
        found.append(Candidate("after_backward", dtype))  # type: ignore[arg-type]
        if step_per_bucket:
            found.append(Candidate("after_backward", dtype, step_per_bucket=True))  # type: ignore[arg-type]
    return found


def choose_schedule(rates: Mapping[Optional[int], LinkRates], buckets: Sequence[float], world: int,
                    dtypes: Sequence[str], step_per_bucket: bool, *, backward_s: Optional[float] = None,
                    mem_gbps: Optional[float] = None, cut_s_per_piece: float = 0.0, device_type: str = "cuda",
                    probe_s: float = 0.0, details: Optional[Mapping[str, Any]] = None) -> MeasuredChoice:
    """Predict every candidate and keep the cheapest (a tie goes to the first: ``overlap`` at the default SMs)."""
    predicted = {}
    for candidate in candidates(rates, dtypes, step_per_bucket):
        seconds = predict_extra_s(candidate, buckets, world, rates[candidate.comm_sms], backward_s=backward_s,
                                  mem_gbps=mem_gbps, cut_s_per_piece=cut_s_per_piece)
        predicted[candidate.name] = round(1e3 * seconds, 4)
    best = min(predicted, key=lambda name: predicted[name])
    return MeasuredChoice(best, predicted, tuple(rates.values()), world, device_type, probe_s=probe_s,
                          backward_ms=None if backward_s is None else 1e3 * backward_s, details=dict(details or {}))
