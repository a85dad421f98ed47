"""``strategy.compression.name: auto``: time each candidate on the real job, on every rank, and keep the fastest.

After the ``start_step`` exact steps, each candidate (``none``, ``bf16``, ``powersgd`` at ``strategy.compression.rank``)
reduces the gradients of ``trial_steps`` optimizer steps; every rank takes the slowest rank's time of each and keeps
the fastest, and a compressor must beat exact by at least :data:`MIN_GAIN`. Why measure and how the steps are timed:
docs/internals.md, "trial.py".

The choice is printed, kept in the checkpoint (a resumed run does not time again) and, with a guard, still stepped
down when the gradient error or the loss goes wrong. The trial's compressed steps are real training steps.

Example::

    StaticDistStrategy(compression={"name": "auto", "rank": 4, "start_step": 100, "trial_steps": 6})
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_static_dist.agreement.faults import waiting_in

MIN_GAIN = 0.05
"""The fraction of exact's step time a compressor must save to be chosen."""


def choose(step_s: Mapping[str, float], exact: str = "none", min_gain: float = MIN_GAIN) -> str:
    """The candidate to keep, from each one's step time: the fastest, unless it saves less than ``min_gain`` of
    ``exact``'s time (then ``exact``)."""
    fastest = min(step_s, key=lambda name: step_s[name])
    if fastest != exact and step_s[fastest] > (1 - min_gain) * step_s[exact]:
        return exact
    return fastest


@dataclass
class Candidate:
    """One contender: its name in the log and what it runs with (a compressor, ``None``: exact fp32; or whatever
    another trial's candidates are, ``sync.schedule: auto``'s launch switch)."""

    name: str
    make: Callable[[], Any]


@dataclass
class StepTrial:
    """Runs the trial from the strategy's batch-start hook; :meth:`before_step` says which compressor the coming
    step reduces with (``"keep"``: no change) until the choice is made.

    ``start_step`` exact steps first, then ``trial_steps`` steps per candidate in order; ``decided`` once chosen."""

    candidates: Sequence[Candidate]
    start_step: int
    trial_steps: int
    device: torch.device
    group: Optional[dist.ProcessGroup] = None
    min_gain: float = MIN_GAIN
    """The fraction of the first candidate's time another must save to be chosen (0: the fastest wins)."""
    step_s: dict[str, float] = field(default_factory=dict)
    """The slowest rank's seconds per step of each candidate timed so far."""
    choice: Optional[str] = None
    _seen: int = 0
    _closed: int = 0
    _last_step: Optional[int] = None
    _step_start: Optional[float] = None
    _timed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.trial_steps < 2:
            raise ValueError(f"trial_steps={self.trial_steps!r}: must be an integer >= 2 (the first is not timed)")

    @property
    def decided(self) -> bool:
        return self.choice is not None

    @property
    def steps_taken(self) -> int:
        """The trial's steps begun so far (every candidate's, the untimed first ones included)."""
        return self._seen

    def before_step(self, step: int) -> Any:
        """Called before each batch with the optimizer steps done so far (``trainer.global_step``; several batches
        per step with gradient accumulation: only the first counts). Returns the candidate to switch to now, or
        ``"keep"``. The trial counts the distinct steps it sees from the first at or after ``start_step`` (a run
        resumed in the middle of a trial times every candidate again; a step count that jumps, as under manual
        optimization with several optimizer steps per batch, still gives each candidate ``trial_steps`` batches)."""
        if self.decided or step < self.start_step or step == self._last_step:
            return "keep"
        self._last_step = step
        index, offset = divmod(self._seen, self.trial_steps)
        self._seen += 1
        if offset > 0:  # the candidate's first step is done: time this one
            self._step_start = self._now()
            return "keep"
        return self.candidates[index]

    def after_step(self) -> Any:
        """Called at the end of each optimizer step: closes a timed step. At the end of the last candidate's last
        step it decides (a collective: every rank decides at the same step, before anything after the step could
        save or stop the run) and returns the candidate to switch to; ``"keep"`` otherwise."""
        if self._step_start is not None:
            self._timed_s += self._now() - self._step_start
            self._step_start = None
        if self.decided or self._seen == self._closed:
            return "keep"  # (no trial step began since the last call: before the trial, or a second optimizer step)
        self._closed = self._seen
        index, offset = divmod(self._seen, self.trial_steps)
        if offset != 0:
            return "keep"
        self.step_s[self.candidates[index - 1].name] = self._timed_s / (self.trial_steps - 1)  # its last step ended
        self._timed_s = 0.0
        if index < len(self.candidates):
            return "keep"
        self.step_s = self._slowest_rank(self.step_s)
        self.choice = choose(self.step_s, exact=self.candidates[0].name, min_gain=self.min_gain)
        if self.choice == self.candidates[-1].name:
            return "keep"  # it is reducing already: its state (PowerSGD's residuals) carries on
        return next(c for c in self.candidates if c.name == self.choice)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window is device time: the host may run ahead of it
        return time.perf_counter()

    def _slowest_rank(self, step_s: dict[str, float]) -> dict[str, float]:
        """Each candidate's time on the slowest rank (collective: every rank decides at the same step)."""
        names = list(step_s)
        times = torch.tensor([step_s[name] for name in names], dtype=torch.float64,
                             device=self.device if self.device.type == "cuda" else "cpu")
        if dist.is_initialized():
            with waiting_in("the all-reduce of an auto trial's step times"):
                dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)
        return dict(zip(names, times.tolist()))

    def describe(self) -> str:
        """``none 36.1 ms, bf16 40.3 ms, powersgd(rank=4) 45.2 ms per step -> none``."""
        timed = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in self.step_s.items())
        return f"{timed} per step (slowest rank) -> {self.choice}"

    def state_dict(self) -> dict[str, Any]:
        return {"choice": self.choice, "step_s": dict(self.step_s)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A saved choice is kept (no second trial); a checkpoint from mid-trial times again from the start."""
        if state.get("choice") is not None:
            self.choice, self.step_s = state["choice"], dict(state.get("step_s", {}))
