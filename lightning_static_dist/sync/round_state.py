"""Where the gradient synchroniser stands in a backward pass: one state, not a set of flags that could disagree.

FSDP2's ``TrainingState`` is the model: its hooks check one enum; here the gradient-ready hooks, the autograd engine's
end-of-pass callbacks and :meth:`~lightning_static_dist.sync.synchronizer.GradientSynchronizer.finish_if_pending`
move :class:`RoundState` along ``IDLE -> BACKWARD -> PASS_ENDED -> FINISHED -> IDLE``. Whether rounds communicate at
all (``no_sync``) and whether a plan has been made are not states of a pass: they hold across passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto


#: A backward pass that starts while the previous round is left to ``settle()`` (``sync.optimizer_overlap``).
OPEN_ROUND = (
    "static_dist: a backward pass started while the previous round's gradient averages were still pending"
    " (sync.optimizer_overlap leaves them to the optimizer step): its new gradients would be overwritten by, or added"
    " to, the old averages. Step the optimizer (or call settle()) after every synchronised backward; in Lightning an"
    " overridden optimizer_step or backward that runs a backward without stepping needs"
    " strategy.sync.optimizer_overlap=false (auto turns it off)")


class RoundState(Enum):
    """The state of the synchroniser's current backward pass and its round.

    Example::

        sync.attach()                      # RoundState.IDLE
        loss.backward()                    # BACKWARD at the first hook; PASS_ENDED, then FINISHED as backward returns
        sync.finish_if_pending()           # FINISHED -> IDLE without finishing again (IDLE: counts a pass, finishes)
    """

    IDLE = auto()
    """No backward pass since the last :meth:`finish_if_pending` (or since the round was abandoned)."""
    BACKWARD = auto()
    """A backward pass is running here: its first gradient-ready hook fired and counted the pass's number."""
    PASS_ENDED = auto()
    """The pass ended (counted in ``backward_passes``) and the autograd engine did not finish its round: a pass under
    ``no_sync``, or a ``finish()`` that raised. :meth:`finish_if_pending` finishes it."""
    FINISHED = auto()
    """The pass ended and the autograd engine finished its round: :meth:`finish_if_pending` only returns to ``IDLE``."""

    @property
    def pass_ended(self) -> bool:
        """Whether this rank's pass is over and counted (``finish_if_pending`` must not count it again)."""
        return self in (RoundState.PASS_ENDED, RoundState.FINISHED)


@dataclass(frozen=True)
class RoundSchedule:
    """When a round issues its buckets' collectives, and who waits for them: one value the synchroniser holds and
    changes only through :meth:`~lightning_static_dist.sync.synchronizer.GradientSynchronizer.follow`, between rounds.

    Example::

        sync.follow(RoundSchedule(launch_during_backward=False, defer_waits=True))   # after_backward, stepped per bucket
    """

    launch_during_backward: bool = True
    """``sync.schedule``: issue each full bucket as it fills (``overlap``), or all of them as backward ends."""
    defer_waits: bool = False
    """``sync.optimizer_overlap``: a round issued after backward leaves its waits to ``settle()``."""

    @property
    def leaves_waits(self) -> bool:
        """Whether a round's waits are left to ``settle()``: deferred, and issued after backward."""
        return self.defer_waits and not self.launch_during_backward


#: Each bucket issued as it fills, every round waited for as backward ends (``sync.schedule: overlap``).
OVERLAP = RoundSchedule()
