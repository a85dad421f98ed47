"""What the static_dist strategy offers its users and callbacks: :class:`StaticDistOffer`, and :func:`offer_of` to
get it.

The one public surface of a run's facts: a callback (the run summary, the graph report, the overlap monitor, the
compression guard, a user's own) or a Fabric loop reads the strategy's parts through this declared protocol, never by
attribute names of the strategy. Both front ends provide it as ``strategy.offer`` (:class:`ProvidesOffer`; under
Fabric the first trainable model's, ``strategy.offers`` one per model); :func:`offer_of` returns it for a Trainer or a
Fabric object, or ``None`` where the strategy is another one, so that a callback can say in one line that it does
nothing there.

This module imports no feature (``tests/test_architecture.py``); the offer names what a callback may read by its
shape (:class:`CompileFacts`, :class:`CompressionCheck` ...). Why: docs/internals.md, "offer.py".

Example::

    class LogBytes(L.Callback):
        def on_train_end(self, trainer, pl_module):
            offer = offer_of(trainer)
            figures = offer.sync_figures() if offer is not None else None
            if figures is not None:
                print(f"{figures.bytes_sent} bytes in {figures.rounds} rounds ({figures.mode})")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Protocol, runtime_checkable

import torch

from lightning_static_dist.overlap.recorder import StepRecorder
from lightning_static_dist.simulate.config import SimulateConfig


@dataclass(frozen=True)
class SyncFigures:
    """What this rank's gradient synchronisation did so far in the fit (hook-driven rounds, or graph mode's
    collectives inside the compiled backward)."""

    mode: Literal["hooks", "graph"]
    rounds: int
    """Synchronised backward passes."""
    collectives: Optional[int]
    """Collectives launched (``None`` in graph mode: they are inside the compiled graph)."""
    bytes_sent: int
    """Payload bytes this rank put on the wire, over all rounds."""
    bytes_per_round: int
    """Payload bytes of one round (graph mode: every round's; hooks: the most recent round's)."""
    bucket_plan: Optional[str]
    """The bucket plan, described (``3 buckets [0.00MiB/3p, ...]``); ``None`` in graph mode."""
    optimizer_overlap: Optional[str] = None
    """``sync.optimizer_overlap`` as resolved, with its reason (``on (...)`` / ``off (...)``), where the schedule makes
    it mean anything (``after_backward``, ``auto``, or asked for with ``true``); else ``None``."""
    dense_bytes_per_round: int = 0
    """Payload bytes the round of ``bytes_per_round`` would have sent uncompressed (its compression ratio's
    denominator; equal to ``bytes_per_round`` without compression)."""


@dataclass(frozen=True)
class ScheduleChoice:
    """``sync.schedule: auto``'s choice (a candidate's name, ``overlap/bf16/sms=4``) and what its trial cost."""

    choice: str
    step_s: dict[str, float]
    """The slowest rank's seconds per step of each candidate timed (the checkpoint's, in a resumed run)."""
    trial_steps: int
    """Optimizer steps the trial took (0: unknown, a checkpoint from before this was recorded)."""
    trial_s: Optional[float]
    """Seconds the trial took (``None``: unknown)."""


class CompileFacts(Protocol):
    """What static compilation did on this rank, as a callback reads it (a ``CompileReport`` is one)."""

    graph_breaks: list[Any]
    recompiles: list[Any]
    graphs: list[Any]

    @property
    def compile_s(self) -> float: ...

    def summary(self) -> str: ...


class TrialFacts(Protocol):
    """An ``auto`` trial (``compression.name`` or ``sync.schedule``): whether it decided, and what."""

    choice: Optional[str]

    @property
    def decided(self) -> bool: ...


class CompressionCheck(Protocol):
    """The compressing reducer, as the compression guard checks it (a ``CompressingReducer`` is one)."""

    compressor: Any
    """The compressor in use (a :class:`~lightning_static_dist.compression.base.Compressor`)."""
    measure: bool
    """Set for one synchronised round: also average that round's compressed gradients exactly, to compare."""

    def take_relative_error(self) -> Optional[float]: ...


@runtime_checkable
class StaticDistOffer(Protocol):
    """The strategy's parts a callback may use, on this rank (each ``None`` where its feature is off).

    Example::

        offer = offer_of(trainer)
        if offer is not None and offer.compile_report is not None:
            print(offer.compile_report.summary())
    """

    @property
    def root_device(self) -> torch.device:
        """The device this rank computes on."""
        ...

    @property
    def simulation(self) -> Optional[SimulateConfig]:
        """``strategy.simulate`` when one process stands for the world, else ``None``."""
        ...

    def sync_figures(self) -> Optional[SyncFigures]:
        """What the gradient synchronisation did so far (``None``: nothing is synchronised, e.g. one rank)."""
        ...

    @property
    def compile_report(self) -> Optional[CompileFacts]:
        """What static compilation did on this rank (``None`` when the model is not compiled)."""
        ...

    def attach_recorder(self, recorder: StepRecorder) -> None:
        """Let ``recorder`` see the step's compute phases and collectives (the overlap monitor's)."""
        ...

    @property
    def compression_trial(self) -> Optional[TrialFacts]:
        """``strategy.compression.name: auto``: the trial of the candidates and, once made, its choice."""
        ...

    def schedule_choice(self) -> Optional[ScheduleChoice]:
        """``strategy.sync.schedule: auto``'s choice once made (``None``: no trial, or not decided yet)."""
        ...

    def measured_schedule(self) -> Optional[Any]:
        """``strategy.sync.schedule: measured``'s choice once the probe (or a checkpoint) made it: a
        ``MeasuredChoice`` (``sync/schedule_choice.py``: ``choice``, ``predicted_ms``, ``rates``, ``describe()``);
        ``None`` where nothing was probed (CPUs, one rank, a pinned schedule)."""
        ...

    @property
    def compressing_reducer(self) -> Optional[CompressionCheck]:
        """The compressing reducer in use (``None`` without compression, or at world size 1)."""
        ...

    def swap_reducer(self, compressor: Optional[Any]) -> None:
        """Reduce with ``compressor`` from the next round on (``None``: the exact mean); the compressing reducer in
        use continues with it, keeping its round count and the state a compressor of the same name carries over.
        Every rank must swap at the same step. Only the hook-driven synchroniser has a reducer (``sync.mode: hooks``,
        ``reduce: all_reduce``, while fitting on more than one rank; ``compressing_reducer`` or the synchroniser's
        figures say so): elsewhere a :class:`ValueError` naming the mode."""
        ...

    def host_max(self, values: Sequence[float]) -> list[float]:
        """The maximum over ranks of host figures, with no device synchronisation. A collective."""
        ...

    def wait_for_parameters(self) -> None:
        """Return once every parameter the data-parallel step keeps whole holds this step's values. With
        ``sync.reduce: reduce_scatter`` the all-gathers of the updated shards run in the background until the next
        forward needs them: this waits for those in flight (read the weights between ``optimizer.step()`` and the next
        forward only after it). Elsewhere they are current already, and it returns at once. (Sharded embeddings,
        ``embedding.shard``, stay sharded between steps: their full rows are in the checkpoint's ``state_dict``.)"""
        ...


@runtime_checkable
class ProvidesOffer(Protocol):
    """A strategy that offers a :class:`StaticDistOffer` (the Trainer's ``StaticDistStrategy``; the Fabric strategy,
    whose offer is ``None`` before the first ``fabric.setup``)."""

    @property
    def offer(self) -> Optional[StaticDistOffer]: ...


def offer_of(owner: Any) -> Optional[StaticDistOffer]:
    """The offer of ``owner.strategy`` (a Trainer, or a Fabric object); ``None`` when the strategy is not static_dist,
    or has no offer yet (Fabric before its first ``fabric.setup`` of a trainable model).

    Example::

        offer = offer_of(trainer)            # or offer_of(fabric)
        if offer is None:
            rank_zero_warn("MyCallback measures the static_dist strategy only; it does nothing here.")
    """
    strategy = getattr(owner, "strategy", None)
    return strategy.offer if isinstance(strategy, ProvidesOffer) else None
