"""The compiler functions: the configured backend wrapped to record each graph, and ``inductor_distributed``.

:class:`RecordingBackend` is what every region is compiled with: it resolves ``strategy.compile.backend`` /
``mode`` as ``torch.compile`` would and records each graph it compiles into a
:class:`~lightning_static_dist.compile.report.CompileReport`. :func:`inductor_distributed` is inductor with its
communication passes on (:func:`graph_mode_patches`), registered as a dynamo backend when the package is imported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
import torch._dynamo
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from lightning_static_dist.compile.report import (
    CompileReport,
    GraphRecord,
    _code_name,
    _compiling_code,
    _device_transfers,
    _guard_failures,
)
from lightning_static_dist.compile.shapes import input_shapes, is_dynamic, structure
from lightning_static_dist.compile.config import CompileOptions
from lightning_static_dist.compile.cudagraphs import inductor_options
from lightning_static_dist.wording import counted

log = logging.getLogger(__name__)


def _resolve_backend(config: CompileOptions, inductor_patches: Optional[dict[str, Any]] = None) -> Callable[..., Any]:
    """The compiler function for ``config.backend``/``config.mode``, as ``torch.compile`` would pick it, with
    ``compile.cudagraphs`` (resolved) and ``inductor_patches`` on top when the backend is inductor."""
    if config.backend in ("inductor", "inductor_distributed"):
        from torch._inductor.compile_fx import compile_fx

        options = torch._inductor.list_mode_options(config.mode, config.torch_dynamic) if config.mode != "default" else {}
        options = {**options, **inductor_options(config)}  # compile.cudagraphs, once resolved
        if config.backend == "inductor_distributed" or inductor_patches:
            options = {**options, **(inductor_patches or graph_mode_patches())}
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=options)
    return torch._dynamo.lookup_backend(config.backend)  # CompileConfig checked that it is registered


class RecordingBackend:
    """Wraps the configured compiler: records each graph (structure, compile seconds, device transfers).

    One instance serves every region (why: docs/internals.md, "compile/backends.py").
    """

    def __init__(self, config: CompileOptions, report: CompileReport,
                 inductor_patches: Optional[dict[str, Any]] = None) -> None:
        self._compiler = _resolve_backend(config, inductor_patches)
        self._report = report
        self._compiles: dict[int, Optional[int]] = {}
        """dynamo frame id -> the compile number this backend last compiled it under."""
        self._failures_seen: dict[int, int] = {}
        """dynamo frame id -> how many of dynamo's guard failures for its code had been recorded at that compile."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        started = time.perf_counter()
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = compile_id.frame_id if compile_id is not None else None
        code = _compiling_code()
        failures = _guard_failures(code)
        recompiled = frame is not None and self._compiles.get(frame, compile_id.frame_compile_id) != compile_id.frame_compile_id
        if recompiled and not self._report.in_tail:  # (the short last batch's graph is expected: the report names it)
            # a frame this backend compiled before, compiled again: a guard failed, and dynamo recorded which against
            # each of the frame's cached graphs (newest first) since we last looked. Dynamo's own numbering counts
            # other backends' compiles of the same code too (another model, an earlier fit)
            new = failures[self._failures_seen.get(frame, 0):]
            guard = new[0] + (f" (and {counted(len(new) - 1, 'older graph')} of this frame)" if len(new) > 1 else "") \
                if new else "dynamo recorded no failed guard"
            self._report.recompiles.append(f"{_code_name(code)} compiled again in region"
                                           f" {self._report.active_region!r}: {guard}")
        if frame is not None:
            self._compiles[frame] = compile_id.frame_compile_id
            self._failures_seen[frame] = len(failures)
        compiled = self._compiler(gm, example_inputs)
        params = sum(isinstance(x, nn.Parameter) and x.requires_grad for x in example_inputs)
        self._report.graphs.append(GraphRecord(
            len(gm.graph.nodes), structure(gm), time.perf_counter() - started, self._report.active_region, params,
            input_shapes(example_inputs), is_dynamic(example_inputs), self._report.in_tail, str(compile_id or "")))
        for transfer, in_library in _device_transfers(gm):
            if in_library:  # not the user's to change: one line for all of them, once (the report lists where)
                if not self._report.library_transfers and rank_zero_only.rank == 0:  # (one line, not one per rank)
                    log.warning("static_dist: device transfers inside compiled graphs from library code, the first at"
                                f" {transfer}; not yours to move (the compile report lists every place)")
                if transfer not in self._report.library_transfers:
                    self._report.library_transfers.append(transfer)
            elif transfer not in self._report.placement:
                self._report.placement.append(transfer)
                if rank_zero_only.rank == 0:  # (every rank compiles the same graph: one line, not one per rank)
                    log.warning(f"static_dist: device transfer inside a compiled graph: {transfer}")
        return self._counted(compiled)

    def _counted(self, compiled: Any) -> Any:
        """``compiled``, counting its runs in the report: a region's call that ran no compiled graph ran eagerly
        (after dynamo's recompile limit). Dynamo reads its calling convention from ``_boxed_call``: kept."""
        report = self._report

        def run(*args: Any) -> Any:
            report.graph_runs += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run


# ------------------------------------------------------------------------------- the inductor_distributed backend

class CapacityMiB(Protocol):
    """What compile reads of a bucket capacity: the first bucket's size and the later ones', in MiB. The caller
    passes it (``sync/plan.py``'s ``BucketCapacity`` has this shape): compile sits below ``sync/`` and imports none
    of it."""

    @property
    def first_mib(self) -> float: ...

    @property
    def mib(self) -> float: ...


#: the capacity ``inductor_distributed`` buckets with where no plan gives one (the backend used without the strategy),
#: given once by :func:`register_inductor_distributed` when the package is imported
_registered_capacity: Optional[CapacityMiB] = None


def graph_mode_patches(capacity: Optional[CapacityMiB] = None) -> dict[str, Any]:
    """Inductor settings that make it communication-aware, each only where this torch version has it: bucket the
    traced all-reduces (the first bucket ``capacity.first_mib``, later ones ``capacity.mib``; ``None``: the capacity
    given to :func:`register_inductor_distributed`, for ``inductor_distributed`` used without the strategy;
    inductor's default is one 2 GB bucket, issued after the whole backward) and reorder collectives against compute
    (waits sunk, collectives raised; the pass names changed between torch versions)."""
    import torch._inductor.comms as comms

    config = torch._inductor.config
    capacity = capacity if capacity is not None else _registered_capacity
    patches: dict[str, Any] = {}
    if hasattr(config, "bucket_all_reduces_fx") and capacity is not None:
        patches["bucket_all_reduces_fx"] = "all"
        patches["bucket_all_reduces_fx_bucket_size_determinator"] = _BucketSizes(capacity.first_mib, capacity.mib)
    if hasattr(config, "reorder_for_compute_comm_overlap"):
        wanted = (("sink_waits_iterative", "sink_waits"), ("reorder_communication_preserving_peak_memory", "raise_comms"))
        passes = [next(n for n in names if hasattr(comms, n)) for names in wanted if any(hasattr(comms, n) for n in names)]
        if passes:
            patches["reorder_for_compute_comm_overlap"] = True
            patches["reorder_for_compute_comm_overlap_passes"] = passes
    return patches


class _BucketSizes:
    """Inductor's all-reduce bucket size determinator: MiB for bucket ``i`` (an object, not a lambda: inductor's
    cache keys its config, and pickles it)."""

    def __init__(self, first_mb: float, later_mb: float) -> None:
        self.first_mb, self.later_mb = first_mb, later_mb

    def __call__(self, bucket_id: int) -> float:
        return self.first_mb if bucket_id == 0 else self.later_mb

    def __repr__(self) -> str:
        return f"{self.first_mb}/{self.later_mb} MiB"


def inductor_distributed(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Inductor with communication-aware passes (:func:`graph_mode_patches`, default bucket sizes).

    Registered as the dynamo backend ``"inductor_distributed"`` when ``lightning_static_dist`` is imported::

        torch.compile(model, backend="inductor_distributed")
    """
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=graph_mode_patches())


def register_inductor_distributed(capacity: CapacityMiB) -> None:
    """Register :func:`inductor_distributed` as a dynamo backend, bucketing by ``capacity`` where no plan gives one
    (the package's import passes ``strategy.sync``'s defaults)."""
    global _registered_capacity
    _registered_capacity = capacity
    if "inductor_distributed" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(inductor_distributed, name="inductor_distributed")


def backend_of(dynamo_ctx: Any) -> Optional[str]:
    """The backend name a ``torch.compile``-d model was compiled with, if it can be read (private, guarded).

    The name sits a few ``_torchdynamo_orig_backend`` wrappers deep, and the depth differs between torch versions.
    """
    obj = getattr(dynamo_ctx, "callback", None)
    registered = set(torch._dynamo.list_backends(exclude_tags=()))
    for _ in range(6):
        if obj is None:
            return None
        for name in (getattr(obj, "compiler_name", None), getattr(obj, "__name__", None)):
            if isinstance(name, str) and name in registered:
                return name
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return None
