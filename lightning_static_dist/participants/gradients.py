"""The gradient-sync participant: the one owner of the synchroniser a fit averages its gradients with.

:class:`GradientSynchronization` chooses, once at setup, from the config and the mesh, how the gradients are averaged
and builds that synchroniser: ``sync.reduce: reduce_scatter`` (``"sharded"``: each rank keeps a shard,
:func:`~lightning_static_dist.participants.sharded.build_sharded_synchronizer`), else ``sync.mode: graph``
(``"graph"``: an averaging identity, the collectives inside the compiled backward), else ``sync.mode: hooks``
(``"hooks"``: buckets filled from gradient hooks). Two parts of averaging are composed inside it: the broadcast of
rank 0's buffers before each training forward (:class:`BufferBroadcast`) and the non-finite check of the averaged
gradients (:class:`NonfiniteCheck`). The participants that act on the synchroniser (the sharded gathers, the
compression state, the schedule trial) are handed this participant when they are built, and read it from here.

Example (the roster builds it; ``strategy.synchronizer`` reads ``gradients.synchronizer``)::

    gradients = GradientSynchronization(strategy, compile, embeddings, recording)
    gradients.setup(context)                        # gradients.mode: "hooks", "graph", "sharded" or None
    gradients.finish_gradients(accumulating=False)  # post_backward: launch the rest, make the stream wait
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from collections.abc import Iterable
from typing import Any, Literal, Optional

import torch
import torch.distributed
from torch import Tensor
from torch.nn import Parameter

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.compression.auto import Candidate, CompressionTrial
from lightning_static_dist.processes.world import nccl_options, start_up_timeout
from lightning_static_dist.processes.faults import enter_collective, leave_collective, waiting_in
from lightning_static_dist.processes.fingerprint import RankMismatchError
from lightning_static_dist.participants.base import (
    StepContext,
    StepParticipant,
    StrategyView,
    global_step,
    syncs_gradients,
)
from lightning_static_dist.participants.comm_sms import CommSmsSwitch
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.participants.sharded import build_sharded_synchronizer
from lightning_static_dist.sync import GradientSynchronizer, RoundSync
from lightning_static_dist.sync.broadcast import broadcast_buffers
from lightning_static_dist.sync.graph import GraphGradientSync
from lightning_static_dist.sync.sharded import ShardedGradientSynchronizer
from lightning_static_dist.sync.config import SyncConfig, reduce_torch_dtype
from lightning_static_dist.sync.schedule import (
    SMS_CANDIDATES,
    ScheduleCandidate,
    Transport,
    candidate_named,
    schedule_candidates,
)

SyncMode = Literal["hooks", "graph", "sharded"]

_GRAPH_COLLECTIVES = "the gradient collectives inside the compiled backward (sync.mode=graph)"


def build_synchronizer(named_parameters: Iterable[tuple[str, Parameter]], sync: SyncConfig,
                       group: Optional[torch.distributed.ProcessGroup]) -> GradientSynchronizer:
    """The hook-driven synchroniser ``strategy.sync`` describes (``mode: hooks``, ``reduce: all_reduce``), exact: its
    reducer's one owner, :class:`~lightning_static_dist.participants.compression.CompressionState`, installs the
    compressor ``strategy.compression`` names before the first round. Not attached yet: call ``attach()``."""
    synchronizer = GradientSynchronizer(
        named_parameters,
        group=group,
        capacity=sync.capacity,
        check_each_collective=sync.check == "collective",
        reduce_dtype=reduce_torch_dtype(sync.reduce_dtype),
    )
    synchronizer.launch_during_backward = sync.schedule != "after_backward"  # (auto: its trial switches it)
    return synchronizer


class BufferBroadcast:
    """``strategy.sync.broadcast_buffers``: rank 0's module buffers (BatchNorm statistics ...) to every rank before
    each training forward, as DDP does. A part of :class:`GradientSynchronization`.

    Example::

        buffers = BufferBroadcast()
        buffers.follow(model, group=None)     # then, before each training forward:
        buffers.broadcast()
    """

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._group: Optional[torch.distributed.ProcessGroup] = None

    def follow(self, module: torch.nn.Module, group: Optional[torch.distributed.ProcessGroup]) -> None:
        """Broadcast ``module``'s buffers from now on."""
        self._buffers, self._group = list(module.buffers()), group

    def broadcast(self) -> None:
        if self._buffers:
            broadcast_buffers(self._buffers, self._group)

    def stop(self) -> None:
        self._buffers = []


class NonfiniteCheck:
    """``strategy.sync.nonfinite``: after the gradients are averaged, one collective flag, so every rank warns,
    skips or raises together. A part of :class:`GradientSynchronization`.

    Example::

        check = NonfiniteCheck(strategy)
        check(model.named_parameters(), "skip")   # NaN anywhere: every rank drops its gradients, warns once
    """

    def __init__(self, view: StrategyView) -> None:
        self._view = view
        self.steps = 0
        """Synchronised steps whose averaged gradients held NaN/Inf."""

    def __call__(self, named: list[tuple[str, Tensor]], policy: str) -> None:
        """Check the gradients of ``named`` (``(name, parameter)`` with a gradient), as ``policy`` says."""
        view = self._view
        # a rank with no gradient here (its chunks all padding) still takes part in the flag's all-reduce
        finite = torch.isfinite(torch.stack(torch._foreach_norm([p.grad for _, p in named]))) if named else None
        flag = torch.zeros(1, dtype=torch.float32, device=view.root_device)
        if finite is not None:
            flag += (~finite).any().to(torch.float32)
        if view.world_size > 1:  # a shard's gradient is only on its owner: decide together
            torch.distributed.all_reduce(flag, group=view.dp_group)
        if flag.item() == 0:
            return
        bad = [n for (n, _), ok in zip(named, finite.tolist()) if not ok] if finite is not None else []
        first = bad[0] if bad else "a parameter sharded on another rank"
        step = global_step(view)
        self.steps += 1
        if policy == "error":
            raise FloatingPointError(
                f"static_dist: non-finite gradient at step {step}, first offending parameter {first!r}"
                f" ({len(bad)} on this rank; strategy.sync.nonfinite=error)"
            )
        if policy == "skip":
            for _, p in named:
                p.grad = None  # the optimizer then updates nothing (no weight decay either) on every rank
        rank_zero_warn(
            f"static_dist: non-finite gradient at step {step} (first: {first!r}); "
            + ("optimizer step skipped on every rank" if policy == "skip" else "the optimizer step goes ahead")
            + f" (strategy.sync.nonfinite={policy})"
        )


class GradientSynchronization(StepParticipant):
    """The gradient averaging of a fit: chooses its mode once at setup (:attr:`mode`), builds and owns the
    synchroniser, and ends its rounds after each backward; broadcasts rank 0's buffers before each training forward
    and checks the averaged gradients (``sync.nonfinite``). Hook and sharded rounds fill buckets from
    post-accumulate-grad hooks during backward; :meth:`finish_gradients` launches the rest and makes the stream wait
    (no host wait). In graph mode every micro-batch averages inside its own compiled backward.

    Args:
        view: the strategy, as the participants read it.
        compile: static compilation: its graphs are compared before the first bucket collective, and the pieces it
            cut the step into are what the bucket plan follows.
        embeddings: the sharded embeddings, whose shards average in their own reduce-scatter (not synchronised here).
        recording: the overlap monitor's recorder, told of every bucket.
    """

    def __init__(self, view: StrategyView, compile: StaticCompile, embeddings: EmbeddingShards,
                 recording: PhaseRecording) -> None:
        self._view = view
        self._compile = compile
        self._embeddings = embeddings
        self._recording = recording
        self.mode: Optional[SyncMode] = None
        """How this fit averages: ``"hooks"``, ``"graph"`` or ``"sharded"``; ``None`` outside a multi-rank fit."""
        self.synchronizer: Optional[RoundSync] = None
        """The synchroniser whose rounds run after each backward (hooks or sharded; kept after teardown: its plan and
        counters stay readable)."""
        self.graph_sync: Optional[GraphGradientSync] = None
        """``sync.mode: graph`` while fitting: the averaging identity the parameters are read through."""
        self.buffers = BufferBroadcast()
        self.nonfinite = NonfiniteCheck(view)

    @property
    def sharded_sync(self) -> Optional[ShardedGradientSynchronizer]:
        """The synchroniser holding this rank's shards (``reduce_scatter`` while fitting; ``None`` once released)."""
        sync = self.synchronizer
        return sync if isinstance(sync, ShardedGradientSynchronizer) and not sync.released else None

    def choose_mode(self, context: StepContext) -> Optional[SyncMode]:
        """The mode this setup averages with (``None``: nothing to average, one rank or not fitting)."""
        view = self._view
        if not syncs_gradients(context, view):
            return None
        if view.reduce_scatter():
            return "sharded"
        return "graph" if view.config.sync.mode == "graph" else "hooks"

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self, context: StepContext) -> None:
        view = self._view
        self.mode = self.choose_mode(context)
        if self.mode is None:
            return
        assert view.model is not None
        self.synchronizer, self.graph_sync = None, None  # (a later fit's own; the last fit's stayed readable)
        if view.config.sync.broadcast_buffers:
            self.buffers.follow(view.model, view.dp_group)
        if self.mode == "sharded":
            self.synchronizer = build_sharded_synchronizer(view)
        elif self.mode == "graph":
            self.graph_sync = GraphGradientSync(view.model, group=view.dp_group,
                                                reduce_dtype=reduce_torch_dtype(view.config.sync.reduce_dtype))
            self.graph_sync.attach()
            return
        else:
            sharder = self._embeddings.sharder
            sharded = sharder.shard_parameters() if sharder is not None else set()
            self.synchronizer = build_synchronizer(
                # a shard's gradient arrives averaged by its own reduce-scatter
                [(name, p) for name, p in view.model.named_parameters() if id(p) not in sharded],
                view.config.sync, group=view.dp_group,  # exact: CompressionState installs the compressor
            )
            self.synchronizer.attach()
        self.synchronizer.recorder = self._recording.recorder

    def after_setup(self, context: StepContext) -> None:
        # compiled (in setup, after this participant): the bucket plan follows the pieces the step was cut into,
        # also on a later fit of the same, already compiled model
        groups = self._compile.ready_groups()
        if self.synchronizer is not None and groups is not None:
            self.synchronizer.ready_groups = groups

    def attach_recorder(self, recorder: object) -> None:
        if self.synchronizer is not None:
            self.synchronizer.recorder = recorder  # type: ignore[assignment]

    # -------------------------------------------------------------------------------------------- a step

    def before_forward(self) -> None:
        self.buffers.broadcast()

    def before_backward(self) -> None:
        if self.mode != "graph":
            return
        if not self._compile.graphs_checked:
            # before the first backward runs the collectives compiled into it: every rank compiled the same graphs
            try:
                self._compile.check_graphs_once()
            except RankMismatchError as err:
                raise RankMismatchError(
                    "static_dist: strategy.sync.mode=graph needs every rank to compile the same graphs (the gradient"
                    f" collectives are inside them): {err}. A model whose ranks use different parameters needs"
                    " strategy.sync.mode=hooks"
                ) from None
        # no Python frame of ours waits on these collectives: an error leaving the backward is theirs
        enter_collective(_GRAPH_COLLECTIVES)

    def after_backward(self) -> None:
        leave_collective(_GRAPH_COLLECTIVES)

    def finish_gradients(self, accumulating: bool) -> None:
        if self.synchronizer is not None:
            self._compile.check_graphs_once()
            self.synchronizer.finish_if_pending()
        elif self.graph_sync is not None:  # (every micro-batch averages in its own backward, accumulating or not)
            self.graph_sync.check_trainable()
            self.graph_sync.rounds += 1
        policy = self._view.config.sync.nonfinite
        if policy != "off" and not accumulating:
            self._check_nonfinite(policy)

    def _check_nonfinite(self, policy: str) -> None:
        view = self._view
        if getattr(view.precision_plugin, "scaler", None) is not None:
            return  # the gradient scaler skips non-finite steps itself
        assert view.model is not None
        sharded = self.sharded_sync
        if sharded is not None:  # the averaged gradients live in the shards
            named = [(f"a shard of {' / '.join(piece.names)}", piece.param)
                     for piece in sharded.pieces(optimized_only=False) if piece.param.grad is not None]
        else:
            named = [(n, p) for n, p in view.model.named_parameters() if p.grad is not None]
        self.nonfinite(named, policy)

    @property
    def clips_by_norm(self) -> bool:
        """Whether gradient clipping by norm must go through :meth:`clip_grad_norm_`: the gradients are sharded, and
        one rank's norm is not the model's (the front end routes its clipping here: ``strategy.py``, ``fabric/``)."""
        return self.sharded_sync is not None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm of the whole model's gradient, summed over the shard group (``clips_by_norm`` only)."""
        sharded = self.sharded_sync
        assert sharded is not None
        return sharded.clip_grad_norm_(max_norm, norm_type)

    def no_sync(self) -> AbstractContextManager[None]:
        return self.synchronizer.no_sync() if self.synchronizer is not None else nullcontext()

    def on_exception(self, exception: BaseException) -> None:
        # forget the round without waiting: a peer that failed may never join the collectives in flight
        if self.synchronizer is not None:
            self.synchronizer.abandon_round()

    def check_in_step(self) -> None:
        if self.synchronizer is not None:
            self.synchronizer.check_pending_rounds()

    def teardown(self, failed: bool) -> None:
        leave_collective(_GRAPH_COLLECTIVES)  # (left open by a backward that raised)
        self.buffers.stop()
        self.mode = None
        if self.synchronizer is not None:
            self.synchronizer.detach()  # frees its buffers; the plan and the counters stay readable
        if self.graph_sync is not None:
            self.graph_sync.detach()
            self.graph_sync = None


WARM_STEPS = 3
"""``sync.schedule: auto`` on a GPU: the fit's first optimizer steps, before the trial (compilation, CUDA graphs: an
H200 measured 141 ms for the first candidate's first timed step against 36 ms for the others, 2026-12-03)."""
SCHEDULE_KEY = "static_dist_sync_schedule"  # sync.schedule: auto: the trial's choice and times


def schedule_transport(view: StrategyView) -> Transport:
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


class SyncSchedule(StepParticipant):
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

        schedule = SyncSchedule(strategy, gradients)
        schedule.after_setup(context)       # the candidates, the trial (and the checkpoint's choice, if resumed)
        schedule.on_train_batch_start()     # each batch: the candidate for this step
    """

    def __init__(self, view: StrategyView, gradients: GradientSynchronization) -> None:
        self._view = view
        self._gradients = gradients
        self.trial: Optional[CompressionTrial] = None
        """The trial (``schedule: auto`` while fitting), and once made its choice."""
        self.candidates: list[ScheduleCandidate] = []
        """What this fit's trial times, in order (the first is the baseline)."""
        self.trial_steps = 0
        """Optimizer steps the trial took (once decided)."""
        self.trial_s: Optional[float] = None
        """Seconds the trial took, from its first step (after the warm steps) to the batch it decided at (once
        decided)."""
        self._started: Optional[float] = None
        self._first_step: Optional[int] = None
        self._warm = 0
        self._sms: Optional[CommSmsSwitch] = None
        self._resume: Optional[dict[str, Any]] = None

    def after_setup(self, context: StepContext) -> None:
        view = self._view
        mode = self._gradients.mode
        if view.config.sync.schedule != "auto" or mode != "hooks":
            return
        transport = schedule_transport(view)
        self.candidates = schedule_candidates(view.config.sync, transport)
        known = self._saved_choice()  # (resumed with a choice: its budget alone)
        timed = self.candidates if known is None else [known]
        budgets = sorted({c.comm_sms for c in timed if c.comm_sms is not None}, reverse=True)
        if budgets:  # (a collective on NCCL: every rank has the same candidates and checkpoint)
            self._sms = CommSmsSwitch.open(transport, view.dp_group, budgets, timeout=start_up_timeout(view.config))
        trial_candidates = [Candidate(c.name, lambda c=c: c) for c in self.candidates]
        # (on a GPU the first steps compile the step and record its CUDA graphs: timed, they would sink the first
        # candidate; on CPUs the first step, untimed for each candidate, is enough). Counted from the first batch
        # this fit sees (on_train_batch_start): a resumed fit compiles again too.
        self._warm = WARM_STEPS if view.root_device.type == "cuda" else 0
        self.trial = CompressionTrial(trial_candidates, start_step=0,
                                      trial_steps=view.config.sync.schedule_trial_steps,
                                      device=view.root_device, group=view.dp_group, min_gain=0.0)
        self.trial_steps, self.trial_s, self._started, self._first_step = 0, None, None, None
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
        if trial.decided:
            self.trial_steps = len(self.candidates) * trial.trial_steps
            self.trial_s = self._slowest_rank(self._now() - self._started)
            rank_zero_info(f"static_dist: sync.schedule auto: {trial.describe()}; the trial took {self.trial_steps}"
                           f" steps ({len(self.candidates)} candidates x {trial.trial_steps}), {self.trial_s:.1f} s")
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
        return candidate_named(saved["choice"], self.candidates, self._view.config.sync)

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
        """Reduce as ``candidate`` says from the next round on (between rounds): its SMs, its dtype, its schedule."""
        synchronizer = self._gradients.synchronizer
        if isinstance(synchronizer, GradientSynchronizer):  # (hooks: the only mode with a trial)
            if self._sms is not None:
                synchronizer.group = self._sms.group_for(candidate.comm_sms)
            synchronizer.use_reduce_dtype(reduce_torch_dtype(candidate.reduce_dtype))
        self._use_schedule(candidate.schedule)

    def _use_schedule(self, schedule: str) -> None:
        """Issue the buckets as ``schedule`` says from the next round on: the one place a schedule is applied."""
        synchronizer = self._gradients.synchronizer
        assert synchronizer is not None
        synchronizer.launch_during_backward = schedule == "overlap"  # type: ignore[attr-defined]

    def after_optimizer_step(self) -> None:
        if self.trial is not None:
            self.trial.after_step()

    def state_dict(self) -> dict[str, Any]:
        if self.trial is None:
            return {}
        state = self.trial.state_dict()
        if self.trial.decided and self.trial_s is not None:
            state.update(trial_steps=self.trial_steps, trial_s=self.trial_s)
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
        if saved.get("choice") is None:
            return  # saved mid-trial: timed again from the start
        chosen = candidate_named(saved["choice"], self.candidates, self._view.config.sync)
        if chosen is None:
            rank_zero_warn(f"static_dist: sync.schedule auto: the checkpoint chose {saved['choice']!r}, not among this"
                           f" run's candidates ({', '.join(c.name for c in self.candidates)}); timing them again")
            return
        self.trial.load_state_dict({**saved, "choice": chosen.name})
        self.trial_steps, self.trial_s = int(saved.get("trial_steps", 0)), saved.get("trial_s")
        if self._gradients.synchronizer is not None:
            self._use(chosen)
        self._keep_chosen()  # (loaded after setup: every budget's group was opened; every rank loads the same)

    def teardown(self, failed: bool) -> None:
        if self._sms is not None:  # (after a failure too: the SMs of this fit are not the next one's)
            synchronizer = self._gradients.synchronizer
            self._sms.close(synchronizer if isinstance(synchronizer, GradientSynchronizer) else None, failed)
            self._sms = None
        self.trial = None
