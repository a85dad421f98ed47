"""The gradient-sync participant: the one owner of the synchroniser a fit averages its gradients with.

:class:`GradientAveraging` chooses once at setup, from the plan, ``"sharded"`` (``sync.reduce: reduce_scatter``),
else ``"graph"`` or ``"hooks"`` (``sync.mode``), and composes the buffer broadcast and the non-finite check. The
participants that act on the synchroniser are handed this participant when they are built.

Example (the roster builds it; the offer's ``sync_figures()`` reads ``gradients.synchronizer``)::

    gradients = GradientAveraging(strategy, compile, embeddings, recording)
    gradients.setup(context)                        # gradients.mode: "hooks", "graph", "sharded" or None
    gradients.finish_gradients(accumulating=False)  # post_backward: launch the rest, make the stream wait
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from collections.abc import Iterable, Mapping
from typing import Optional

import torch
import torch.distributed
from torch import Tensor
from torch.nn import Parameter

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_static_dist.agreement.faults import AgreedFailure, enter_collective, leave_collective
from lightning_static_dist.agreement.fingerprint import RankMismatchError
from lightning_static_dist.participants.base import StepContext, StepParticipant, StrategyView, TrialView, global_step
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.participants.parameter_shards import build_sharded_synchronizer
from lightning_static_dist.sync import GradientSynchronizer, RoundSynchronizer
from lightning_static_dist.sync.broadcast import broadcast_buffers
from lightning_static_dist.sync.graph import GraphSynchronizer
from lightning_static_dist.sync.round_state import RoundSchedule
from lightning_static_dist.sync.sharded_synchronizer import ShardedSynchronizer
from lightning_static_dist.plan.step_plan import StepPlan, SyncMode
from lightning_static_dist.sync.config import launches_during_backward, reduce_torch_dtype
from lightning_static_dist.sync.schedule import ScheduleCandidate

_GRAPH_COLLECTIVES = "the gradient collectives inside the compiled backward (sync.mode=graph)"


def build_synchronizer(named_parameters: Iterable[tuple[str, Parameter]], plan: StepPlan,
                       group: Optional[torch.distributed.ProcessGroup]) -> GradientSynchronizer:
    """The hook-driven synchroniser the plan describes (``mode: hooks``, ``reduce: all_reduce``), exact: its
    reducer's one owner, :class:`~lightning_static_dist.participants.compression_state.CompressionState`, installs the
    compressor ``strategy.compression`` names before the first round. Not attached yet: call ``attach()``."""
    synchronizer = GradientSynchronizer(
        named_parameters,
        group=group,
        capacity=plan.sync.capacity,
        check_each_collective=plan.sync.check_each_collective,
        reduce_dtype=plan.sync.torch_reduce_dtype,
        schedule=RoundSchedule(launch_during_backward=plan.sync.launch_during_backward),  # (auto: its trial: reduce_as)
    )
    return synchronizer


class BufferBroadcast:
    """``strategy.sync.broadcast_buffers``: rank 0's module buffers (BatchNorm statistics ...) to every rank before
    each training forward, as DDP does. A part of :class:`GradientAveraging`.

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


class NonfiniteGradientError(AgreedFailure, FloatingPointError):
    """``strategy.sync.nonfinite: error``: every rank raises it at the same step (their flag is all-reduced), and the
    job ends with its one line (``agreement/faults.py``'s :class:`AgreedFailure`)."""


class NonfiniteCheck:
    """``strategy.sync.nonfinite``: after the gradients are averaged, one collective flag, so every rank warns,
    skips or raises together. A part of :class:`GradientAveraging`.

    Example::

        check = NonfiniteCheck(strategy)
        check(model.named_parameters(), "skip")   # NaN anywhere: every rank drops its gradients, warns once
    """

    def __init__(self, view: TrialView) -> None:
        self._view = view
        self.steps = 0
        """Synchronised steps whose averaged gradients held NaN/Inf."""

    def __call__(self, named: list[tuple[str, Tensor]], policy: str,
                 bucket_of: Optional[Mapping[str, int]] = None) -> None:
        """Check the gradients of ``named`` (``(name, parameter)`` with a gradient), as ``policy`` says.
        ``bucket_of``: each name's bucket, where buckets average them (named in ``error``'s line)."""
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
            where = f" in bucket {bucket_of[first]}" if first in (bucket_of or {}) else ""
            raise NonfiniteGradientError(
                f"static_dist: rank {view.global_rank}: non-finite gradient at step {step}{where}, first offending"
                f" parameter {first!r} ({len(bad)} non-finite after averaging; strategy.sync.nonfinite=error)"
            )
        if policy == "skip":
            for _, p in named:
                p.grad = None  # the optimizer then updates nothing (no weight decay either) on every rank
        rank_zero_warn(
            f"static_dist: non-finite gradient at step {step} (first: {first!r}); "
            + ("optimizer step skipped on every rank" if policy == "skip" else "the optimizer step goes ahead")
            + f" (strategy.sync.nonfinite={policy})"
        )


class GradientAveraging(StepParticipant):
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
        self.synchronizer: Optional[RoundSynchronizer] = None
        """The synchroniser whose rounds run after each backward (hooks or sharded; kept after teardown: its plan and
        counters stay readable)."""
        self.graph_sync: Optional[GraphSynchronizer] = None
        """``sync.mode: graph`` while fitting: the averaging identity the parameters are read through."""
        self.buffers = BufferBroadcast()
        self.nonfinite = NonfiniteCheck(view)

    @property
    def sharded_sync(self) -> Optional[ShardedSynchronizer]:
        """The synchroniser holding this rank's shards (``reduce_scatter`` while fitting; ``None`` once released)."""
        sync = self.synchronizer
        return sync if isinstance(sync, ShardedSynchronizer) and not sync.released else None

    @property
    def hook_sync(self) -> Optional[GradientSynchronizer]:
        """The hook-driven synchroniser (``sync.mode: hooks`` with ``all_reduce``; ``None`` otherwise)."""
        sync = self.synchronizer
        return sync if isinstance(sync, GradientSynchronizer) else None

    def choose_mode(self, context: StepContext) -> Optional[SyncMode]:
        """The mode this setup averages with (``None``: nothing to average, one rank or not fitting)."""
        return self._view.plan.sync.mode if context.fitting else None

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self, context: StepContext) -> None:
        view = self._view
        self.mode = self.choose_mode(context)
        if self.mode is None:
            return
        assert view.model is not None
        plan = view.plan
        self.synchronizer, self.graph_sync = None, None  # (a later fit's own; the last fit's stayed readable)
        if plan.sync.broadcast_buffers:
            self.buffers.follow(view.model, view.dp_group)
        if self.mode == "sharded":
            self.synchronizer = build_sharded_synchronizer(view)
        elif self.mode == "graph":
            self.graph_sync = GraphSynchronizer(view.model, group=view.dp_group, reduce_dtype=plan.sync.torch_reduce_dtype)
            self.graph_sync.attach()
            return
        else:
            sharder = self._embeddings.sharder
            sharded = sharder.shard_parameters() if sharder is not None else set()
            self.synchronizer = build_synchronizer(
                # a shard's gradient arrives averaged by its own reduce-scatter
                [(name, p) for name, p in view.model.named_parameters() if id(p) not in sharded],
                plan, group=view.dp_group,  # exact: CompressionState installs the compressor
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
        policy = self._view.plan.sync.nonfinite
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
        self.nonfinite(named, policy, self._buckets_by_name())

    def _buckets_by_name(self) -> Optional[dict[str, int]]:
        """Each synchronised parameter's bucket in the hook synchroniser's plan, by name (``None``: no such plan)."""
        sync = self.hook_sync
        if sync is None:
            return None
        names = sync.parameter_names
        return {names[i]: k for k, bucket in enumerate(sync.plan.buckets) for i in bucket.param_indices}

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

    def reduce_as(self, candidate: ScheduleCandidate, group: Optional[torch.distributed.ProcessGroup]) -> None:
        """Reduce as a ``sync.schedule: auto`` candidate says from the next round on (between rounds): over ``group``
        (its SM budget's; ``None``: the group as it is), in its dtype, on its schedule. The synchroniser's own
        settings change here only, where it is owned."""
        synchronizer = self.hook_sync
        assert synchronizer is not None  # (hooks: the only mode with a trial; the config refuses it with reduce_scatter)
        if group is not None:
            synchronizer.group = group
        synchronizer.use_reduce_dtype(reduce_torch_dtype(candidate.reduce_dtype))
        synchronizer.follow(dataclasses.replace(synchronizer.schedule,
                                                launch_during_backward=launches_during_backward(candidate.schedule)))

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
