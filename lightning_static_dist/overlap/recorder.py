"""The step recorder: marks compute phases and collectives as they happen, cheaply, and closes each step into a
:class:`~lightning_static_dist.overlap.timeline.StepTimeline`.

Clocks. On CPU (Gloo) a mark is ``time.perf_counter()`` and a collective ends when its work handle's future runs its
callback, so the interval is the real one, not when ``finish()`` got round to waiting. On CUDA a mark is a CUDA event
read one recorded step later (no step waits for the GPU); a collective's duration comes from NCCL's own timing
(``TORCH_NCCL_ENABLE_TIMING=1``) where available, else it ends where the compute stream waited for it (an upper
bound). The participants mark ``forward``, ``backward`` and ``optimizer``; the synchroniser marks each bucket ready,
issued and waited. When :attr:`StepRecorder.active` is false every call returns at once.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from lightning_static_dist.overlap.timeline import CommRecord, StepTimeline


class StepRecorder:
    """Records one step at a time on this rank.

    Example::

        recorder = StepRecorder(torch.device("cpu"))
        recorder.begin_step(step=7, rank=0)
        recorder.begin("forward"); ...; recorder.end("forward")
        timeline = recorder.end_step()
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._held: Optional[_RawStep] = None
        self.active = False
        self._reset(step=-1, rank=0)

    def _reset(self, step: int, rank: int) -> None:
        self._step, self._rank = step, rank
        self._origin: Any = None
        self._phases: list[tuple[str, Any, Any]] = []
        self._open: dict[str, Any] = {}
        self._ready: dict[int, Any] = {}
        self._issued: dict[int, tuple[Any, int, Any, int]] = {}
        self._done: dict[int, float] = {}
        self._waited: dict[int, Any] = {}
        self._extra: dict[str, float] = {}

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # ------------------------------------------------------------------------------------------------ marks

    def begin_step(self, step: int, rank: int) -> None:
        self._reset(step, rank)
        if self.active:
            self._origin = self._mark()

    def begin(self, phase: str) -> None:
        if self.active and self._origin is not None:
            self._open[phase] = self._mark()

    def end(self, phase: str) -> None:
        if self.active and phase in self._open:
            self._phases.append((phase, self._open.pop(phase), self._mark()))

    def note(self, key: str, value_ms: float) -> None:
        """A figure measured elsewhere (the embedding gather), carried with this step's timeline."""
        if self.active and self._origin is not None:
            self._extra[key] = value_ms

    def bucket_ready(self, bucket: int) -> None:
        if self.active and self._origin is not None:
            self._ready[bucket] = self._mark()

    def bucket_issued(self, bucket: int, nbytes: int, pending: Any, dense_nbytes: Optional[int] = None) -> None:
        if not (self.active and self._origin is not None):
            return
        issued = self._mark()
        work = getattr(pending, "work", None)
        if work is not None and not self._cuda:
            # bind this step's dict now: the completion may be noted after end_step() started a new one
            note = functools.partial(self._done.__setitem__, bucket)
            future = _future_of(work)
            if future is not None:  # Gloo completes the future on its own thread the moment the collective finishes
                future.add_done_callback(lambda _: note(time.perf_counter()))
            else:  # (Gloo's reduce-scatter work has no future): a thread waits for it, the GIL released meanwhile
                threading.Thread(target=_note_when_done, args=(work, note), daemon=True).start()
        self._issued[bucket] = (issued, nbytes, work, nbytes if dense_nbytes is None else dense_nbytes)

    def bucket_waited(self, bucket: int) -> None:
        if self.active and bucket in self._issued:
            self._waited[bucket] = self._mark()

    # ------------------------------------------------------------------------------------------------ close

    def end_step(self, keep: bool = True) -> Optional[StepTimeline]:
        """Close the step and return a finished timeline, or ``None``.

        On CPU the timeline is this step's. On CUDA it is the *previous* kept step's: its events completed long
        ago, so reading them does not make this step wait for the GPU (a synchronisation per step would cost
        the CPU's head start); :meth:`flush` returns the last one. ``keep=False`` discards the step (an
        accumulation micro-batch).
        """
        if not self.active or self._origin is None:
            return None
        for phase in list(self._open):
            self.end(phase)
        raw = _RawStep(self._step, self._rank, self._origin, self._phases, self._issued, self._ready, self._done,
                       self._waited, self._extra)
        self._reset(step=-1, rank=self._rank)
        if not keep:
            return None
        if not self._cuda:
            return self._resolve(raw)
        previous, self._held = self._held, raw
        return self._resolve(previous) if previous is not None else None

    def flush(self) -> Optional[StepTimeline]:
        """The step still held back on CUDA (end of training)."""
        held, self._held = self._held, None
        return self._resolve(held) if held is not None else None

    def _resolve(self, raw: _RawStep) -> StepTimeline:
        if self._cuda and raw.phases:
            raw.phases[-1][2].synchronize()  # the held step's last mark: done a step ago, unlike the current step

        def seconds(mark: Any) -> float:
            return raw.origin.elapsed_time(mark) / 1e3 if self._cuda else mark - raw.origin

        timeline = StepTimeline(step=raw.step, rank=raw.rank, extra=dict(raw.extra))
        timeline.compute = [(name, seconds(a), seconds(b)) for name, a, b in raw.phases]
        for bucket, (issued, nbytes, work, dense_nbytes) in sorted(raw.issued.items()):
            issued_s = seconds(issued)
            ready_s = seconds(raw.ready[bucket]) if bucket in raw.ready else issued_s
            if bucket in raw.done:
                # CPU: the completion callback's clock — but the callback needs the GIL, which the training thread
                # may hold well past the completion; the moment wait() returned is an upper bound too: take the
                # earlier of the two
                done_s = raw.done[bucket] - raw.origin
                if bucket in raw.waited:
                    done_s = min(done_s, seconds(raw.waited[bucket]))
                done_s = max(done_s, issued_s)
            elif self._cuda and work is not None and (duration_ms := _nccl_duration_ms(work)) is not None:
                done_s = issued_s + duration_ms / 1e3
            elif bucket in raw.waited:  # an upper bound: where the compute stream waited for it
                done_s = max(seconds(raw.waited[bucket]), issued_s)
            else:
                done_s = issued_s
            timeline.comm.append(CommRecord(bucket, nbytes, min(ready_s, issued_s), issued_s, done_s, dense_nbytes))
        return timeline


@dataclass
class _RawStep:
    """A closed step's marks, before they are turned into seconds."""

    step: int
    rank: int
    origin: Any
    phases: list[tuple[str, Any, Any]]
    issued: dict[int, tuple[Any, int, Any, int]]
    ready: dict[int, Any]
    done: dict[int, float]
    waited: dict[int, Any]
    extra: dict[str, float]


def _nccl_duration_ms(work: Any) -> Optional[float]:
    try:
        duration = work.get_duration()  # needs TORCH_NCCL_ENABLE_TIMING=1
    except Exception:  # not NCCL, timing off, or an older torch
        return None
    return duration if duration and duration > 0 else None


def _future_of(work: Any) -> Any:
    """The work's completion future, or ``None`` where the backend has none (Gloo's ``reduce_scatter_tensor``)."""
    try:
        # (a simulated collective's future taken this way does not count its reader as a waiter: see simulate/group.py)
        return getattr(work, "timing_future", work.get_future)()
    except RuntimeError:
        return None


def _note_when_done(work: Any, note: Callable[[float], None]) -> None:
    try:
        work.wait()
    except Exception:  # a failed collective: the strategy reports it where it waits; no completion time here
        return
    note(time.perf_counter())
