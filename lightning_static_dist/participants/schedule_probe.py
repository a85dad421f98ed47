"""``strategy.sync.schedule: measured``: the link probed at setup, the schedule predicted and settled in the plan.

:class:`ScheduleProbe` is the first participant to set up: before the synchroniser is built and the step compiled
(both follow the schedule: ``after_backward`` compiles the step uncut), it probes the link
(:mod:`~lightning_static_dist.sync.link_probe`), predicts every candidate on this run's buckets
(:mod:`~lightning_static_dist.sync.schedule_choice`) and settles the plan's pending schedule through the world
(``view.settle_schedule``). The choice is printed with its evidence on rank 0, kept in the checkpoint (a resumed run
in the same world applies it without probing again, and says so) and offered to the run summary.

Example (the roster builds it)::

    probe = ScheduleProbe(strategy, compile)
    probe.setup(context)      # "static_dist: sync.schedule measured: after_backward/fp32+optimizer_overlap (probe ..."
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.participants.base import ModelWorldView, StepContext, StepParticipant
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.optimizer_overlap import run_hazards
from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.simulate import group as simulated
from lightning_static_dist.sync.link_probe import probe_link
from lightning_static_dist.sync.schedule_choice import (
    CUT_S_PER_PIECE,
    SMS_CANDIDATE,
    LinkRates,
    MeasuredChoice,
    choose_schedule,
)

PROBE_KEY = "static_dist_sync_schedule_measured"
"""The checkpoint entry holding the measured choice and its evidence."""

PROBE_ROWS = 8192
"""Rows of the probe's GEMMs on a GPU (a token batch's worth: every SM gets tiles, as backward's GEMMs do)."""


def bucket_sizes(module: torch.nn.Module, first_bytes: int, capacity: int) -> list[int]:
    """The gradient bytes of each bucket in the order they are issued, as the synchroniser fills them: trainable
    parameters from the last registered (whose gradients are ready first), a small first bucket, then full ones."""
    sizes: list[int] = []
    room = first_bytes
    for param in reversed([p for p in module.parameters() if p.requires_grad]):
        nbytes = param.numel() * param.element_size()
        if sizes and sizes[-1] + nbytes <= room:
            sizes[-1] += nbytes
            continue
        if sizes:
            room = capacity
        sizes.append(nbytes)
    return sizes


def gemm_width(module: torch.nn.Module, device: torch.device) -> int:
    """The probe's GEMM width: the input width that most of the model's linear weights have (where most of backward's
    GEMM work is: GPT-2 small's 768, not its MLP's 3072), between 256 and 8192.

    Why the width matters, with measurements: docs/performance.md, "How the schedule is chosen"."""
    weights: dict[int, int] = {}
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            weights[m.in_features] = weights.get(m.in_features, 0) + m.weight.numel()
    width = max(weights, key=lambda w: (weights[w], w)) if weights else (1024 if device.type == "cuda" else 256)
    return max(256, min(width, 8192))


class ScheduleProbe(StepParticipant):
    """Settles ``sync.schedule: measured`` at setup of each fitting stage: probed once per world, or taken from the
    checkpoint. Every step that decides is agreed between the ranks (rank 0's checkpoint entry, the optimizer
    overlap's possibility, the probe's figures), so that every rank issues the same collectives and chooses alike."""

    def __init__(self, view: ModelWorldView, compile: StaticCompile) -> None:
        self._view = view
        self._compile = compile
        self.choice: Optional[MeasuredChoice] = None
        """The measured choice of this run (readable after teardown)."""
        self._saved: Optional[dict[str, Any]] = None
        self._restore_sms: Optional[tuple[Any, Optional[int]]] = None
        self._settled = False
        """Whether this fit's setup has settled the schedule (a checkpoint loaded after it comes too late)."""

    def setup(self, context: StepContext) -> None:
        view = self._view
        plan = view.plan
        if plan.sync.schedule != "measured":
            return
        if not context.fitting:  # (nothing is averaged: no probe; a fit after it probes)
            view.settle_schedule(plan.settled("overlap", "sync.schedule measured: overlap (not fitting: nothing is"
                                              " averaged; the fit probes)"))
            return
        module = view.lightning_module if view.lightning_module is not None else view.model
        assert module is not None
        step_per_bucket, saved = self._agreed(self._step_per_bucket_possible(context), self._saved)
        self._saved = None
        dtypes, budgets = self._candidates()
        buckets = bucket_sizes(module, plan.sync.capacity.first_bytes, plan.sync.capacity.bytes)
        choice = self._from_checkpoint(saved, dtypes, budgets, step_per_bucket)
        if choice is None and self.choice is not None and self._same_world(self.choice):
            choice = self._predict(self.choice, buckets, dtypes, step_per_bucket)  # (measured in an earlier stage)
        if choice is None:
            choice = self._predict(self._probe(module, buckets, budgets), buckets, dtypes, step_per_bucket)
        candidate = choice.candidate  # (its optimizer overlap: OptimizerOverlap reads the plan's choice)
        self.choice = choice
        line = f"sync.schedule measured: {choice.describe()}"
        view.settle_schedule(plan.settled(candidate.schedule, line, choice, reduce_dtype=candidate.reduce_dtype,
                                          comm_sms=candidate.comm_sms))
        self._settled = True
        if candidate.comm_sms is not None and view.simulation is not None:
            self._restore_sms = (simulated.WORLD.link, simulated.WORLD.sms)
            simulated.set_link(simulated.WORLD.link, candidate.comm_sms)
        rank_zero_info(f"static_dist: {line}")

    def _agreed(self, step_per_bucket: bool, saved: Optional[dict[str, Any]]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Whether every rank can step per bucket, and rank 0's checkpoint entry (a collective: a rank that decides
        alone to probe, or applies another choice, would issue other collectives than its peers)."""
        view = self._view
        device = view.root_device if view.root_device.type == "cuda" else torch.device("cpu")
        flag = torch.tensor([1 if step_per_bucket else 0], device=device)
        entry = [saved]
        with waiting_in("the ranks' agreement before the link probe (sync.schedule measured)"):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=view.dp_group)
            torch.distributed.broadcast_object_list(entry, src=0, group=view.dp_group, device=device)
        return bool(flag.item()), entry[0]

    def _candidates(self) -> tuple[tuple[str, ...], tuple[Optional[int], ...]]:
        """The dtypes this run allows (bf16 only with ``reduce_dtype: auto``, or asked) and the SM budgets the probe
        can switch: a simulated world's link, unless ``comm_sms`` is pinned."""
        view = self._view
        plan = view.plan
        dtypes = ("fp32", "bf16") if plan.sync.reduce_dtype == "auto" else \
            ("bf16",) if plan.sync.reduce_dtype == "bf16" else ("fp32",)
        link = view.simulation.link if view.simulation is not None else None
        budgets: tuple[Optional[int], ...] = (None,)
        if link is not None and plan.sync.comm_sms is None and link.sms != SMS_CANDIDATE:
            budgets = (None, SMS_CANDIDATE)
        return dtypes, budgets

    def _same_world(self, choice: MeasuredChoice) -> bool:
        view = self._view
        return (choice.world, choice.device_type, choice.details.get("simulated")) == (
            view.world_size, view.root_device.type, view.simulation is not None)

    def _from_checkpoint(self, saved: Optional[dict[str, Any]], dtypes: tuple[str, ...],
                         budgets: tuple[Optional[int], ...], step_per_bucket: bool) -> Optional[MeasuredChoice]:
        """The checkpoint's choice, where it was made in this world and is one of this run's candidates (a resumed run
        that now pins fp32, or cannot step per bucket, probes again)."""
        try:
            found = MeasuredChoice.from_dict(saved) if saved else None
        except (TypeError, ValueError, KeyError):
            return None  # (a checkpoint of another version: probe again)
        if found is None or not self._same_world(found):
            return None
        candidate = found.candidate
        if candidate.reduce_dtype not in dtypes or candidate.comm_sms not in budgets or (
                candidate.step_per_bucket and not step_per_bucket):
            return None
        return dataclasses.replace(found, source="checkpoint", probe_s=0.0)

    def _step_per_bucket_possible(self, context: StepContext) -> bool:
        """Whether ``after_backward`` could step the optimizer per bucket on this rank (``optimizer_overlap`` not
        false and nothing rules it out: the config's hazards under ``after_backward``, and the run's)."""
        view = self._view
        plan = view.plan
        if plan.sync.optimizer_overlap is False:
            return False
        return not (plan.overlap_hazards("after_backward") + run_hazards(view, context))

    def _probe(self, module: torch.nn.Module, buckets: list[int],
               budgets: tuple[Optional[int], ...]) -> MeasuredChoice:
        """The link's figures at each SM budget (a collective), as a choice to predict from."""
        view = self._view
        device = view.root_device
        nbytes = max(2**16, min(view.plan.sync.capacity.bytes, max(buckets, default=0)))  # (a bucket's size, the largest)
        width = gemm_width(module, device)
        rows = PROBE_ROWS if device.type == "cuda" else width
        measures = []
        for sms in budgets:
            if sms is None:
                measures.append(probe_link(view.dp_group, device, nbytes, width, rows=rows))
                continue
            kept = (simulated.WORLD.link, simulated.WORLD.sms)  # (SMs switch here only in a simulated world)
            simulated.set_link(kept[0], sms)
            try:
                measures.append(probe_link(view.dp_group, device, nbytes, width, sms=sms, rows=rows))
            finally:
                simulated.set_link(*kept)
        return MeasuredChoice("", {}, tuple(m.rates for m in measures), view.world_size, device.type,
                              probe_s=sum(m.probe_s for m in measures),
                              details={"nbytes": measures[0].nbytes, "gemm_width": width, "gemms": measures[0].gemms,
                                       "first_use_s": round(sum(m.first_use_s for m in measures), 3),
                                       "mem_gbps": round(measures[0].mem_gbps, 1),
                                       "simulated": view.simulation is not None})

    def _predict(self, measured: MeasuredChoice, buckets: list[int], dtypes: tuple[str, ...],
                 step_per_bucket: bool) -> MeasuredChoice:
        """Each candidate predicted on this run's buckets from ``measured``'s figures (pure: every rank alike)."""
        config = self._compile.run_plan()  # (enabled as this run resolves it: auto on CUDA, or torch.compile(model))
        compiled_cut = bool(config.enabled) and config.regional == "auto"
        rates: dict[Optional[int], LinkRates] = {r.sms: r for r in measured.rates}
        return choose_schedule(rates, buckets, measured.world, dtypes, step_per_bucket,
                               mem_gbps=float(measured.details.get("mem_gbps", 0.0)) or None,
                               cut_s_per_piece=CUT_S_PER_PIECE if compiled_cut else 0.0,
                               device_type=measured.device_type, probe_s=measured.probe_s,
                               details={**measured.details, "buckets": len(buckets)})

    def state_dict(self) -> dict[str, Any]:
        return {PROBE_KEY: self.choice.as_dict()} if self.choice is not None else {}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.pop(PROBE_KEY, None)
        if saved is None:
            return
        if not self._settled:
            self._saved = saved  # (Lightning loads before the strategy's setup: applied there)
            return
        try:  # (Fabric: ``fabric.load`` after ``fabric.setup``, which has measured and compiled already)
            theirs = MeasuredChoice.from_dict(saved).choice
        except (TypeError, ValueError, KeyError):
            return
        assert self.choice is not None  # (set with the settled plan)
        ours = self.choice.choice
        if theirs != ours:
            rank_zero_warn(f"static_dist: the checkpoint's sync.schedule measured choice ({theirs}) was loaded after"
                           f" setup, which had measured {ours}: this run keeps {ours} (the schedule is chosen at setup)")

    def teardown(self, failed: bool) -> None:
        self._settled = False
        if self._restore_sms is not None:  # (after a failure too: the SMs of this fit are not the next one's)
            simulated.set_link(*self._restore_sms)
            self._restore_sms = None
