"""Static compilation of a LightningModule: the whole training step, or its blocks one by one, with a per-region
eager fallback and a report.

``strategy.compile.regional``: ``auto`` compiles the whole ``training_step`` as one region, handed a ``split`` at
world size > 1 so that the graph is cut where the gradient buckets end (``split.py``); ``true`` compiles each
repeated block on its own (identical blocks share one artefact); ``false`` the whole step uncut. A region's forward
is replaced by a wrapper (:class:`_RegionForward`) that falls back to eager when it fails to compile
(``strategy.compile.fallback``). :func:`compile_optimizer_step` compiles the optimizer's step. Shapes that vary (a
short last batch, padded text) are ``shapes.py``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch._dynamo
from torch import nn

from lightning_static_dist.compat import unwrap_optimizer
from lightning_static_dist.compile.backends import RecordingBackend
from lightning_static_dist.compile.log_calls import LogCalls
from lightning_static_dist.compile.report import CompileFailure, CompileReport, _capture_dynamo_logs, failure_reason
from lightning_static_dist.compile.shapes import mark_tail, notice_recompile_limit
from lightning_static_dist.compile.split import BucketGraphSplitter
from lightning_static_dist.compile.config import CompileOptions
from lightning_static_dist.config import ConfigError
from lightning_static_dist.wording import counted

log = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------- region finding


def find_regions(module: nn.Module, regional: Any) -> list[tuple[str, nn.Module]]:
    """The modules to compile: the whole module, or each block of its largest container of repeated blocks.

    ``regional`` ``auto`` or ``false``: the whole module — its ``training_step`` when it has one (forward *and* loss
    in one graph), else its ``forward``; see :func:`whole_method`. ``true``: the blocks of the container with the
    most parameters, a container being an ``nn.ModuleList`` or ``nn.Sequential`` with at least two children of one
    class (an error when there is none).

    Example::

        >>> [name for name, _ in find_regions(gpt, True)]
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
        >>> [name for name, _ in find_regions(gpt, "auto")]
        ['<training_step>']
    """
    whole = [(f"<{whole_method(module)}>", module)]
    if regional is not True:
        return whole
    best: tuple[int, str, list[tuple[str, nn.Module]]] = (0, "", [])
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2:
            continue
        kinds = {type(block) for block in child}
        if len(kinds) != 1:
            continue
        size = sum(p.numel() for p in child.parameters())
        if size > best[0]:
            best = (size, name, [(f"{name}.{i}", block) for i, block in enumerate(child)])
    if best[2]:
        return best[2]
    raise ConfigError(
        f"strategy.compile.regional=True: {type(module).__name__} has no nn.ModuleList/nn.Sequential of repeated"
        " blocks to compile one by one; allowed: 'auto' or false (the whole training step)"
    )


def whole_method(module: nn.Module) -> str:
    """The method a whole-model region compiles: ``training_step`` of a LightningModule, else ``forward``."""
    return "training_step" if callable(getattr(type(module), "training_step", None)) else "forward"


# -------------------------------------------------------------------------------------------- compiling


class _RegionForward:
    """A region's forward: compiled, or eager after a compile failure (``fallback: eager``).

    It holds the *unbound* ``forward`` of the region's class and is bound to the region with ``types.MethodType``
    (why: docs/internals.md, "compile/regions.py").
    """

    def __init__(self, region: str, eager: Callable[..., Any], compiled: Callable[..., Any], config: CompileOptions,
                 report: CompileReport, log_calls: Optional[LogCalls] = None) -> None:
        self.region = region
        self.eager = eager
        # Lightning's is_overridden("training_step", module) compares code objects: look like the method we replace
        self.__code__ = getattr(eager, "__code__", None)
        self.__name__ = getattr(eager, "__name__", region)
        # and inspect.signature (Lightning passes batch_idx / detects dataloader_iter by it) follows __wrapped__
        self.__wrapped__ = eager
        self.compiled = compiled
        self.config = config
        self.report = report
        self.log_calls = log_calls
        """For a LightningModule's ``training_step``: its ``self.log`` calls, recorded in the graph, made after it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        report = self.report
        if self.region in report.fallbacks:
            return self.eager(*args, **kwargs)
        outer, report.active_region = report.active_region, self.region
        call = report.calls[self.region] = report.calls.get(self.region, 0) + 1
        runs, outer_tail = report.graph_runs, report.in_tail
        # the short last batch: one graph of its own, static in the batch dimension (dynamic: true needs none)
        report.in_tail = outer_tail or (self.config.dynamic is not True and mark_tail((args, kwargs), report.tail_rows))
        try:
            if self.log_calls is None:
                return self._run(*args, **kwargs)
            with self.log_calls.recording():
                out = self._run(*args, **kwargs)
            report.logged_calls = self.log_calls.replayed
            return out
        finally:
            report.active_region, report.in_tail = outer, outer_tail
            if report.limit_hit is not None and report.graph_runs == runs:  # dynamo ran the whole call eagerly
                report.eager_calls.setdefault(self.region, []).append(call)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            reason = failure_reason(err)
            kept = kept_graph_output(err)
            if kept is not None:  # not a compile failure: the step is fine, the user's code kept a stale tensor
                raise kept from err
            if self.config.fullgraph and isinstance(err, torch._dynamo.exc.Unsupported):
                stack = getattr(err, "real_stack", None)
                where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "<unknown location>"
                raise CompileFailure(
                    f"strategy.compile.fullgraph=true: graph break in region {self.region!r} at {where}: {reason}"
                ) from None
            if self.config.fallback == "error":
                raise CompileFailure(f"region {self.region!r} failed to compile: {reason}") from err
            # a failure while compiling the first graph of the region repeats nothing when the region now runs eagerly;
            # after a graph break, subgraphs that already ran (BatchNorm statistics, RNG draws) run once more
            self.report.fallbacks[self.region] = reason
            log.warning(f"static_dist: region {self.region!r} failed to compile and runs eagerly: {reason}")
            if self.log_calls is not None:
                self.log_calls.discard()  # the eager run logs again
            return self.eager(*args, **kwargs)


class _BoundaryRegionForward(_RegionForward):
    """A block's forward when ``training_step`` is compiled around the blocks: a boundary for that enclosing
    compiled frame — dynamo does not trace into it, it calls it, and the block's own compiled function still runs,
    under its own dynamo context. Only then (why: docs/internals.md, "compile/regions.py")."""

    @torch._dynamo.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


_OVERWRITTEN = "CUDAGraphs that has been overwritten by a subsequent run"
"""What inductor's CUDA graph trees say when a tensor one replay returned is read after the next replay reused its
memory (``torch/_inductor/cudagraph_trees.py``): the only mark it leaves, so it is matched on its words."""


def kept_graph_output(err: BaseException) -> Optional[RuntimeError]:
    """The one-line error for a failure that is a tensor kept from an earlier CUDA-graphed step (a loss appended to a
    list, an output held across steps), read after the graphs reused its memory; ``None`` for any other failure
    (why it is told apart from a compile failure: docs/internals.md, "compile/regions.py")."""
    seen: Optional[BaseException] = err
    for _ in range(8):  # (a chain of causes, walked a few links deep)
        if seen is None:
            break
        if _OVERWRITTEN in str(seen):
            return RuntimeError(
                "static_dist: a tensor kept from an earlier step was read after the step's CUDA graphs reused its"
                " memory (a step's outputs live until the next step: .clone() what you keep, e.g. a loss appended"
                " to a list); or set strategy.compile.cudagraphs=false")
        seen = seen.__cause__ or seen.__context__ or getattr(seen, "inner_exception", None)
    return None


def compile_regions(module: nn.Module, config: CompileOptions, report: Optional[CompileReport] = None,
                    split: Optional[tuple[int, int]] = None,
                    inductor_patches: Optional[dict[str, Any]] = None) -> CompileReport:
    """Compile ``module`` in place as ``config`` says; return the report that fills as graphs compile.

    ``split`` = ``(first_bucket_bytes, bucket_bytes)``: a whole-module region is cut into pieces of that many bytes
    of parameters (:class:`~lightning_static_dist.compile.split.BucketGraphSplitter`), so that gradients become ready
    piece by piece; ``report.splitter.ready_groups`` tells which piece readies which parameter.
    ``inductor_patches``: inductor settings on top of the mode's (``sync.mode: graph``: :func:`graph_mode_patches`).

    Example::

        report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager"), split=(1 << 20, 25 << 20))
        model.training_step(batch, 0)      # compiles on first call
        print(report.summary())
    """
    report = report if report is not None else CompileReport()
    _capture_dynamo_logs(report)
    notice_recompile_limit(report)
    recording = RecordingBackend(config, report, inductor_patches)
    backend: Any = recording
    if inductor_patches and config.backend in ("inductor", "inductor_distributed"):
        report.notes.append("inductor's communication passes: " + ", ".join(
            f"{k}={v}" for k, v in inductor_patches.items()))
    regions = find_regions(module, config.regional)
    if split is not None and regions[0][1] is module:
        report.splitter = backend = BucketGraphSplitter(recording, *split)
    # not with manual optimization: training_step then holds backward and the optimizer step, and an eager fallback
    # after a partial run would repeat them
    around = config.around_blocks and regions[0][1] is not module and getattr(module, "automatic_optimization", True)
    if regions[0][1] is not module:
        inside = {id(p) for _, block in regions for p in block.parameters()}
        report.outside_blocks = sorted({name.rsplit(".", 1)[0] for name, p in module.named_parameters()
                                        if id(p) not in inside} - {""}) or (["<the module itself>"] if any(
            id(p) not in inside for p in module.parameters()) else [])
    for name, region in regions:
        method = whole_method(region) if region is module and name.startswith("<") else "forward"
        _compile_method(region, method, name, backend, config, report,
                        _BoundaryRegionForward if around else _RegionForward)
    if around:
        # each block's call is a dynamo boundary (_BoundaryRegionForward): these graphs hold
        # what runs around the call that runs the blocks — in a language model, the loss over the vocabulary
        method = whole_method(module)
        report.around_blocks = f"<{method} around the blocks>"
        # never fullgraph: the boundaries are graph breaks by design (fullgraph applies to each block)
        _compile_method(module, method, report.around_blocks, backend, dataclasses.replace(config, fullgraph=False),
                        report, _RegionForward)
    report.backend = recording  # (the optimizer step, compiled later, is never cut)
    log.debug(f"compiled {counted(len(report.regions), 'region')} of {type(module).__name__} with {config.backend}")
    return report


def _compile_method(region: nn.Module, method: str, name: str, backend: Callable[..., Any], config: CompileOptions,
                    report: CompileReport, wrapper: type) -> None:
    eager = getattr(type(region), method)
    compiled = torch.compile(eager, backend=backend, fullgraph=config.fullgraph, dynamic=config.torch_dynamic)
    # a LightningModule's step: self.log / self.log_dict recorded in the graph, replayed when it returns (one graph)
    log_calls = LogCalls.install(region) if method == "training_step" and hasattr(type(region), "log") else None
    # an instance attribute shadows the class's method: nn.Module.__call__ (and its hooks) stay as they are
    setattr(region, method, types.MethodType(wrapper(name, eager, compiled, config, report, log_calls), region))
    report.regions.append(name)


def compile_optimizer_step(optimizer: torch.optim.Optimizer, config: CompileOptions, report: CompileReport) -> None:
    """Compile ``optimizer.step()``; a closure, when Lightning passes one, runs eagerly before the compiled step
    (why: docs/internals.md, "compile/regions.py")."""
    inner = unwrap_optimizer(optimizer)
    eager_step = inner.step
    backend = report.backend or RecordingBackend(config, report)
    compiled_step = _RegionForward("optimizer.step", eager_step, torch.compile(eager_step, backend=backend), config, report)

    def step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        compiled_step(**kwargs)
        return loss

    inner.step = step
    report.regions.append("optimizer.step")


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_regions` already compiled some region of ``module``."""
    return any(
        isinstance(bound, types.MethodType) and isinstance(bound.__func__, _RegionForward)
        for sub in module.modules()
        for bound in (sub.__dict__.get("forward"), sub.__dict__.get("training_step"))
    )
