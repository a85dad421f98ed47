"""The step recorder: marks compute phases and collectives as they happen, cheaply, and closes each step into a
:class:`~lightning_static_dist.overlap.timeline.StepTimeline`.

Clocks. On CPU (Gloo) a mark is ``time.perf_counter()`` and a collective ends when its work handle's future runs its
callback, so the interval is the real one, not when ``finish()`` got round to waiting. On CUDA a mark is a CUDA event,
read only once it has completed (:meth:`ClosedStep.complete` asks without waiting): the host, a step or more ahead of
the GPU, never waits for a recorded step. A collective's duration comes from NCCL's own timing
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
        recorder.active = True
        recorder.begin_step(step=7, rank=0)
        recorder.begin("forward"); ...; recorder.end("forward")
        closed = recorder.close_step()          # the marks; closed.timeline() once closed.complete()
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._held: Optional[ClosedStep] = None  # end_step's CUDA step, read a step later
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
        self._events: list[Any] = []  # CUDA: every mark, in the order recorded (the newest completes last)

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
            return event
        return time.perf_counter()

    # ------------------------------------------------------------------------------------------------ marks

    def begin_step(self, step: int, rank: int) -> None:
        if not self.active:  # a step not recorded: nothing to set up (the last close left no origin)
            return
        self._reset(step, rank)
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

    def close_step(self, keep: bool = True) -> Optional[ClosedStep]:
        """Close the step: its marks, to be read once :meth:`ClosedStep.complete` (``None`` when nothing was
        recorded, or ``keep=False``: an accumulation micro-batch, discarded). Never waits."""
        if not self.active or self._origin is None:
            return None
        for phase in list(self._open):
            self.end(phase)
        closed = ClosedStep(self._step, self._rank, self._origin, self._phases, self._issued, self._ready, self._done,
                            self._waited, self._extra, self._events if self._cuda else None, self._device)
        self._reset(step=-1, rank=self._rank)
        return closed if keep else None

    def end_step(self, keep: bool = True) -> Optional[StepTimeline]:
        """Close the step and return a finished timeline, or ``None`` (Fabric's reading; the Trainer's monitor reads
        :meth:`close_step`'s steps once complete instead).

        On CPU the timeline is this step's. On CUDA it is the *previous* kept step's, waited for if its events have
        not completed yet; :meth:`flush` returns the last one. ``keep=False`` discards the step (an accumulation
        micro-batch).
        """
        closed = self.close_step(keep)
        if closed is None:
            return None
        if not self._cuda:
            return closed.timeline()
        previous, self._held = self._held, closed
        if previous is None:
            return None
        previous.wait()
        return previous.timeline()

    def flush(self) -> Optional[StepTimeline]:
        """The step :meth:`end_step` still holds back on CUDA (end of training), waited for."""
        held, self._held = self._held, None
        if held is None:
            return None
        held.wait()
        return held.timeline()


@dataclass
class ClosedStep:
    """A closed step's marks, before they are turned into seconds: read them with :meth:`timeline` once
    :meth:`complete` (on CUDA the host closes a step long before the GPU has run it).

    Example::

        closed = recorder.close_step()
        if closed is not None and closed.complete():   # a step later, typically
            timeline = closed.timeline()
    """

    step: int
    """The optimizer steps taken before this one (the step Lightning logs its figures at)."""
    rank: int
    """The rank that recorded it."""
    origin: Any
    """The step's start: ``time.perf_counter()`` on CPU, a CUDA event on CUDA."""
    phases: list[tuple[str, Any, Any]]
    """Compute phases: (name, start mark, end mark)."""
    issued: dict[int, tuple[Any, int, Any, int]]
    """Per bucket: (issue mark, bytes sent, the collective's work handle or ``None``, dense bytes)."""
    ready: dict[int, Any]
    """Per bucket: the mark where its gradients were all ready."""
    done: dict[int, float]
    """Per bucket (CPU): the clock where the collective's completion callback ran."""
    waited: dict[int, Any]
    """Per bucket: the mark after the compute stream waited for the collective."""
    extra: dict[str, float]
    """Figures measured elsewhere (:meth:`StepRecorder.note`)."""
    events: Optional[list[Any]] = None
    """CUDA: every mark's event, in the order recorded; ``None`` on CPU (no device to wait for)."""
    device: torch.device = torch.device("cpu")
    """The device the step ran on."""
    _complete: bool = False

    def complete(self) -> bool:
        """Whether every mark and collective of the step has completed: a query, never a wait. On CPU a mark is a
        clock read when it happened, and the step's collectives were waited for before it closed."""
        if self._complete:
            return True
        # newest first: while the GPU is still running the step, the first query answers
        if self.events is not None and not all(event.query() for event in reversed(self.events)):
            return False
        # NCCL's end events (its own timing) are on NCCL's stream: the compute stream's marks may not cover them
        self._complete = all(_work_completed(work) for _, _, work, _ in self.issued.values())
        return self._complete

    def wait(self) -> None:
        """Block until :meth:`complete` (a monitor waits once, at the end of an epoch): for the step's own events and
        collectives, not for the work queued after them."""
        if self.complete():
            return
        if self.events is None:
            for _, _, work, _ in self.issued.values():
                if work is not None and not _work_completed(work):
                    work.wait()
        else:
            for event in self.events:
                event.synchronize()
            if not self.complete():  # a collective the compute stream never waited for: every stream of the device
                torch.cuda.synchronize(self.device)
        self._complete = True

    def timeline(self) -> StepTimeline:
        """The step in seconds from its origin. On CUDA only once :meth:`complete` (reading an event that has not
        completed raises)."""
        cuda = self.events is not None

        def seconds(mark: Any) -> float:
            return self.origin.elapsed_time(mark) / 1e3 if cuda else mark - self.origin

        timeline = StepTimeline(step=self.step, rank=self.rank, extra=dict(self.extra))
        timeline.compute = [(name, seconds(a), seconds(b)) for name, a, b in self.phases]
        for bucket, (issued, nbytes, work, dense_nbytes) in sorted(self.issued.items()):
            issued_s = seconds(issued)
            ready_s = seconds(self.ready[bucket]) if bucket in self.ready else issued_s
            if bucket in self.done:
                # CPU: the completion callback's clock — but the callback needs the GIL, which the training thread
                # may hold well past the completion; the moment wait() returned is an upper bound too: take the
                # earlier of the two
                done_s = self.done[bucket] - self.origin
                if bucket in self.waited:
                    done_s = min(done_s, seconds(self.waited[bucket]))
                done_s = max(done_s, issued_s)
            elif cuda and work is not None and (duration_ms := _nccl_duration_ms(work)) is not None:
                done_s = issued_s + duration_ms / 1e3
            elif bucket in self.waited:  # an upper bound: where the compute stream waited for it
                done_s = max(seconds(self.waited[bucket]), issued_s)
            else:
                done_s = issued_s
            timeline.comm.append(CommRecord(bucket, nbytes, min(ready_s, issued_s), issued_s, done_s, dense_nbytes))
        return timeline


def _work_completed(work: Any) -> bool:
    """Whether a collective's work handle has completed (without waiting); a handle that cannot say counts as done:
    its time then comes from the compute stream's wait."""
    is_completed = getattr(work, "is_completed", None)
    return is_completed is None or bool(is_completed())


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
