"""The step recorder: marks compute phases and collectives as they happen, cheaply, and closes each step into a
:class:`~lightning_static_dist.overlap.timeline.StepTimeline`.

Clocks. On CPU (Gloo) a mark is ``time.perf_counter()``; a collective's completion time comes from its work
handle's future, whose callback Gloo runs the moment the operation finishes (on its own thread), so the interval is
the real one — not the later moment ``finish()`` got round to waiting for it. On CUDA a mark is a CUDA event on the
current stream, resolved once at the end of the step (one synchronisation per *monitored* step); a collective's
duration comes from NCCL's own timing (``TORCH_NCCL_ENABLE_TIMING=1``) where available, else its interval ends
where the compute stream waited for it (an upper bound, said so in the docs).

Who calls what: the strategy marks ``forward`` (training_step), ``backward`` (pre_backward → post_backward, before
the synchroniser waits) and ``optimizer`` (after the wait → end of the optimizer step); the synchroniser marks each
bucket ready, issued and waited. When :attr:`StepRecorder.active` is false every call returns at once.
"""

from __future__ import annotations

import time
from typing import Any, Optional

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
        self.active = False
        self._reset(step=-1, rank=0)

    def _reset(self, step: int, rank: int) -> None:
        self._step, self._rank = step, rank
        self._origin: Any = None
        self._phases: list[tuple[str, Any, Any]] = []
        self._open: dict[str, Any] = {}
        self._ready: dict[int, Any] = {}
        self._issued: dict[int, tuple[Any, int, Any]] = {}
        self._done: dict[int, float] = {}
        self._waited: dict[int, Any] = {}

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, mark: Any) -> float:
        if self._cuda:
            return self._origin.elapsed_time(mark) / 1e3
        return mark - self._origin

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

    def bucket_ready(self, bucket: int) -> None:
        if self.active and self._origin is not None:
            self._ready[bucket] = self._mark()

    def bucket_issued(self, bucket: int, nbytes: int, pending: Any) -> None:
        if not (self.active and self._origin is not None):
            return
        issued = self._mark()
        work = getattr(pending, "work", None)
        if work is not None and not self._cuda:
            # Gloo completes the future on its own thread the moment the collective finishes
            work.get_future().add_done_callback(lambda _, b=bucket: self._done.__setitem__(b, time.perf_counter()))
        self._issued[bucket] = (issued, nbytes, work)

    def bucket_waited(self, bucket: int) -> None:
        if self.active and bucket in self._issued:
            self._waited[bucket] = self._mark()

    # ------------------------------------------------------------------------------------------------ close

    def end_step(self) -> Optional[StepTimeline]:
        """Close the step; ``None`` when it was not recorded."""
        if not self.active or self._origin is None:
            return None
        for phase in list(self._open):
            self.end(phase)
        if self._cuda:
            torch.cuda.synchronize()
        timeline = StepTimeline(step=self._step, rank=self._rank)
        timeline.compute = [(name, self._seconds(a), self._seconds(b)) for name, a, b in self._phases]
        for bucket, (issued, nbytes, work) in sorted(self._issued.items()):
            issued_s = self._seconds(issued)
            ready_s = self._seconds(self._ready[bucket]) if bucket in self._ready else issued_s
            timeline.comm.append(CommRecord(bucket, nbytes, min(ready_s, issued_s), issued_s, self._done_s(bucket, issued_s, work)))
        self._reset(step=-1, rank=self._rank)
        return timeline

    def _done_s(self, bucket: int, issued_s: float, work: Any) -> float:
        if bucket in self._done:  # CPU: the completion callback's clock
            return max(self._done[bucket] - self._origin, issued_s)
        if self._cuda and work is not None:
            duration_ms = _nccl_duration_ms(work)
            if duration_ms is not None:
                return issued_s + duration_ms / 1e3
        waited = self._waited.get(bucket)
        return max(self._seconds(waited), issued_s) if waited is not None else issued_s


def _nccl_duration_ms(work: Any) -> Optional[float]:
    try:
        duration = work.get_duration()  # needs TORCH_NCCL_ENABLE_TIMING=1
    except Exception:  # not NCCL, timing off, or an older torch
        return None
    return duration if duration and duration > 0 else None
