"""``strategy.sync``: the options of gradient synchronisation, beside the synchronisers they steer.

Example::

    SyncConfig(bucket_mb=10, first_bucket_mb=0.5)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from lightning_static_dist.config.check import check_fields, fail
from lightning_static_dist.sync.plan import DEFAULT_CAPACITY, BucketCapacity


@dataclass
class SyncConfig:
    """``strategy.sync``: how gradients are synchronised across the mesh's ``dp`` group (docs/synchroniser.md).

    Example::

        StaticDistStrategy(sync={"bucket_mb": 10, "first_bucket_mb": 0.5})
    """

    KEY = "strategy.sync"

    mode: Literal["hooks", "graph"] = "hooks"
    """``hooks``: bucketed async collectives launched from post-accumulate-grad hooks (any model, any usage).
    ``graph``: each parameter read in the forward passes through an identity whose backward is a functional
    all-reduce, so the collectives are traced into the compiled backward graph and inductor buckets them and
    schedules them against compute; needs ``compile`` and every rank to use every trainable parameter on every
    step (the ranks' graphs are compared before the first backward)."""
    reduce: Literal["auto", "all_reduce", "reduce_scatter"] = "auto"
    """``all_reduce``: every rank gets the whole averaged gradient and keeps the whole optimizer state.
    ``reduce_scatter``: each bucket is reduce-scattered over the mesh's ``dp_shard`` group and all-reduced over
    ``dp_replicate``; each rank steps only its shard (optimizer state / ``dp_shard``) and the updated shards are
    all-gathered back, overlapped with the next forward. ``auto``: ``reduce_scatter`` when ``dp_shard > 1``."""
    reduce_dtype: Literal["fp32", "bf16", "auto"] = "fp32"
    """The dtype gradients are averaged in, like FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``: ``fp32`` (their
    own dtype, exact) or ``bf16`` (half the bytes: the gradients stay in their own bucket; one cast of the bucket into
    a persistent bf16 buffer, one all-reduce, one cast back; the sum is rounded to bf16). ``auto``: with
    ``schedule: auto`` only, its trial times every candidate in fp32 and in bf16 and keeps the fastest (so bf16 is
    never chosen for a user who did not ask for it). Not a compressor: no error feedback, no phases."""
    bucket_mb: float = DEFAULT_CAPACITY.mib
    """Capacity of each bucket after the first, in MiB."""
    first_bucket_mb: float = DEFAULT_CAPACITY.first_mib
    """Capacity of the first bucket, in MiB: small, so the first collective starts early in backward."""
    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics ...) from rank 0 before every training forward, like DDP."""
    check: Literal["pass", "collective"] = "pass"
    """How ranks check they are in step: ``pass`` (a small integer all-reduce per round compares their backward-pass
    numbers, read two rounds later: nothing waits) or, to debug, ``collective`` (a small blocking all-gather before
    every bucket's collective comparing bucket, size and pass: names the first disagreement before any mismatched
    data is exchanged; slow)."""
    nonfinite: Literal["off", "warn", "skip", "error"] = "off"
    """After each synchronised backward, check the averaged gradients for NaN/Inf (one flag all-reduced, so every
    rank decides alike): ``warn`` and step anyway, ``skip`` the optimizer step on every rank, ``error`` naming the
    first offending parameter. ``off``: no check, like DDP. Not applied with a gradient scaler (16-mixed), which
    skips such steps itself."""

    schedule: Literal["measured", "overlap", "after_backward", "auto", "by_topology"] = "measured"
    """When the buckets' collectives are issued. ``measured`` (the default): chosen at setup from a link probe on this
    run's own devices (``sync/link_probe.py``: a bucket-sized all-reduce alone and beside GEMMs, the slowest rank's
    figures) and a cost model of this run's buckets (``sync/schedule_choice.py``): the predicted fastest of
    ``overlap``, ``after_backward`` with and without ``optimizer_overlap`` (and, in a simulated world, ``overlap`` with
    8 SMs), in the configured dtype (bf16 joins with ``reduce_dtype: auto``). Printed at fit start with its evidence,
    kept in the run summary, the offer and the checkpoint (a resumed run in the same world does not probe again).
    Without a probe (``probe: auto`` on CPUs, ``mode: graph``, ``reduce_scatter``, one rank): ``overlap``, with the
    reason in the line. ``overlap``: each bucket as soon as its last gradient is ready, during backward (compiled, the
    step is cut where the buckets end, so that gradients become ready piece by piece). ``after_backward``: all of them
    back to back once backward ends (compiled, the step is one graph, uncut: no cut cost, and no collective holds SMs
    while backward computes). ``auto``: time a stated set of candidates on this job's first steps
    (``schedule_trial_steps`` each, the first untimed; the slowest rank's time) and keep the fastest on every rank:
    ``overlap`` with ``comm_sms`` default, 8, 4 and 2 (SMs on NCCL and in a simulated world only) and
    ``after_backward``, each in fp32 and — with ``reduce_dtype: auto`` — bf16 (``overlap/bf16/sms=4``,
    ``after_backward/fp32`` ...; :mod:`~lightning_static_dist.sync.schedule`). The choice is printed with the trial's
    cost (steps, seconds), kept in the checkpoint (a resumed run applies it without timing again) and in the run
    summary. Under ``auto`` every candidate runs the step as ``overlap`` compiles it (with ``compile.regional: auto``,
    the cut graph). ``by_topology``: the default before 0.2, now the same as ``measured`` (deprecated)."""
    probe: Union[bool, Literal["auto"]] = "auto"
    """``schedule: measured``: whether to probe the link at setup (a few hundred milliseconds on every rank). ``auto``:
    on CUDA devices (NCCL, or a simulated world with an emulated link), not on CPUs (Gloo's threads share the cores
    with the step: ``overlap`` is kept). ``true``: probe on any device (Gloo too). ``false``: never; ``overlap``."""
    optimizer_overlap: Union[bool, Literal["auto"]] = "auto"
    """With ``schedule: after_backward`` (and the after_backward steps of ``auto``): each bucket's parameters take
    their optimizer step as soon as that bucket's average lands, while later buckets are still in flight, instead of
    the step waiting for every bucket. ``auto``: on under the Trainer where nothing reads the gradients between
    backward and the step — automatic optimization, no gradient clipping, no gradient scaler (16-mixed), no override of
    ``on_after_backward``, ``on_before_optimizer_step`` or ``configure_gradient_clipping``, ``nonfinite: off``, no
    compression, ``all_reduce`` — with one optimizer of torch.optim's per-parameter ones (SGD, Adam, AdamW, Adamax,
    NAdam, RAdam, RMSprop, Adagrad); printed at fit start, with the reason when off. ``true``: the same, a run where it
    cannot apply refused in one line. A step hook registered after setup turns it off, in one line."""
    schedule_trial_steps: int = 6
    """``schedule: auto``: optimizer steps each candidate is tried for (the first of them untimed). The trial takes
    candidates x this: on NCCL with ``reduce_dtype: auto``, 10 x 6 = 60 steps; on Gloo with it, 4 x 6 = 24."""
    comm_sms: Optional[int] = None
    """SMs a gradient collective may use: NCCL's ``max_ctas`` (``ProcessGroupNCCL.Options().config``), so that fewer
    SMs are taken from backward's GEMMs; in a simulated world, the SMs an emulated link holds. ``None``: the
    library's own choice. Ignored by Gloo. Under ``schedule: auto`` the default the trial's 8, 4 and 2 are timed
    against."""

    @property
    def capacity(self) -> BucketCapacity:
        """``first_bucket_mb`` and ``bucket_mb`` in bytes."""
        return BucketCapacity.from_mib(self.first_bucket_mb, self.bucket_mb)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.schedule_trial_steps < 2:
            fail(f"{self.KEY}.schedule_trial_steps", self.schedule_trial_steps,
                 "must be an integer >= 2 (each schedule's first step is not timed)")
        if self.comm_sms is not None and not 1 <= self.comm_sms <= 1024:
            fail(f"{self.KEY}.comm_sms", self.comm_sms, "must be an integer number of SMs in [1, 1024], or null")
        if self.schedule == "by_topology":  # (its old meaning: docs/internals.md, "sync/config.py")
            warnings.warn(f"{self.KEY}.schedule='by_topology' is read as 'measured' (the link probed at setup);"
                          " write 'measured'", FutureWarning, stacklevel=2)
            self.schedule = "measured"
        for name in ("bucket_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if not 0 < value <= 4096:
                fail(f"{self.KEY}.{name}", value, "must be a number of MiB in (0, 4096]")


def overlap_hazards(schedule: str, *, graph: bool, sharded: bool, compression: str, nonfinite: str,
                    compile_optimizer: bool) -> list[str]:
    """What the ``strategy`` block shows that rules ``sync.optimizer_overlap`` out under ``schedule``, a clause each
    (``graph``: ``sync.mode: graph``; ``sharded``: the buckets are reduce-scattered; ``compression``:
    ``compression.name``). The run's own part: ``sync/optimizer_overlap.py``."""
    found = []
    if graph:
        found.append("sync.mode=graph averages inside the compiled backward, with no bucket to wait for")
    if schedule == "overlap":
        found.append("sync.schedule=overlap waits for every bucket as backward ends (the step per bucket needs"
                     " schedule after_backward or auto)")
    if schedule == "measured":  # (at setup the plan's schedule is settled, never "measured")
        found.append("sync.schedule=measured may choose overlap, which waits for every bucket as backward ends"
                     " (pin schedule after_backward or auto)")
    if sharded:
        found.append("reduce_scatter steps each rank's shards once every bucket is reduce-scattered")
    if compression != "none":
        found.append(f"compression.name={compression}: a compressor and its guard read the whole round")
    if nonfinite != "off":
        found.append(f"sync.nonfinite={nonfinite} checks every averaged gradient before the step")
    if compile_optimizer:
        found.append("compile.optimizer=true compiles one step over every parameter (a step per bucket would"
                     " compile a graph per bucket)")
    return found


def check_schedule(sync: SyncConfig, *, compression: str, sharded: bool, compile_optimizer: bool) -> None:
    """Whether ``sync.schedule`` (with ``reduce_dtype`` and ``optimizer_overlap``, which follow it) is allowed with the
    rest of the ``strategy`` block: the one place that decides, before any process starts; a refusal is one
    ``ConfigError`` line naming the key. ``sharded``: the buckets are reduce-scattered (``reduce: reduce_scatter``, or
    ``auto`` with a mesh whose ``dp_shard`` is not 1)."""
    key = SyncConfig.KEY
    if sync.reduce_dtype == "auto" and sync.schedule not in ("auto", "measured"):
        fail(f"{key}.reduce_dtype", sync.reduce_dtype, "the trial of strategy.sync.schedule=auto or the probe of"
             f" schedule=measured chooses it (schedule is {sync.schedule!r}); allowed: 'fp32', 'bf16', or 'auto' with"
             " schedule 'auto' or 'measured'")
    if sync.schedule not in ("overlap", "measured") and sync.mode == "graph":
        fail(f"{key}.schedule", sync.schedule, "with strategy.sync.mode=graph inductor schedules the"
             " collectives inside the compiled graph; allowed with graph: 'overlap'")
    if sync.schedule not in ("overlap", "measured") and sharded:
        fail(f"{key}.schedule", sync.schedule,
             "the sharded synchroniser issues its buckets during backward; with strategy.sync.reduce="
             "reduce_scatter (or a mesh with dp_shard > 1) allowed: 'overlap'")
    if sync.schedule == "auto" and compression == "auto":
        fail(f"{key}.schedule", sync.schedule,
             "two trials would time each other's steps (strategy.compression.name is 'auto'); allowed with it:"
             " 'overlap' or 'after_backward'")
    if sync.optimizer_overlap is True:  # what the block shows; the run's part at setup
        found = overlap_hazards(sync.schedule, graph=sync.mode == "graph", sharded=sharded, compression=compression,
                                nonfinite=sync.nonfinite, compile_optimizer=compile_optimizer)
        if found:
            fail(f"{key}.optimizer_overlap", True, f"{found[0]}; allowed with it: auto (off here), false")


def schedule_without_probe(sync: SyncConfig, *, device_type: str, world_size: int, sharded: bool,
                           free_links: bool = False) -> Optional[tuple[str, str]]:
    """``sync.schedule: measured`` where no probe decides it: ``(schedule, why)``; ``None`` where the link probe at
    setup decides (``participants/schedule_probe.py``). ``free_links``: a simulated world whose collectives cost
    nothing. The other schedules are not resolved here.

    Example::

        >>> schedule_without_probe(SyncConfig(), device_type="cpu", world_size=2, sharded=False)
        ('overlap', 'CPU ranks: Gloo shares the cores with the step; sync.probe=true measures them')
        >>> schedule_without_probe(SyncConfig(), device_type="cuda", world_size=2, sharded=False)
    """
    if sync.schedule != "measured":
        return None
    if world_size < 2:
        return "overlap", "one rank: nothing to average"
    if sync.mode == "graph":
        return "overlap", "sync.mode=graph: inductor schedules the collectives inside the compiled backward"
    if sharded:
        return "overlap", "reduce_scatter: the sharded synchroniser issues its buckets during backward"
    if sync.probe is False:
        return "overlap", "sync.probe=false"
    if sync.probe == "auto" and device_type != "cuda":
        return "overlap", f"{device_type.upper()} ranks: Gloo shares the cores with the step; sync.probe=true" \
                          " measures them"
    if free_links:  # (the probe would time nothing; the uncut step is the cheaper one)
        return "after_backward", "a simulated world with free links: no collective costs anything, and the step" \
                                 " runs uncut"
    return None


def launches_during_backward(schedule: str) -> bool:
    """Whether a schedule (``sync.schedule`` resolved, or a ``schedule: auto`` candidate's) issues each bucket as it
    fills during backward: every one but ``after_backward`` (``auto`` starts as ``overlap``, its trial switches it;
    ``measured`` is resolved at setup, before any bucket is issued)."""
    return schedule != "after_backward"


def reduce_torch_dtype(reduce_dtype: str) -> Optional[torch.dtype]:
    """The dtype ``sync.reduce_dtype`` (or a ``schedule: auto`` candidate's) averages in: ``bf16`` is
    ``torch.bfloat16``; ``fp32`` and ``auto`` are ``None``, the gradients' own (``auto`` starts there, its trial
    switches it)."""
    return torch.bfloat16 if reduce_dtype == "bf16" else None
