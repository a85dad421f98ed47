"""Static compilation of a LightningModule: the whole training step, or its blocks one by one, with a per-region
eager fallback and a report.

What gets compiled (``strategy.compile.regional``). By default (``auto``) the LightningModule's whole
``training_step`` — forward and loss — is one region, traced as one graph. A graph compiled whole is one autograd
node, so every gradient would become ready at the very end of backward and no collective could overlap it; at
world size > 1 the strategy therefore hands :func:`compile_regions` a ``split``: the graph is cut where the gradient
buckets end (:mod:`~lightning_static_dist.compile.split`), each piece its own autograd node. ``regional: true``
compiles each repeated block separately instead — one autograd node per block, gradients ready block by block —
with identical blocks sharing one compiled artefact (dynamo caches on the code object of ``Block.forward`` and
guards on the module's type, not its identity, so N blocks cost one compilation); ``regional: false`` compiles
the whole step uncut.

What is recorded (:class:`CompileReport`): every graph the backend compiled (node count, structural hash), graph
breaks with reason and user location, recompiles with the guard that failed, device transfers found inside graphs
(placement belongs to the strategy, not the graph), seconds spent compiling, and regions that fell back to eager.
Graph breaks and recompiles are read from dynamo's own artifact loggers (``graph_breaks``, ``recompiles``), which
this module enables quietly — they print nothing unless the user asked for them with ``TORCH_LOGS``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch._dynamo
from torch import nn

from lightning_static_dist.config import CompileConfig, ConfigError
from lightning_static_dist.compile.split import BucketGraphSplitter

log = logging.getLogger(__name__)


class CompileFailure(RuntimeError):
    """A region failed to compile and ``strategy.compile.fallback`` is ``error`` (or a ``fullgraph`` break)."""


@dataclass
class GraphRecord:
    """One graph handed to the backend."""

    nodes: int
    structure: str
    """Hash of the graph's op sequence: equal on every rank that traced the same program."""
    compile_s: float
    region: str = ""
    """The region whose call compiled it."""
    params: int = 0
    """Trainable parameters among its inputs (graphs without any hold no model code: a ``self.log`` tail ...)."""


@dataclass
class CompileReport:
    """What compilation did so far, on this rank.

    Example::

        report = strategy.compile_report
        print(report.summary())    # regions, graphs, breaks, recompiles, seconds
    """

    regions: list[str] = field(default_factory=list)
    graphs: list[GraphRecord] = field(default_factory=list)
    graph_breaks: list[tuple[str, str]] = field(default_factory=list)
    """(reason, user location) per graph break."""
    recompiles: list[str] = field(default_factory=list)
    """The guard failure that caused each recompile."""
    fallbacks: dict[str, str] = field(default_factory=dict)
    """Region -> the reason it runs eagerly."""
    placement: list[str] = field(default_factory=list)
    """Device transfers found inside captured graphs, with their source location."""
    backend: Any = None
    """The recording backend the regions were compiled with (shared, so dynamo's cache is too)."""
    around_blocks: Optional[str] = None
    """The region compiled around the blocks (``compile.around_blocks``), if any: its graph breaks at the blocks'
    calls are boundaries by design, counted in ``block_boundaries``, not in ``graph_breaks``."""
    block_boundaries: int = 0
    """How many of dynamo's graph-break records were a compiled block called from the graph around the blocks."""
    active_region: str = ""
    """The region being run now (set by its forward): graphs compiled meanwhile are recorded as its own."""
    splitter: Optional[BucketGraphSplitter] = None
    """With a whole-step region cut at the gradient buckets: the backend that cut it (its pieces, what stayed uncut)."""
    notes: list[str] = field(default_factory=list)
    """Settings the graphs were compiled with that a reader should know (graph mode's communication passes)."""
    outside_blocks: list[str] = field(default_factory=list)
    """With blocks compiled one by one: the modules holding parameters outside every block (they run eagerly, with
    the rest of ``training_step``, unless ``around_blocks`` compiles around the blocks)."""

    @property
    def compile_s(self) -> float:
        return sum(g.compile_s for g in self.graphs)

    def structure_lines(self) -> list[str]:
        """What this rank compiled, as comparable lines: the structures of the graphs that hold model parameters
        (sorted), then the regions. Graphs without parameters and the graphs around the blocks are left out:
        ``training_step`` code that differs by rank (``if self.global_rank == 0``, ``self.print``) splits them
        differently on each rank without anything being wrong."""
        shared = [g.structure for g in self.graphs if g.region != self.around_blocks and g.params]
        return sorted(shared) + self.regions

    def summary(self) -> str:
        lines = [
            f"compiled regions: {len(self.regions)} ({', '.join(self.regions[:4])}{' ...' if len(self.regions) > 4 else ''})",
            f"graphs compiled: {len(self.graphs)} in {self.compile_s:.1f} s",
            f"graph breaks: {len(self.graph_breaks)}"
            + (f" (and {self.block_boundaries} at the compiled blocks, by design)" if self.block_boundaries else ""),
            *[f"  - {reason} at {where}" for reason, where in self.graph_breaks[:10]],
            f"recompiles: {len(self.recompiles)}",
            *[f"  - {guard}" for guard in self.recompiles[:10]],
        ]
        if self.splitter is not None:
            lines.insert(2, f"  cut into {self.splitter.pieces} pieces at the gradient buckets (one autograd node"
                            " each: their collectives overlap backward)")
            lines.extend(f"  - NOT cut, its gradients are ready only at its end: {why}" for why in self.splitter.uncut)
        lines.extend(self.notes)
        if self.outside_blocks and self.around_blocks is None:
            lines.append(f"runs eagerly, outside the compiled blocks: {', '.join(self.outside_blocks[:8])}"
                         f"{' ...' if len(self.outside_blocks) > 8 else ''} and the rest of training_step (the loss);"
                         " strategy.compile.regional=auto compiles the whole step (with all_reduce)")
        if self.around_blocks is not None and self.graphs and not any(g.region == self.around_blocks for g in self.graphs):
            lines.append(f"{self.around_blocks}: nothing was compiled around the blocks (dynamo left the code that"
                         " calls them eager, e.g. blocks looped in a nested forward); regional=auto compiles the"
                         " whole step")
        if self.fallbacks:
            lines.append("eager fallbacks: " + "; ".join(f"{r}: {why}" for r, why in self.fallbacks.items()))
        if self.placement:
            lines.append("device transfers inside graphs (placement belongs to the strategy):")
            lines.extend(f"  - {p}" for p in self.placement[:10])
        return "\n".join(lines)


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


# -------------------------------------------------------------------------------------------- the backend


def _resolve_backend(config: CompileConfig, inductor_patches: Optional[dict[str, Any]] = None) -> Callable[..., Any]:
    """The compiler function for ``config.backend``/``config.mode``, as ``torch.compile`` would pick it (with
    ``inductor_patches`` on top when the backend is inductor)."""
    if config.backend in ("inductor", "inductor_distributed"):
        from torch._inductor.compile_fx import compile_fx

        options = torch._inductor.list_mode_options(config.mode, config.dynamic) if config.mode != "default" else {}
        if config.backend == "inductor_distributed" or inductor_patches:
            options = {**options, **(inductor_patches or graph_mode_patches())}
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=options)
    return torch._dynamo.lookup_backend(config.backend)  # CompileConfig checked that it is registered


def _structure(gm: torch.fx.GraphModule) -> str:
    ops = [f"{n.op}:{getattr(n.target, '__name__', n.target)}" for n in gm.graph.nodes]
    return hashlib.sha1("\n".join(ops).encode()).hexdigest()[:12]


_TRANSFER_METHODS = {"to", "cuda", "cpu"}


def _device_transfers(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes that move a tensor to an explicit device inside the graph, with their user source line."""
    found = []
    for node in gm.graph.nodes:
        explicit = any(isinstance(a, (torch.device, str)) and _looks_like_device(a) for a in node.args[1:])
        explicit = explicit or "device" in node.kwargs
        is_move = (node.op == "call_method" and node.target in _TRANSFER_METHODS and (node.target != "to" or explicit))
        if is_move:
            found.append(f"{node.format_node()[:120]} at {_user_location(node)}")
    return found


def _user_location(node: torch.fx.Node) -> str:
    """``file:line: code`` of the user code that produced ``node`` (from dynamo's stack trace meta)."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(trace) - 1, -1, -1):
        match = re.match(r'\s*File "(.+)", line (\d+)', trace[i])
        if match:
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            return f"{match.group(1)}:{match.group(2)}: {code}"
    return "<unknown location>"


def _looks_like_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    return isinstance(value, str) and re.fullmatch(r"(cpu|cuda|mps|xpu|meta)(:\d+)?", value) is not None


class RecordingBackend:
    """Wraps the configured compiler: records each graph (structure, compile seconds, device transfers).

    One instance serves every region: dynamo guards on the backend object, so a backend per region would make
    identical blocks recompile instead of sharing one artefact.
    """

    def __init__(self, config: CompileConfig, report: CompileReport,
                 inductor_patches: Optional[dict[str, Any]] = None) -> None:
        self._compiler = _resolve_backend(config, inductor_patches)
        self._report = report
        self._compiles: dict[int, Optional[int]] = {}
        """dynamo frame id -> the compile number this backend last compiled it under."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        started = time.perf_counter()
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = compile_id.frame_id if compile_id is not None else None
        if frame is not None and self._compiles.get(frame, compile_id.frame_compile_id) != compile_id.frame_compile_id:
            # a frame this backend compiled before, compiled again: a guard failed. Dynamo logs which one only when
            # TORCH_LOGS asks for "recompiles" (the capture keeps it then); it is counted here either way. Dynamo's
            # own numbering counts other backends' compiles of the same code too (another model, an earlier fit)
            self._report.recompiles.append(f"{_compiling_code()} compiled again in region"
                                           f" {self._report.active_region!r}: {_CAPTURE.take_guard() or 'guard not logged'}")
        if frame is not None:
            self._compiles[frame] = compile_id.frame_compile_id
        compiled = self._compiler(gm, example_inputs)
        params = sum(isinstance(x, nn.Parameter) and x.requires_grad for x in example_inputs)
        self._report.graphs.append(GraphRecord(len(gm.graph.nodes), _structure(gm), time.perf_counter() - started,
                                               self._report.active_region, params))
        for transfer in _device_transfers(gm):
            if transfer not in self._report.placement:
                self._report.placement.append(transfer)
                log.warning(f"static_dist: device transfer inside a compiled graph: {transfer}")
        return compiled


def _compiling_code() -> str:
    """``function (file:line)`` of the frame dynamo is compiling now."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
        return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
    except Exception:  # a dynamo without this internal: the frame stays unnamed
        return "a frame"


# -------------------------------------------------------------------------------------------- dynamo's logs


class _DynamoLogCapture(logging.Handler):
    """Collects dynamo's ``graph_breaks`` and ``recompiles`` artifact records into a report."""

    _AT = re.compile(r" at (\S+:\d+)")

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.report: Optional[CompileReport] = None
        self._guard: Optional[str] = None

    def take_guard(self) -> Optional[str]:
        """The guard failure of the recompile being compiled now, if dynamo logged it."""
        guard, self._guard = self._guard, None
        return guard

    def emit(self, record: logging.LogRecord) -> None:
        if self.report is None:
            return
        message = record.getMessage()
        if record.name.endswith("__recompiles"):  # counted by the backend when the new graph compiles
            guards = [line.strip(" -") for line in message.splitlines() if line.strip().startswith("- ")]
            self._guard = "; ".join(guards) or message.splitlines()[0]
            return
        if "Graph Break Reason:" not in message and "Graph break" not in message:
            return
        lines = message.splitlines()
        reason = next((l.split(":", 1)[1].strip() for l in lines if "Graph Break Reason:" in l), "") or lines[0][:120]
        explanation = next((l.split(":", 1)[1].strip() for l in lines if l.strip().startswith("Explanation:")), "")
        if explanation:
            reason = re.sub(r" at 0x[0-9a-f]+", "", f"{reason} {explanation}")  # no addresses: equal on every rank
        # a compiled block called from the graph around the blocks: torch 2.13 names it in the reason, 2.11 only in the
        # developer context ("Dynamo can only handle functions defined in python ... <..._BoundaryRegionForward ...>")
        if "_BoundaryRegionForward" in message and not re.search(r"falling back to eager|[Ss]kipping the frame|frame skipped",
                                                          message):
            self.report.block_boundaries += 1
            return
        if "stack suppressed" in lines[0] and any(r == reason for r, _ in self.report.graph_breaks):
            return  # dynamo repeating a break it already reported, without the user's stack this time
        entry = (reason, self._user_frame(message) or self._at(lines[0]))
        if entry not in self.report.graph_breaks:
            self.report.graph_breaks.append(entry)

    @classmethod
    def _at(cls, line: str) -> str:
        where = cls._AT.search(line)
        return where.group(1) if where else "<unknown location>"

    @staticmethod
    def _user_frame(message: str) -> Optional[str]:
        """The innermost frame of the user's own code in dynamo's "User code traceback" (not torch, Lightning
        or this package): where ``self.log(...)`` was called, not where Lightning's ``log`` breaks."""
        frames = re.findall(r'File "([^"]+)", line (\d+)', message.split("User code traceback:", 1)[-1])
        own = [f"{path}:{line}" for path, line in frames
               if "site-packages" not in path and "dist-packages" not in path and "lightning_static_dist" not in path]
        return own[-1] if own else None


_CAPTURE = _DynamoLogCapture()


def _capture_dynamo_logs(report: CompileReport) -> None:
    import torch._dynamo  # noqa: F401  (imports the modules that own the artifact loggers)
    from torch._logging._internal import log_registry

    _CAPTURE.report = report
    for qname in list(log_registry.artifact_log_qnames):
        if qname.endswith(("__graph_breaks", "__recompiles")):
            logger = logging.getLogger(qname)
            if _CAPTURE not in logger.handlers:
                logger.addHandler(_CAPTURE)
            if logger.level == logging.NOTSET:
                # TORCH_LOGS did not ask for it: enable it for us only — torch's own handler on "torch" would
                # print every record that propagates, whatever the parent's level
                logger.propagate = False
                logger.setLevel(logging.DEBUG)


# -------------------------------------------------------------------------------------------- compiling


class _RegionForward:
    """A region's forward: compiled, or eager after a compile failure (``fallback: eager``).

    It holds the *unbound* ``forward`` of the region's class and is bound to the region with ``types.MethodType``:
    a ``copy.deepcopy`` of the model (SWA, EMA callbacks) then rebinds it to the copy instead of running the
    original's weights, and identical blocks share one compiled artefact.
    """

    def __init__(self, region: str, eager: Callable[..., Any], compiled: Callable[..., Any], config: CompileConfig,
                 report: CompileReport) -> None:
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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.region in self.report.fallbacks:
            return self.eager(*args, **kwargs)
        outer, self.report.active_region = self.report.active_region, self.region
        try:
            return self._run(*args, **kwargs)
        finally:
            self.report.active_region = outer

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            reason = failure_reason(err)
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
            return self.eager(*args, **kwargs)


class _BoundaryRegionForward(_RegionForward):
    """A block's forward when ``training_step`` is compiled around the blocks: a boundary for that enclosing
    compiled frame — dynamo does not trace into it, it calls it, and the block's own compiled function still runs,
    under its own dynamo context. (Only then: a model compiled again by its user after ``fit`` would otherwise
    break at every block.)"""

    @torch._dynamo.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


def failure_reason(err: BaseException) -> str:
    """One line saying why compilation failed: the backend's own exception when dynamo wrapped one."""
    inner = getattr(err, "inner_exception", None) or err.__cause__ or err
    lines = [line.strip() for line in str(inner).strip().splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def compile_regions(module: nn.Module, config: CompileConfig, report: Optional[CompileReport] = None,
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
    log.debug(f"compiled {len(report.regions)} regions of {type(module).__name__} with {config.backend}")
    return report


def _compile_method(region: nn.Module, method: str, name: str, backend: Callable[..., Any], config: CompileConfig,
                    report: CompileReport, wrapper: type) -> None:
    eager = getattr(type(region), method)
    compiled = torch.compile(eager, backend=backend, fullgraph=config.fullgraph, dynamic=config.dynamic)
    # an instance attribute shadows the class's method: nn.Module.__call__ (and its hooks) stay as they are
    setattr(region, method, types.MethodType(wrapper(name, eager, compiled, config, report), region))
    report.regions.append(name)


def compile_optimizer_step(optimizer: torch.optim.Optimizer, config: CompileConfig, report: CompileReport) -> None:
    """Compile ``optimizer.step()``; a closure, when Lightning passes one, runs eagerly before the compiled step.

    Lightning's precision plugins call ``optimizer.step(closure=...)`` with forward and backward inside the closure;
    tracing that would pull the whole training step into the optimizer's graph, so the closure is called first.
    """
    inner = optimizer._optimizer if hasattr(optimizer, "_optimizer") else optimizer  # LightningOptimizer
    eager_step = inner.step
    backend = report.backend or RecordingBackend(config, report)
    compiled_step = _RegionForward("optimizer.step", eager_step, torch.compile(eager_step, backend=backend), config, report)

    def step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        compiled_step(**kwargs)
        return loss

    inner.step = step
    report.regions.append("optimizer.step")


def drop_short_last_batch(loader: Any) -> None:
    """With static shapes, a short last training batch would compile a second graph: drop it, and say so once."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
    from torch.utils.data import BatchSampler, DataLoader

    if not isinstance(loader, DataLoader) or not isinstance(loader.batch_sampler, BatchSampler):
        return
    batches = loader.batch_sampler
    remainder = len(batches.sampler) % batches.batch_size
    if not batches.drop_last and remainder:
        batches.drop_last = True  # BatchSampler reads it on every epoch
        rank_zero_warn(
            f"static_dist: the last training batch of each epoch would hold {remainder} samples instead of"
            f" {batches.batch_size} and compile a second graph; it is dropped (strategy.compile.dynamic=false)."
            " Set strategy.compile.dynamic=true to keep it."
        )


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_regions` already compiled some region of ``module``."""
    return any(
        isinstance(bound, types.MethodType) and isinstance(bound.__func__, _RegionForward)
        for sub in module.modules()
        for bound in (sub.__dict__.get("forward"), sub.__dict__.get("training_step"))
    )


# ------------------------------------------------------------------------------- the inductor_distributed backend

def graph_mode_patches(first_bucket_mb: float = 1.0, bucket_mb: float = 100.0) -> dict[str, Any]:
    """Inductor settings that make it communication-aware, each only where this torch version has it: bucket the
    traced all-reduces (the first bucket ``first_bucket_mb``, later ones ``bucket_mb``: inductor's default is one
    2 GB bucket, issued after the whole backward) and reorder collectives against compute (waits sunk, collectives
    raised; the pass names changed between torch versions)."""
    import torch._inductor.comms as comms

    config = torch._inductor.config
    patches: dict[str, Any] = {}
    if hasattr(config, "bucket_all_reduces_fx"):
        patches["bucket_all_reduces_fx"] = "all"
        patches["bucket_all_reduces_fx_bucket_size_determinator"] = _BucketSizes(first_bucket_mb, bucket_mb)
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


def register_inductor_distributed() -> None:
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


def allow_compiled_models_in_trainer() -> None:
    """Let ``trainer.fit(torch.compile(model))`` through Lightning's compile check for this strategy.

    Lightning 2.6's ``_verify_strategy_supports_compile`` accepts only SingleDevice/DDP/FSDP strategies with a
    hard-coded ``isinstance`` (DESIGN.md); the strategy then takes the compiled model apart and compiles it its own
    way (regionally, with the user's backend). Other strategies keep Lightning's check unchanged.
    """
    import lightning.pytorch.trainer.trainer as trainer_module

    original = trainer_module._verify_strategy_supports_compile
    if getattr(original, "_static_dist", False):
        return

    def verify(model: Any, strategy: Any) -> None:
        from lightning.pytorch.utilities.compile import to_uncompiled

        from lightning_static_dist.strategy import StaticDistStrategy

        if not isinstance(strategy, StaticDistStrategy):
            original(model, strategy)
            return
        if model._compiler_ctx is not None:
            # take Lightning's whole-step compile apart here, before a spawn launcher pickles the model (its
            # dynamo-wrapped methods do not pickle); the strategy compiles it regionally with the same backend
            strategy.requested_backend = backend_of(model._compiler_ctx["dynamo_ctx"]) or strategy.config.compile.backend
            to_uncompiled(model)

    verify._static_dist = True  # type: ignore[attr-defined]
    trainer_module._verify_strategy_supports_compile = verify
