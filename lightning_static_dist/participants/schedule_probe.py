"""``strategy.sync.schedule: measured``: the link probed at setup, the schedule predicted and settled in the plan.

:class:`ScheduleProbe` is the first participant to set up: before the synchroniser is built and the step compiled
(both follow the schedule: ``after_backward`` compiles the step uncut), it probes the link
(:mod:`~lightning_static_dist.sync.link_probe`), predicts every candidate on this run's buckets
(:mod:`~lightning_static_dist.sync.schedule_choice`) and settles the plan's pending schedule through the world
(``view.settle_schedule``). The choice is printed with its evidence on rank 0, kept in the checkpoint (a resumed run
in the same world applies it without probing again, and says so) and offered to the run summary.

Example (the roster builds it)::

    probe = ScheduleProbe(strategy)
    probe.setup(context)      # "static_dist: sync.schedule measured: after_backward/fp32+optimizer_overlap (probe ..."
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.participants.base import StepContext, StepParticipant, StrategyView
from lightning_static_dist.simulate import group as simulated
from lightning_static_dist.sync.link_probe import probe_link
from lightning_static_dist.sync.optimizer_overlap import step_hazards
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
    """The probe's GEMM width: the model's widest linear layer (its backward's GEMMs), at least 256."""
    widths = [m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear)]
    width = max(widths, default=1024 if device.type == "cuda" else 256)
    return max(256, min(width, 8192))


class ScheduleProbe(StepParticipant):
    """Settles ``sync.schedule: measured`` at setup, once per world: probed, or taken from the checkpoint."""

    def __init__(self, view: StrategyView) -> None:
        self._view = view
        self.choice: Optional[MeasuredChoice] = None
        """The measured choice of this run (kept across stages in the same world; readable after teardown)."""
        self._saved: Optional[dict[str, Any]] = None
        self._restore_sms: Optional[tuple[Any, Optional[int]]] = None

    def setup(self, context: StepContext) -> None:
        view = self._view
        plan = view.plan
        if plan.schedule != "measured":
            return
        module = view.lightning_module if view.lightning_module is not None else view.model
        assert module is not None
        step_per_bucket = self._step_per_bucket_possible(context)
        choice = self._reusable()
        if choice is None:
            choice = self._probe(module, step_per_bucket)
        candidate = choice.candidate  # (its optimizer overlap: OptimizerOverlap reads the plan's choice)
        self.choice = choice
        line = f"sync.schedule measured: {choice.describe()}"
        view.settle_schedule(plan.settled(candidate.schedule, line, choice, reduce_dtype=candidate.reduce_dtype,
                                          comm_sms=candidate.comm_sms))
        if candidate.comm_sms is not None and view.simulation is not None:
            self._restore_sms = (simulated.WORLD.link, simulated.WORLD.sms)
            simulated.set_link(simulated.WORLD.link, candidate.comm_sms)
        rank_zero_info(f"static_dist: {line}")

    def _step_per_bucket_possible(self, context: StepContext) -> bool:
        """Whether ``after_backward`` could step the optimizer per bucket in this run (``optimizer_overlap`` not false
        and nothing rules it out: the config's hazards under ``after_backward``, and the run's)."""
        view = self._view
        plan = view.plan
        if plan.sync.optimizer_overlap is False:
            return False
        hazards = plan.sync.optimizer_overlap_hazards(plan.compression.name, plan.compile.optimizer,
                                                      sharded=plan.reduce_by_scatter, schedule="after_backward")
        module = view.lightning_module
        hazards += step_hazards(context.gradient_readers,
                                automatic_optimization=getattr(module, "automatic_optimization", True),
                                scaler=getattr(view.precision_plugin, "scaler", None) is not None,
                                optimizers=view.optimizers)
        return not hazards

    def _reusable(self) -> Optional[MeasuredChoice]:
        """This run's earlier choice, or the checkpoint's, when made in the same world (size and device type)."""
        view = self._view
        for found, source in ((self.choice, None), (self._load_saved(), "checkpoint")):
            if found is not None and found.world == view.world_size and found.device_type == view.root_device.type:
                if source is None:
                    return found
                return MeasuredChoice(**{**found.__dict__, "source": source, "probe_s": 0.0})
        return None

    def _load_saved(self) -> Optional[MeasuredChoice]:
        saved, self._saved = self._saved, None
        try:
            return MeasuredChoice.from_dict(saved) if saved else None
        except (TypeError, ValueError, KeyError):
            return None  # (a checkpoint of another version: probe again)

    def _probe(self, module: torch.nn.Module, step_per_bucket: bool) -> MeasuredChoice:
        view = self._view
        plan = view.plan
        device = view.root_device
        capacity = plan.capacity
        buckets = bucket_sizes(module, capacity.first_bytes, capacity.bytes)
        nbytes = max(2**16, min(capacity.bytes, max(buckets, default=0)))  # (a bucket's size, the largest)
        width = gemm_width(module, device)
        group = view.dp_group
        measures = [probe_link(group, device, nbytes, width, rows=PROBE_ROWS if device.type == "cuda" else width)]
        link = view.simulation.link if view.simulation is not None else None
        if link is not None and plan.sync.comm_sms != SMS_CANDIDATE:  # (SMs switch here only in a simulated world)
            kept = (simulated.WORLD.link, simulated.WORLD.sms)
            simulated.set_link(link, SMS_CANDIDATE)
            try:
                measures.append(probe_link(group, device, nbytes, width, sms=SMS_CANDIDATE,
                                           rows=PROBE_ROWS if device.type == "cuda" else width))
            finally:
                simulated.set_link(*kept)
        rates: dict[Optional[int], LinkRates] = {m.rates.sms: m.rates for m in measures}
        dtypes = ("fp32", "bf16") if plan.sync.reduce_dtype == "auto" else \
            ("bf16",) if plan.sync.reduce_dtype == "bf16" else ("fp32",)
        compiled_cut = plan.compile.enabled and plan.compile.regional == "auto"
        return choose_schedule(rates, buckets, view.world_size, dtypes, step_per_bucket,
                               mem_gbps=measures[0].mem_gbps,
                               cut_s_per_piece=CUT_S_PER_PIECE if compiled_cut else 0.0,
                               device_type=device.type, probe_s=sum(m.probe_s for m in measures),
                               details={"nbytes": measures[0].nbytes, "gemm_width": width, "gemms": measures[0].gemms,
                                        "mem_gbps": round(measures[0].mem_gbps, 1), "buckets": len(buckets)})

    def state_dict(self) -> dict[str, Any]:
        return {PROBE_KEY: self.choice.as_dict()} if self.choice is not None else {}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.pop(PROBE_KEY, None)
        if saved is not None:
            self._saved = saved  # (Lightning loads before the strategy's setup: applied there)

    def teardown(self, failed: bool) -> None:
        if self._restore_sms is not None:  # (after a failure too: the SMs of this fit are not the next one's)
            simulated.set_link(*self._restore_sms)
            self._restore_sms = None
