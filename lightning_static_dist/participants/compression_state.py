"""``strategy.compression``: the one owner of the hook-driven synchroniser's reducer, the compressor's per-rank
state and the ``auto`` trial's choice carried through checkpoints.

The hook-driven synchroniser (``mode: hooks``, ``reduce: all_reduce``) is built exact by
:class:`~lightning_static_dist.participants.gradients.GradientAveraging`; this participant, handed that one,
makes every change of its reducer: the compressor ``strategy.compression`` names (installed in its own setup, after
the synchroniser's and before its first round, with the checkpoint's state restored), the ``auto`` trial's
candidates at batch starts and its choice resumed from a checkpoint (:meth:`CompressionState.use`), and the
compression guard's step to a safer level, down to the exact mean, through the strategy's offer
(:meth:`CompressionState.swap`). A resumed run reduces with the checkpoint's choice and state from its first step.

Example (the roster builds it)::

    compression = CompressionState(strategy, gradients)
    compression.swap(None)                          # the exact mean from the next round on, on every rank
    checkpoint.update(compression.state_dict())     # every rank: each rank's residual gathered to rank 0
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_static_dist.compression import CompressingReducer, build_compressor
from lightning_static_dist.trial import StepTrial
from lightning_static_dist.compression.base import Compressor
from lightning_static_dist.compression.reducer_state import (
    COMPRESSION_KEY,
    compressing_reducer_of,
    compression_trial,
    gather_compression_state,
    restore_compression_state,
    use_compressor,
)
from lightning_static_dist.participants.base import (StepContext, StepParticipant, TrialView, advance_trial,
                                                     end_trial_step)
from lightning_static_dist.participants.gradients import GradientAveraging

TRIAL_KEY = "static_dist_compression_auto"  # compression.name: auto: the trial's choice and times


class CompressionState(StepParticipant):
    """The reducer of the hook-driven synchroniser (its one owner), the compressor's state and the ``auto`` trial
    (``compression.name: auto``)."""

    def __init__(self, view: TrialView, gradients: GradientAveraging) -> None:
        self._view = view
        self._gradients = gradients
        self.trial: Optional[StepTrial] = None
        """``compression.name: auto``: the trial of the candidates and, once made, its choice."""
        self._trial_resume: Optional[dict[str, Any]] = None
        self._compression_resume: Optional[dict[str, Any]] = None
        self._attached = False  # this fit's synchroniser is built (a later fit's load must not restore into the last's)

    @property
    def reducer(self) -> Optional[CompressingReducer]:
        """The synchroniser's compressing reducer (``None`` without compression or at world size 1)."""
        return compressing_reducer_of(self._gradients.synchronizer)

    def use(self, compressor: Optional[Compressor], start_step: int = 0) -> None:
        """Reduce with a new reducer from the next round on: ``compressor``'s, compressing from round ``start_step``
        (``None``: the exact mean). Between rounds, on every rank at the same step. Only the hook-driven synchroniser
        has a reducer to change: elsewhere (one rank, ``sync.mode: graph``, ``sync.reduce: reduce_scatter``) a
        :class:`ValueError` naming the mode."""
        synchronizer = self._gradients.synchronizer
        if self._gradients.mode != "hooks" or synchronizer is None:
            mode = self._gradients.mode or "none (one rank, or not fitting)"
            raise ValueError(f"static_dist: the reducer can be changed with the hook-driven synchroniser only"
                             f" (strategy.sync.mode=hooks, reduce=all_reduce, while fitting on > 1 rank); here: {mode}")
        use_compressor(synchronizer, compressor, start_step)

    def swap(self, compressor: Optional[Compressor]) -> None:
        """Continue with ``compressor`` from the next round on (``None``: the exact mean): the compressing reducer in
        use keeps its round count and hands same-named state over (PowerSGD's residuals at a higher rank); without
        one, a new reducer compresses from now on. Between rounds, on every rank at the same step."""
        reducer = self.reducer
        if compressor is None or reducer is None:
            self.use(compressor)
        else:
            reducer.switch_to(compressor)

    def setup(self, context: StepContext) -> None:
        """The hook-driven synchroniser is built, exact (before its first round): install the configured compressor,
        or start the trial (resuming a checkpoint's choice); give the compressor its saved state."""
        if self._gradients.mode != "hooks":
            return
        self._attached = True
        compression = self._view.plan.compression
        if compression.name == "auto":  # exact until the trial picks
            self.trial = compression_trial(compression, self._view.root_device, self._view.dp_group)
            self._resume_trial()
        else:
            compressor = build_compressor(compression)
            if compressor is not None:
                self.use(compressor, compression.start_step)
        if self.reducer is not None:
            self._restore_compression_state()

    def on_train_batch_start(self) -> None:
        advance_trial(self.trial, self._gradients.synchronizer, self._view, lambda candidate: self.use(candidate.make()))

    def after_optimizer_step(self) -> None:
        end_trial_step(self.trial, lambda candidate: self.use(candidate.make()), "compression auto")

    def state_dict(self) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        # every rank gets here (Lightning writes on rank 0 only): gather each rank's compression state, so that a
        # resumed rank gets its own error-feedback residual back, not rank 0's
        reducer = self.reducer
        if reducer is not None:
            view = self._view
            saved = gather_compression_state(reducer, view.dp_group, view.world_size)  # to rank 0 only (it writes)
            if saved is not None:
                entries[COMPRESSION_KEY] = saved
        if self.trial is not None:
            entries[TRIAL_KEY] = self.trial.state_dict()  # the same on every rank
        return entries

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self._compression_resume = checkpoint.pop(COMPRESSION_KEY, None)
        self._trial_resume = checkpoint.pop(TRIAL_KEY, None)
        # Lightning loads a checkpoint before the strategy's setup: kept until this fit's synchroniser is built
        # (setup restores it). Were setup first, restore now: the trial's choice before the state.
        if self._attached:
            self._resume_trial()
            if self.reducer is not None:
                self._restore_compression_state()

    def _resume_trial(self) -> None:
        """A checkpoint's choice (``compression.name: auto``): reduce with it from now on, with no second trial."""
        synchronizer = self._gradients.synchronizer
        if self._trial_resume is None or self.trial is None or synchronizer is None:
            return  # nothing saved, or setup has not built the trial yet (it calls this again)
        saved, self._trial_resume = self._trial_resume, None
        trial = self.trial
        trial.load_state_dict(saved)
        if not trial.decided:
            return
        chosen = next((c for c in trial.candidates if c.name == trial.choice), None)
        if chosen is None:  # strategy.compression.rank changed since: time the candidates again
            rank_zero_warn(f"static_dist: compression auto: the checkpoint chose {trial.choice!r}, not among this"
                           f" run's candidates ({', '.join(c.name for c in trial.candidates)}): timing them again")
            trial.choice = None
            return
        self.use(chosen.make())

    def _restore_compression_state(self) -> None:
        saved, self._compression_resume = self._compression_resume, None
        reducer = self.reducer
        if saved is None or reducer is None:
            return
        view = self._view
        restore_compression_state(reducer, saved, view.global_rank, view.world_size, view.root_device)

    def teardown(self, failed: bool) -> None:
        self.trial = None  # a later fit builds its own (and resumes the checkpoint's choice into it)
        self._attached = False
