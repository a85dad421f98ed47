"""The participants ``strategy.sync`` configures: the buffer broadcast, the hook-driven synchroniser, the graph-mode
averaging identity, and the non-finite gradient check.

Which synchroniser a fit gets is decided once, at setup, from the config and the mesh: ``reduce: reduce_scatter``
(:class:`~lightning_static_dist.participants.sharded.ShardedSync` builds it), else ``mode: graph``
(:class:`GraphSync`), else ``mode: hooks`` (:class:`HookSync`). The other two stay idle for the whole fit.

Example (the strategy builds these in its ``__init__``)::

    hooks = HookSync(strategy, embeddings, compile, compression, recording)
    hooks.finish_gradients(accumulating=False)     # post_backward: launch the rest, make the stream wait
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch
import torch.distributed
from torch import Tensor

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_static_dist.compression.auto import Candidate, CompressionTrial
from lightning_static_dist.engine import broadcast_buffers, build_synchronizer
from lightning_static_dist.fingerprint import RankMismatchError
from lightning_static_dist.participants.base import (
    StepContext,
    StepParticipant,
    StrategyView,
    advance_trial,
    global_step,
    syncs_gradients,
)
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.compression import CompressionState
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.participants.sharded import ShardedSync
from lightning_static_dist.sync import RoundSync
from lightning_static_dist.sync.graph import GraphGradientSync


class BufferBroadcast(StepParticipant):
    """``strategy.sync.broadcast_buffers``: rank 0's module buffers (BatchNorm statistics ...) to every rank before
    each training forward, as DDP does."""

    def __init__(self, view: StrategyView) -> None:
        self._view = view
        self._buffers: list[Tensor] = []

    def setup(self, context: StepContext) -> None:
        if not syncs_gradients(context, self._view):
            return
        assert self._view.model is not None
        self._buffers = list(self._view.model.buffers()) if self._view.config.sync.broadcast_buffers else []

    def before_forward(self) -> None:
        if self._buffers:
            broadcast_buffers(self._buffers, self._view.dp_group)

    def teardown(self, failed: bool) -> None:
        self._buffers = []


class HookSync(StepParticipant):
    """The hook-driven synchroniser: with ``sync.mode: hooks`` it builds one; with ``reduce: reduce_scatter`` it
    runs the rounds of the sharded one :class:`~lightning_static_dist.participants.sharded.ShardedSync` built.
    Buckets fill from post-accumulate-grad hooks during backward; :meth:`finish_gradients` launches the rest and
    makes the stream wait (no host wait)."""

    def __init__(self, view: StrategyView, embeddings: EmbeddingShards, compile: StaticCompile,
                 compression: CompressionState, recording: PhaseRecording) -> None:
        self._view = view
        self._embeddings = embeddings
        self._compile = compile
        self._compression = compression
        self._recording = recording
        self.synchronizer: Optional[RoundSync] = None
        """The synchroniser of the last fit (kept after teardown: its plan and counters stay readable)."""

    def run_rounds_of(self, synchronizer: RoundSync) -> None:
        """Run the rounds of a synchroniser another participant built (``reduce: reduce_scatter``'s sharded one)."""
        self.synchronizer = synchronizer

    def setup(self, context: StepContext) -> None:
        view = self._view
        if not syncs_gradients(context, view) or view.reduce_scatter() or view.config.sync.mode == "graph":
            return
        assert view.model is not None
        sharder = self._embeddings.sharder
        sharded = sharder.shard_parameters() if sharder is not None else set()
        self.synchronizer = build_synchronizer(
            # a shard's gradient arrives averaged by its own reduce-scatter
            [(name, p) for name, p in view.model.named_parameters() if id(p) not in sharded],
            view.config.sync, None, group=view.dp_group,  # exact: CompressionState owns the reducer
        )
        self._compression.before_attach()  # the compressor chosen and its state restored before the first round
        self.synchronizer.attach()
        self.synchronizer.recorder = self._recording.recorder

    def attach_recorder(self, recorder: object) -> None:
        if self.synchronizer is not None:
            self.synchronizer.recorder = recorder  # type: ignore[assignment]

    def finish_gradients(self, accumulating: bool) -> None:
        if self.synchronizer is not None:
            self._compile.check_graphs_once()
            self.synchronizer.finish_if_pending()

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
        if self.synchronizer is not None:
            self.synchronizer.detach()  # frees its buffers; the plan and the counters stay readable


SCHEDULE_KEY = "static_dist_sync_schedule"  # sync.schedule: auto: the trial's choice and times


class SyncSchedule(StepParticipant):
    """``strategy.sync.schedule: auto``: times ``overlap`` (each bucket issued as it fills) and ``after_backward``
    (all issued once backward ends) on this job's first optimizer steps, the slowest rank's time of each, and keeps
    the faster on every rank; the choice is printed and kept in the checkpoint (a resumed run does not time again).
    The trial's steps are real training steps: only when the collectives leave changes."""

    CANDIDATES = ("overlap", "after_backward")

    def __init__(self, view: StrategyView) -> None:
        self._view = view
        self.trial: Optional[CompressionTrial] = None
        """The trial (``schedule: auto`` while fitting), and once made its choice."""
        self._resume: Optional[dict[str, Any]] = None

    def after_setup(self, context: StepContext) -> None:
        view = self._view
        if view.config.sync.schedule != "auto" or view.synchronizer is None or not syncs_gradients(context, view):
            return
        candidates = [Candidate(name, lambda: None) for name in self.CANDIDATES]  # (a schedule is its name)
        self.trial = CompressionTrial(candidates, start_step=0, trial_steps=view.config.sync.schedule_trial_steps,
                                      device=view.root_device, group=view.dp_group, min_gain=0.0)
        if self._resume is not None:
            self._load(self._resume)

    def on_train_batch_start(self) -> None:
        advance_trial(self.trial, self._view, lambda candidate: self._use(candidate.name), "sync.schedule auto")

    def _use(self, schedule: str) -> None:
        """Issue the buckets as ``schedule`` says from the next round on."""
        self._view.synchronizer.launch_during_backward = schedule == "overlap"

    def after_optimizer_step(self) -> None:
        if self.trial is not None:
            self.trial.after_step()

    def state_dict(self) -> dict[str, Any]:
        return {SCHEDULE_KEY: self.trial.state_dict()} if self.trial is not None else {}

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
        self.trial.load_state_dict(saved)
        if self.trial.decided and self._view.synchronizer is not None:
            self._use(self.trial.choice)

    def teardown(self, failed: bool) -> None:
        self.trial = None


class GraphSync(StepParticipant):
    """``sync.mode: graph``: the parameters are read through an averaging identity, so the collectives live in the
    compiled backward graph; every rank must have compiled the same graphs, checked before the first backward."""

    def __init__(self, view: StrategyView, compile: StaticCompile) -> None:
        self._view = view
        self._compile = compile
        self.graph_sync: Optional[GraphGradientSync] = None

    def setup(self, context: StepContext) -> None:
        view = self._view
        if not syncs_gradients(context, view) or view.reduce_scatter() or view.config.sync.mode != "graph":
            return
        reduce_dtype = torch.bfloat16 if view.config.sync.reduce_dtype == "bf16" else None
        self.graph_sync = GraphGradientSync(view.model, group=view.dp_group, reduce_dtype=reduce_dtype)
        self.graph_sync.attach()

    def before_backward(self) -> None:
        if self.graph_sync is None or self._compile.graphs_checked:
            return
        # before the first backward runs the collectives compiled into it: every rank compiled the same graphs
        try:
            self._compile.check_graphs_once()
        except RankMismatchError as err:
            raise RankMismatchError(
                "static_dist: strategy.sync.mode=graph needs every rank to compile the same graphs (the gradient"
                f" collectives are inside them): {err}. A model whose ranks use different parameters needs"
                " strategy.sync.mode=hooks"
            ) from None

    def finish_gradients(self, accumulating: bool) -> None:
        # (every micro-batch averages inside its own backward graph, accumulating or not)
        if self.graph_sync is not None:
            self.graph_sync.check_trainable()
            self.graph_sync.rounds += 1

    def teardown(self, failed: bool) -> None:
        if self.graph_sync is not None:
            self.graph_sync.detach()
            self.graph_sync = None


class NonfiniteCheck(StepParticipant):
    """``strategy.sync.nonfinite``: after the gradients are averaged, one collective flag, so every rank warns,
    skips or raises together."""

    def __init__(self, view: StrategyView, sharded: ShardedSync) -> None:
        self._view = view
        self._sharded = sharded
        self.steps = 0
        """Synchronised steps whose averaged gradients held NaN/Inf."""

    def finish_gradients(self, accumulating: bool) -> None:
        policy = self._view.config.sync.nonfinite
        if policy != "off" and not accumulating:
            self._check(policy)

    def _check(self, policy: str) -> None:
        view = self._view
        if getattr(view.precision_plugin, "scaler", None) is not None:
            return  # the gradient scaler skips non-finite steps itself
        assert view.lightning_module is not None
        sharded = self._sharded.sharded_sync
        if sharded is not None:  # the averaged gradients live in the shards
            named = [(f"a shard of {' / '.join(piece.names)}", piece.param)
                     for piece in sharded.pieces(optimized_only=False) if piece.param.grad is not None]
        else:
            named = [(n, p) for n, p in view.lightning_module.named_parameters() if p.grad is not None]
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
