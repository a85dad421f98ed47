"""``strategy.sync.schedule: auto``: the trial that times the schedules on this job's first steps and keeps the
fastest (:class:`ScheduleTrial`).

Example (the roster builds it)::

    schedule = ScheduleTrial(strategy, gradients)
    schedule.after_setup(context)       # the candidates, the trial (and the checkpoint's choice, if resumed)
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.trial import Candidate, StepTrial
from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.plan.world import nccl_options
from lightning_static_dist.participants.base import (RanksView, StepContext, StepParticipant, TrialView,
                                                     end_trial_step, global_step)
from lightning_static_dist.participants.comm_sms import CommSmsSwitch
from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.sync.schedule import (
    SMS_CANDIDATES,
    ScheduleCandidate,
    Transport,
    candidate_named,
    schedule_candidates,
)

WARM_STEPS = 3
"""``sync.schedule: auto`` on a GPU: the fit's first optimizer steps, before the trial (compilation and CUDA graph
recording would sink the first candidate: docs/performance.md, "Schedules, SMs and bf16 over the calibrated link")."""
SCHEDULE_KEY = "static_dist_sync_schedule"  # sync.schedule: auto: the trial's choice and times


def schedule_transport(view: RanksView) -> Transport:
    """What carries this run's gradient collectives, as ``sync.schedule: auto``'s candidates care: a simulated world
    with an emulated link (whose SMs are switched), NCCL over a data-parallel group of the whole world (a group per SM
    budget can be made on every rank) where this torch's NCCL options have ``max_ctas``, or anything whose SMs are
    not switched (``"gloo"``: Gloo, a simulated world with free links, NCCL without ``max_ctas``: warned)."""
    simulation = view.simulation
    if simulation is not None:
        return "simulated" if simulation.link is not None else "gloo"  # (free links hold no SMs)
    group = view.dp_group
    backend = torch.distributed.get_backend(group)
    whole_world = torch.distributed.get_world_size(group) == torch.distributed.get_world_size()
    if "nccl" not in backend or view.root_device.type != "cuda" or not whole_world:
        return "gloo"
    budget = next(n for n in SMS_CANDIDATES if n is not None)
    if not nccl_options("nccl", budget, setting="strategy.sync.schedule=auto's SM budgets"):
        return "gloo"  # (warned) every budget's group would be the default's twin: the default SMs only
    return "nccl"


class ScheduleTrial(StepParticipant):
    """``strategy.sync.schedule: auto``: times the candidates of :mod:`~lightning_static_dist.sync.schedule` — the
    schedule, and with ``sync.mode: hooks`` the SMs a collective may use and (``reduce_dtype: auto``) the reduce dtype
    — on this job's first optimizer steps, the slowest rank's time of each, and keeps the fastest on every rank. The
    choice is printed with what the trial cost, kept in the checkpoint (a resumed run applies it without timing again)
    and offered to the run summary. The trial's steps are real training steps: only how the collectives go changes.
    What it switches process-wide (NCCL groups per SM budget, a simulated link's SMs) is undone at teardown, after a
    failure too (the NCCL groups then left to the exit path); the groups not chosen are destroyed once the trial
    decides, and a resumed run opens the chosen budget's group only. ``gradients`` owns the synchroniser it switches
    (``sync.mode: hooks``; the sharded synchroniser has no ``auto``: the config refuses it).

    Example (the roster builds it)::

        schedule = ScheduleTrial(strategy, gradients)
        schedule.after_setup(context)       # the candidates, the trial (and the checkpoint's choice, if resumed)
        schedule.on_train_batch_start()     # each batch: the candidate for this step
    """

    def __init__(self, view: TrialView, gradients: GradientAveraging) -> None:
        self._view = view
        self._gradients = gradients
        self.trial: Optional[StepTrial] = None
        """The trial (``schedule: auto`` while fitting), and once made its choice."""
        self.candidates: list[ScheduleCandidate] = []
        """What this fit's trial times, in order (the first is the baseline)."""
        self.trial_steps = 0
        """Optimizer steps the trial took (once decided), with those of a trial the resumed checkpoint stopped inside."""
        self.trial_s: Optional[float] = None
        """Seconds the trial took, from its first step (after the warm steps) to the end of its last, where it decides
        (once decided), with those of a trial the resumed checkpoint stopped inside."""
        self._started: Optional[float] = None
        self._first_step: Optional[int] = None
        self._warm = 0
        self._sms: Optional[CommSmsSwitch] = None
        self._resume: Optional[dict[str, Any]] = None
        self._earlier: tuple[int, float] = (0, 0.0)
        """Steps and seconds of trials a checkpoint saved before they decided (the run stopped mid-trial): counted in
        :attr:`trial_steps` and :attr:`trial_s` once this fit's trial decides."""

    def after_setup(self, context: StepContext) -> None:
        view = self._view
        plan = view.plan if self._gradients.mode == "hooks" else None
        if plan is None or plan.sync.schedule != "auto":
            return
        transport = schedule_transport(view)
        self.candidates = schedule_candidates(plan.sync.reduce_dtype, plan.sync.comm_sms, transport)
        known = self._saved_choice()  # (resumed with a choice: its budget alone)
        timed = self.candidates if known is None else [known]
        budgets = sorted({c.comm_sms for c in timed if c.comm_sms is not None}, reverse=True)
        if budgets:  # (a collective on NCCL: every rank has the same candidates and checkpoint)
            self._sms = CommSmsSwitch.open(transport, view.dp_group, budgets, timeout=plan.start_up_timeout)
        trial_candidates = [Candidate(c.name, lambda c=c: c) for c in self.candidates]
        # (on a GPU the first steps compile the step and record its CUDA graphs: timed, they would sink the first
        # candidate; on CPUs the first step, untimed for each candidate, is enough). Counted from the first batch
        # this fit sees (on_train_batch_start): a resumed fit compiles again too.
        self._warm = WARM_STEPS if view.root_device.type == "cuda" else 0
        self.trial = StepTrial(trial_candidates, start_step=0,
                                      trial_steps=plan.sync.trial_steps,
                                      device=view.root_device, group=view.dp_group, min_gain=0.0)
        self.trial_steps, self.trial_s, self._started, self._first_step = 0, None, None, None
        self._earlier = (0, 0.0)
        if self._resume is not None:
            self._load(self._resume)

    def on_train_batch_start(self) -> None:
        trial = self.trial
        if trial is None or trial.decided or self._gradients.synchronizer is None:
            return
        step = global_step(self._view)
        if self._first_step is None:  # (the warm steps count from here, not from step 0: see after_setup)
            self._first_step = step
            trial.start_step = step + self._warm
        if self._started is None and step >= trial.start_step:  # (the trial's cost: from its first step, not the warm)
            self._started = self._now()
        candidate = trial.before_step(step)
        if candidate != "keep":
            self._use(candidate.make())

    def after_optimizer_step(self) -> None:
        # the choice is made at the end of the trial's last step: a stop right after it saves the choice
        if self._gradients.synchronizer is None or not end_trial_step(self.trial, lambda c: self._use(c.make()), None):
            return
        trial = self.trial
        assert trial is not None and self._started is not None
        this_steps, this_s = len(self.candidates) * trial.trial_steps, self._slowest_rank(self._now() - self._started)
        earlier_steps, earlier_s = self._earlier
        self.trial_steps, self.trial_s = this_steps + earlier_steps, this_s + earlier_s
        cost = f"the trial took {this_steps} steps ({len(self.candidates)} candidates x {trial.trial_steps}), {this_s:.1f} s"
        if earlier_steps:
            cost += (f"; with the trial the resumed checkpoint stopped inside ({earlier_steps} steps, {earlier_s:.1f} s):"
                     f" {self.trial_steps} steps, {self.trial_s:.1f} s")
        simulation = self._view.simulation
        if simulation is not None and simulation.link is None:
            cost += ("; a simulated world's free links carry nothing, so these times differ by noise alone and the"
                     " choice cannot tell the candidates apart (strategy.simulate.link emulates a link)")
        rank_zero_info(f"static_dist: sync.schedule auto: {trial.describe()}; {cost}")
        self._keep_chosen()  # (every rank decides at this step; the device synchronised above)

    def comm_groups(self) -> list[torch.distributed.ProcessGroup]:
        """The NCCL groups this fit opened for SM budgets and has not destroyed yet (``CollectiveTimeout`` sets
        ``strategy.timeout_s`` on them after the first optimizer step)."""
        return self._sms.groups if self._sms is not None else []

    def _keep_chosen(self) -> None:
        """Destroy the SM groups the trial's choice does not reduce over (the synchroniser is on the chosen one)."""
        assert self.trial is not None and self.trial.choice is not None
        chosen = next((c for c in self.candidates if c.name == self.trial.choice), None)
        if self._sms is not None and chosen is not None:
            self._sms.keep(chosen.comm_sms)

    def _saved_choice(self) -> Optional[ScheduleCandidate]:
        """The candidate a checkpoint loaded before setup chose, if it is one of this run's (else ``None``: timed)."""
        saved = self._resume
        if saved is None or saved.get("choice") is None:
            return None
        return candidate_named(saved["choice"], self.candidates, self._view.plan.sync.reduce_dtype)

    def _now(self) -> float:
        if self._view.root_device.type == "cuda":
            torch.cuda.synchronize(self._view.root_device)  # the trial's cost is device time too
        return time.perf_counter()

    def _slowest_rank(self, seconds: float) -> float:
        """The slowest rank's ``seconds`` (every rank decides at the same step: one small all-reduce there)."""
        view = self._view
        value = torch.tensor([seconds], dtype=torch.float64,
                             device=view.root_device if view.root_device.type == "cuda" else "cpu")
        with waiting_in("the all-reduce of the schedule trial's cost"):
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=view.dp_group)
        return float(value.item())

    def _use(self, candidate: ScheduleCandidate) -> None:
        """Reduce as ``candidate`` says from the next round on (between rounds): its SMs, its dtype, its schedule,
        applied by the synchroniser's owner."""
        self._gradients.reduce_as(candidate, self._sms.group_for(candidate.comm_sms) if self._sms is not None else None)

    def state_dict(self) -> dict[str, Any]:
        if self.trial is None:
            return {}
        state = self.trial.state_dict()
        if self.trial.decided and self.trial_s is not None:
            state.update(trial_steps=self.trial_steps, trial_s=self.trial_s)
        elif self._started is not None:  # mid-trial: what it cost so far (this rank's clock: no collective at a save)
            steps, seconds = self._earlier
            state.update(trial_steps=steps + self.trial.steps_taken, trial_s=seconds + time.perf_counter() - self._started)
        return {SCHEDULE_KEY: state}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.pop(SCHEDULE_KEY, None)
        if saved is None:
            return
        if self.trial is None:
            self._resume = saved  # Lightning loads before the strategy's setup: applied when the trial is built
        else:
            self._load(saved)

    def _load(self, saved: dict[str, Any]) -> None:
        self._resume = None
        assert self.trial is not None
        if saved.get("choice") is None:  # saved mid-trial: timed again from the start, its cost so far kept
            self._earlier = (int(saved.get("trial_steps", 0)), float(saved.get("trial_s", 0.0)))
            return
        chosen = candidate_named(saved["choice"], self.candidates, self._view.plan.sync.reduce_dtype)
        if chosen is None:
            rank_zero_warn(f"static_dist: sync.schedule auto: the checkpoint chose {saved['choice']!r}, not among this"
                           f" run's candidates ({', '.join(c.name for c in self.candidates)}); timing them again")
            return
        self.trial.load_state_dict({**saved, "choice": chosen.name})
        self.trial_steps, self.trial_s = int(saved.get("trial_steps", 0)), saved.get("trial_s")
        if self._gradients.synchronizer is not None:
            self._use(chosen)
        rank_zero_info(f"static_dist: sync.schedule auto: {chosen.name}, the resumed checkpoint's choice (not timed"
                       f" again: {self.trial.describe()})")
        self._keep_chosen()  # (loaded after setup: every budget's group was opened; every rank loads the same)

    def teardown(self, failed: bool) -> None:
        if self._sms is not None:  # (after a failure too: the SMs of this fit are not the next one's)
            self._sms.close(self._gradients.hook_sync, failed)
            self._sms = None
        self.trial = None
