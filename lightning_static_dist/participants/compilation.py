"""``strategy.compile``: the LightningModule compiled at setup (or as ``trainer.fit(torch.compile(model))`` asked;
``enabled: auto`` on CUDA), the ranks' compiled graphs compared once before the plan's first bucket collective, and
the training loader's short last batch told to the report (it gets a graph of its own; no batch is dropped).

Example (the strategy builds it in its ``__init__``)::

    compile = StaticCompile(strategy)
    compile.adopt(dynamo_ctx)        # trainer.fit(torch.compile(model)): compile with the user's backend
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_static_dist.callbacks import GraphReport
from lightning_static_dist.compile import (
    CompileReport,
    backend_of,
    compile_optimizer_step,
    compile_regions,
    find_regions,
    graph_mode_patches,
    is_compiled,
)
from lightning_static_dist.compile.cudagraphs import CudagraphChoice, capture_skips, choose_cudagraphs
from lightning_static_dist.compile.shapes import tail_rows
from lightning_static_dist.config import ConfigError
from lightning_static_dist.agreement.fingerprint import RankMismatchError, first_difference
from lightning_static_dist.participants.base import StepContext, StepParticipant, StrategyView
from lightning_static_dist.plan.features import CompilePlan
from lightning_static_dist.plan.step_plan import StepPlan


def check_same_graphs(report: Any, group: Optional[dist.ProcessGroup]) -> None:
    """Every rank compiled the same program (a ``CompileReport``'s structure lines: its graphs' tensor operations,
    whatever the shapes); a difference stops every rank with the first one. Ranks whose batches differ in shape
    (text padded to each batch's longest sequence) compiled the same program for other shapes: rank 0 says so in
    one line, and training goes on (each rank runs the graph of its own batch; the gradients are averaged as
    always). Collective: after round 1, before the first bucket collective of the plan."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (report.structure_lines(), report.shape_lines()), group=group)
    difference = first_difference([structures for structures, _ in gathered])
    if difference is not None:
        raise RankMismatchError(f"static_dist: ranks disagree on what they compiled (graph structures): {difference}."
                                " Every rank must run the same program.")
    shapes = [" ".join(lines[:1]) for _, lines in gathered]
    if len(set(shapes)) > 1:
        seen = ", ".join(f"rank {rank}: {shape or '-'}" for rank, shape in enumerate(shapes[:4]))
        note = (f"the ranks compiled their step for different input shapes ({seen}{' ...' if len(shapes) > 4 else ''});"
                " each runs the graph of its own batch, the gradients are averaged as always")
        report.notes.append(note)
        rank_zero_info(f"static_dist: {note}")


class StaticCompile(StepParticipant):
    """Compiles the model at every setup that finds it uncompiled; holds what compilation did on this rank."""

    def __init__(self, view: StrategyView) -> None:
        self._view = view
        self.report: Optional[CompileReport] = None
        """What static compilation did on this rank (``None`` when the model is not compiled)."""
        self.requested_backend: Optional[str] = None
        """Set when ``trainer.fit(torch.compile(model))`` asked for compilation with this backend (``""``: its
        backend is the default, ``compile.backend``)."""
        self._resolution: Optional[tuple[CompilePlan, CudagraphChoice]] = None
        self._resolved_for: Optional[StepPlan] = None
        """The plan :attr:`_resolution` was made from (a settled schedule is a new plan, with its cut)."""
        self.graphs_checked = True
        """Whether the ranks' compiled graphs were compared since the last compilation."""
        self._tail_rows: Optional[int] = None
        """The rows of the training loader's short last batch (``process_dataloader``; ``None``: none)."""

    def adopt(self, dynamo_ctx: Any) -> None:
        """Compile the way ``torch.compile(model)`` asked: with the user's backend (else ``compile.backend``, read
        from the plan at setup: the world is not known yet)."""
        self.requested_backend = backend_of(dynamo_ctx) or ""
        self._resolution = None

    def run_plan(self) -> CompilePlan:
        """The plan's ``strategy.compile`` as it applies to this run: enabled by ``trainer.fit(torch.compile(model))``, and with
        ``reduce_scatter`` a ``regional: auto`` resolved to the blocks one by one (each block waits for its own
        parameters' all-gather in a forward pre-hook; a graph cut at the buckets could not follow that synchroniser's
        static plan), or to the whole step uncut for a model without repeated blocks; ``cudagraphs`` resolved to a
        bool (:meth:`cudagraphs` says why)."""
        return self._resolved()[0]

    def cudagraphs(self) -> CudagraphChoice:
        """``compile.cudagraphs`` for this run, and why: ``auto`` resolved from the device and the features that
        move parameters between steps (:func:`~lightning_static_dist.compile.cudagraphs.choose_cudagraphs`)."""
        return self._resolved()[1]

    def _resolved(self) -> tuple[CompilePlan, CudagraphChoice]:
        """:meth:`run_plan` and :meth:`cudagraphs`, resolved once per stage (the choice is made on the resolved config;
        finding the repeated blocks walks the model)."""
        plan = self._view.plan
        if self._resolution is None or self._resolved_for is not plan:  # (settled since: the cut follows the choice)
            self._resolved_for = plan
            config = plan.compile  # (enabled: auto decided by the device there)
            if self.requested_backend is not None:
                # the user passed torch.compile(model); Lightning's compile check unwrapped it
                config = dataclasses.replace(config, enabled=True, backend=self.requested_backend or config.backend)
            if config.regional == "auto" and plan.sync.reduce_by_scatter:
                config = dataclasses.replace(config, regional=bool(self.repeated_blocks()))
            choice = self._choose_cudagraphs(config)
            self._resolution = dataclasses.replace(config, cudagraphs=choice.on), choice
        return self._resolution

    def _choose_cudagraphs(self, config: CompilePlan) -> CudagraphChoice:
        view = self._view
        plan = view.plan
        context = view.context
        return choose_cudagraphs(config, view.root_device, sync_mode=plan.sync.mode,
                                 gathers_parameters=plan.sync.reduce_by_scatter or plan.embedding.shard is not False,
                                 micro_batches=context.micro_batches if context is not None else 1,
                                 automatic_optimization=getattr(view.lightning_module, "automatic_optimization", True))

    def repeated_blocks(self) -> list[torch.nn.Module]:
        """The blocks ``regional: true`` would compile one by one (none when the model has no repeated blocks)."""
        assert self._view.lightning_module is not None
        try:
            return [m for _, m in find_regions(self._view.lightning_module, True)]
        except ConfigError:
            return []

    def before_optimizers(self, context: StepContext) -> None:
        self._resolution = None  # a stage resolves its own (a previous stage's teardown may have stopped early)

    def setup(self, context: StepContext) -> None:
        """Compile the LightningModule as ``strategy.compile`` says (or as a ``torch.compile``-d model asked)."""
        view = self._view
        module = view.lightning_module
        assert module is not None
        config, cudagraphs = self._resolved()
        plan = view.plan
        graph_mode = plan.sync.mode == "graph"
        if graph_mode and not config.enabled:
            raise ConfigError("strategy.sync.mode='graph': the collectives live in the compiled graph, which needs"
                              " strategy.compile.enabled=true (or trainer.fit(torch.compile(model))); allowed"
                              " without compile: 'hooks'")
        if config.enabled and not is_compiled(module):
            if context.fitting:
                asked = "the torch.compile()-d model" if self.requested_backend is not None else "the training step"
                off = ("pass the model uncompiled" if self.requested_backend is not None
                       else "strategy.compile.enabled=false runs it eagerly")
                rank_zero_info(f"static_dist: compiling {asked} (backend {config.backend!r}; the compile report follows"
                               f" the first step and says how long it took); {off}")
            # one graph for forward + loss, cut where the buckets end so that collectives still overlap backward
            # (decided from the config, not from this stage: a validate before fit compiles for the fit too)
            cut = config.cut
            patches = graph_mode_patches(plan.sync.capacity) if graph_mode else None
            self.report = compile_regions(module, config, split=(cut.first_bytes, cut.bytes) if cut else None,
                                          inductor_patches=patches)
            self.report.cudagraphs = cudagraphs.describe()
            self.report.tail_rows = self._tail_rows
            capture_skips(self.report.cudagraph_skips)
            if config.optimizer and context.fitting:
                for optimizer in view.optimizers:
                    compile_optimizer_step(optimizer, config, self.report)
            context.add_callback(GraphReport())
            self.graphs_checked = False

    def ready_groups(self) -> Optional[Mapping[int, int]]:
        """What compilation offers the bucket plan: ``id(parameter)`` -> the compiled piece that readies its gradient
        (``None`` where the step is not cut at the buckets)."""
        report = self.report
        return report.splitter.ready_groups if report is not None and report.splitter is not None else None

    def check_graphs_once(self) -> None:
        """Every rank compiled the same graphs (collective, once per compilation): after round 1, whose collectives
        are sized by the parameter list checked at setup, and before the first bucket collective of the plan."""
        if self.report is None or self.graphs_checked:
            return
        self.graphs_checked = True
        check_same_graphs(self.report, self._view.dp_group)

    def process_dataloader(self, dataloader: object) -> None:
        """The training loader's short last batch, if any, told to the report: it is trained (``drop_last`` stays the
        user's) and gets one graph of its own (``compile/shapes.py``)."""
        context = self._view.context
        if context is not None and not context.training:
            return
        self._tail_rows = tail_rows(dataloader)
        if self.report is not None:
            self.report.tail_rows = self._tail_rows

    def teardown(self, failed: bool) -> None:
        self.requested_backend, self._resolution = None, None
