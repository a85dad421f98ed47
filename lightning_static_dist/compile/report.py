"""What static compilation did, on this rank, and every reading of dynamo's internal logs.

:class:`CompileReport` records every graph compiled (node count, structural hash), graph breaks with reason and user
location, recompiles with the guard that failed, device transfers found inside graphs, seconds spent compiling, and
regions that fell back to eager. Breaks and recompiles are read from dynamo's own artifact loggers, enabled quietly
(they print nothing unless ``TORCH_LOGS`` asks). Every touchpoint with dynamo's internals for reporting is in this
file; the recording backend (``backends.py``) calls them.
"""

from __future__ import annotations

import logging
import os
import re
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_static_dist.wording import counted

if TYPE_CHECKING:  # for the annotation only: the report holds the splitter the regions were cut with
    from lightning_static_dist.compile.split import BucketGraphSplitter


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
    shapes: str = ""
    """The shapes of its inputs other than parameters, a dynamic size written ``?`` (``shapes.input_shapes``)."""
    dynamic: bool = False
    """Compiled with a dynamic size (a dimension took a second size, or ``compile.dynamic: true``)."""
    tail: bool = False
    """Compiled for the loader's short last batch (``shapes.mark_tail``): expected, not a recompile."""
    compile_id: str = ""
    """Dynamo's compile of the frame (``0/1``): the pieces of one graph cut at the buckets share it."""


@dataclass
class CompileReport:
    """What compilation did so far, on this rank.

    Example::

        report = strategy.offer.compile_report
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
    """Device transfers found inside captured graphs in the user's own code, with their source location."""
    library_transfers: list[str] = field(default_factory=list)
    """Where device transfers inside captured graphs come from library code (``torchmetrics/metric.py:767``, called
    from the user's line): not the user's to move, so reported in one line, not one line each."""
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
    cudagraphs: Optional[str] = None
    """Whether the graphs are replayed as CUDA graphs, and why (``CudagraphChoice.describe()``; ``None``: not decided
    by the strategy)."""
    cudagraph_skips: list[str] = field(default_factory=list)
    """Inductor's reason for each graph it left without CUDA graphs (its kernels launched one by one)."""
    notes: list[str] = field(default_factory=list)
    """Settings the graphs were compiled with that a reader should know (graph mode's communication passes)."""
    logged_calls: int = 0
    """How many ``self.log`` / ``self.log_dict`` calls the last compiled ``training_step`` recorded in its graph and
    made after it returned (:mod:`~lightning_static_dist.compile.log_calls`)."""
    tail_rows: Optional[int] = None
    """The rows of the training loader's short last batch, if it has one (it gets a graph of its own)."""
    in_tail: bool = False
    """Whether the call running now is that short batch's."""
    limit_hit: Optional[str] = None
    """Where and on which guard dynamo's recompile limit was reached (calls matching no graph then run eagerly)."""
    graph_runs: int = 0
    """How many compiled graphs ran so far (a call that ran none ran eagerly)."""
    calls: dict[str, int] = field(default_factory=dict)
    """Region -> how many times it was called."""
    eager_calls: dict[str, list[int]] = field(default_factory=dict)
    """Region -> its calls (numbered from 1) that ran eagerly after the recompile limit was reached."""
    outside_blocks: list[str] = field(default_factory=list)
    """With blocks compiled one by one: the modules holding parameters outside every block (they run eagerly, with
    the rest of ``training_step``, unless ``around_blocks`` compiles around the blocks)."""

    @property
    def compile_s(self) -> float:
        return sum(g.compile_s for g in self.graphs)

    def structure_lines(self) -> list[str]:
        """What this rank compiled, as comparable lines: the structures of the graphs that hold model parameters
        (sorted), then the regions. Graphs without parameters and the graphs around the blocks are left out (why:
        docs/internals.md, "compile/report.py")."""
        shared = {g.structure for g in self.graphs if g.region != self.around_blocks and g.params}
        # a set: a rank whose batches took a second shape compiled the same program once more (its structure has
        # no shapes), and that is no difference between the ranks
        return sorted(shared) + self.regions

    def shape_lines(self) -> list[str]:
        """The input shapes each graph holding model parameters was compiled for, in order (differ between ranks
        whose batches differ in shape: a note, not an error)."""
        return [g.shapes for g in self.graphs if g.region != self.around_blocks and g.params]

    def graph_count(self, **where: bool) -> int:
        """Graphs dynamo compiled (the pieces of a graph cut at the buckets count once) whose record has the given
        flags (``tail=True``, ``dynamic=True``)."""
        return len({g.compile_id or id(g) for g in self.graphs if all(getattr(g, k) == v for k, v in where.items())})

    def summary(self) -> str:
        tails, dynamic = self.graph_count(tail=True), self.graph_count(dynamic=True)
        kinds = ", ".join(k for k in (f"{tails} for the short last batch" if tails else "",
                                      f"{dynamic} with dynamic shapes" if dynamic else "") if k)
        lines = [
            f"compiled regions: {len(self.regions)} ({', '.join(self.regions[:4])}{' ...' if len(self.regions) > 4 else ''})",
            f"graphs compiled: {self.graph_count()}{f' ({kinds})' if kinds else ''}; compiling took {self.compile_s:.1f} s",
            f"graph breaks: {len(self.graph_breaks)}"
            + (f" (and {self.block_boundaries} at the compiled blocks, by design)" if self.block_boundaries else ""),
            *[f"  - {reason} at {where}" for reason, where in self.graph_breaks[:10]],
            f"recompiles: {len(self.recompiles)}",
            *[f"  - {guard}" for guard in self.recompiles[:10]],
        ]
        if tails:
            lines.append(f"the short last batch ({counted(self.tail_rows or 0, 'row')}) runs its own graph (compiled"
                         " once, static in the batch dimension; not a recompile)")
        if self.limit_hit is not None:
            eager = "; ".join(f"{region} calls {_numbers(calls)}" for region, calls in self.eager_calls.items())
            lines.append(f"RECOMPILE LIMIT: {self.limit_hit}; ran eagerly: {eager or 'no call yet'}"
                         " (strategy.compile.dynamic=true compiles one graph for every shape)")
        if self.splitter is not None:
            lines.insert(2, self.splitter.describe())
            lines.extend(f"  - NOT cut, its gradients are ready only at its end: {why}" for why in self.splitter.uncut)
        if self.cudagraphs is not None:
            lines.append(self.cudagraphs)
        lines.extend(f"  - NOT replayed as a CUDA graph: {why}" for why in self.cudagraph_skips[:10])
        if self.logged_calls:
            lines.append(f"self.log: {counted(self.logged_calls, 'call')} per step recorded in the graph and made after"
                         " it, through Lightning's log (eagerly: sync_dist reduces then)")
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
        if self.library_transfers:
            lines.append(library_transfers_line(self.library_transfers))
        return "\n".join(lines)


def _numbers(calls: list[int]) -> str:
    """``3, 4, 5 ... (12 calls)``: the first few call numbers and how many."""
    return ", ".join(map(str, calls[:6])) + (f" ... ({len(calls)} calls)" if len(calls) > 6 else "")


# -------------------------------------------------------------------------------------------- reading a graph


_TRANSFER_METHODS = {"to", "cuda", "cpu"}


def _device_transfers(gm: torch.fx.GraphModule) -> list[tuple[str, bool]]:
    """Nodes that move a tensor to an explicit device inside the graph: ``(what, in_library)``. ``what`` is the node
    at the line that produced it, or, when that line is a library's (:func:`is_library_path`), the library's line
    and the user's line that called into it (``torchmetrics/metric.py:767 (from train.py:14)``)."""
    found = []
    for node in gm.graph.nodes:
        explicit = any(isinstance(a, (torch.device, str)) and _looks_like_device(a) for a in node.args[1:])
        explicit = explicit or "device" in node.kwargs
        is_move = (node.op == "call_method" and node.target in _TRANSFER_METHODS and (node.target != "to" or explicit))
        if not is_move:
            continue
        frames = _frames(node)
        if frames and is_library_path(frames[-1][0]):
            if _stays_on_its_device(node):
                continue  # (torchmetrics' ``.to(self.device)`` of a state already there: no copy, nothing to say)
            user = next((f"{path}:{line}" for path, line, _ in reversed(frames) if not is_library_path(path)), None)
            where = f"{_in_library(frames[-1][0])}:{frames[-1][1]}"
            found.append((where + (f" (from {user})" if user else ""), True))
        else:
            at = f"{frames[-1][0]}:{frames[-1][1]}: {frames[-1][2]}" if frames else "<unknown location>"
            found.append((f"{node.format_node()[:120]} at {at}", False))
    return found


def _stays_on_its_device(node: torch.fx.Node) -> bool:
    """Whether a move's input and result are on one device (dynamo's example values), so that it copies nothing. Only
    a library's moves are excused by it: a device the user's own code names is fixed in the graph wherever it runs."""
    source = node.args[0].meta.get("example_value") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    result = node.meta.get("example_value")
    return isinstance(source, torch.Tensor) and isinstance(result, torch.Tensor) and source.device == result.device


def _frames(node: torch.fx.Node) -> list[tuple[str, str, str]]:
    """``(file, line, code)`` of each frame in the stack that produced ``node`` (dynamo's stack trace meta),
    outermost first."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = []
    for i, text in enumerate(trace):
        match = re.match(r'\s*File "(.+)", line (\d+)', text)
        if match:
            frames.append((match.group(1), match.group(2), trace[i + 1].strip() if i + 1 < len(trace) else ""))
    return frames


_THIS_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_EXAMPLES = _THIS_PACKAGE + "examples" + os.sep
_REGIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "regions.py")


def is_library_path(path: str) -> bool:
    """Whether ``path`` is a library's file (an installed package, or this one), not the user's own code. The
    package's example models (``examples/``) are a user's model, wherever the package is installed."""
    path = os.path.abspath(path)
    if path.startswith(_EXAMPLES):
        return False
    return "site-packages" in path or "dist-packages" in path or path.startswith(_THIS_PACKAGE)


def _in_library(path: str) -> str:
    """A library file's path from its package on (``torchmetrics/metric.py``)."""
    return re.split(r"(?:site|dist)-packages/", path)[-1]


def library_transfers_line(where: list[str]) -> str:
    """The one line that reports every device transfer a library's code makes inside the compiled graphs."""
    shown = ", ".join(where[:3]) + (" ..." if len(where) > 3 else "")
    return (f"device transfers inside graphs from library code: {counted(len(where), 'place')} ({shown}); not"
            " yours to move")


def _looks_like_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    return isinstance(value, str) and re.fullmatch(r"(cpu|cuda|mps|xpu|meta)(:\d+)?", value) is not None


def _compiling_code() -> Optional[types.CodeType]:
    """The code object of the frame dynamo is compiling now (``None`` where this dynamo does not say)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:  # a dynamo without this internal: the frame stays unnamed
        return None


def _code_name(code: Optional[types.CodeType]) -> str:
    """``function (file:line)`` of ``code``."""
    return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else "a frame"


def _guard_failures(code: Optional[types.CodeType]) -> list[str]:
    """Every guard failure dynamo has found for ``code`` so far in this process, oldest first: one line per cache
    entry it checked before a recompile (``0/0: L['batch_idx'] == 0``), read from
    ``torch._dynamo.utils.guard_failures`` (why there: docs/internals.md, "compile/report.py")."""
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:  # a dynamo without it: the recompile is still counted, without its guard
        return []
    # one line each: dynamo appends the guard's source line and a stack after runs of spaces and newlines
    return [re.sub(r"\s+", " ", str(reason).split("\nUser stack trace:")[0]).strip()
            for reason in guard_failures.get(code, [])]


# -------------------------------------------------------------------------------------------- dynamo's logs


class _DynamoLogCapture(logging.Handler):
    """Collects dynamo's ``graph_breaks`` artifact records into a report (recompiles: :func:`_guard_failures`)."""

    _AT = re.compile(r" at (\S+:\d+)")

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.report: Optional[CompileReport] = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.report is None:
            return
        message = record.getMessage()
        if "Graph Break Reason:" not in message and "Graph break" not in message:
            return
        lines = message.splitlines()
        reason = next((ln.split(":", 1)[1].strip() for ln in lines if "Graph Break Reason:" in ln), "") or lines[0][:120]
        explanation = next((ln.split(":", 1)[1].strip() for ln in lines if ln.strip().startswith("Explanation:")), "")
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
        or this package): where the user's line called the code that broke, not the line inside a library.

        The traceback holds the whole Python stack, the launcher's and the Trainer's frames included: only the frames
        inside a compiled region's call (after this package's ``regions.py``) are looked at. When all of those are a
        library's (a model installed as a package), the region's own frame (the compiled method's line) is named."""
        frames = re.findall(r'File "([^"]+)", line (\d+)', message.split("User code traceback:", 1)[-1])
        inside = [i for i, (path, _) in enumerate(frames) if os.path.abspath(path) == _REGIONS]
        traced = frames[inside[-1] + 1:] if inside else frames
        own = [f"{path}:{line}" for path, line in traced if not is_library_path(path)]
        if own:
            return own[-1]
        return f"{traced[0][0]}:{traced[0][1]}" if inside and traced else None


_CAPTURE = _DynamoLogCapture()


def _capture_dynamo_logs(report: CompileReport) -> None:
    import torch._dynamo  # noqa: F401  (imports the modules that own the artifact loggers)

    _CAPTURE.report = report
    listen_to_artifacts(_CAPTURE, ("__graph_breaks",), logging.DEBUG)


def listen_to_artifacts(handler: logging.Handler, suffixes: tuple[str, ...], level: int) -> None:
    """Attach ``handler`` to torch's artifact loggers whose names end with one of ``suffixes`` (their modules must be
    imported). One that ``TORCH_LOGS`` did not ask for is enabled for us alone, at ``level`` (why:
    docs/internals.md, "compile/report.py")."""
    from torch._logging._internal import log_registry

    for qname in list(log_registry.artifact_log_qnames):
        if qname.endswith(suffixes):
            logger = logging.getLogger(qname)
            if handler not in logger.handlers:
                logger.addHandler(handler)
            if logger.level == logging.NOTSET:
                logger.propagate = False
                logger.setLevel(level)


def failure_reason(err: BaseException) -> str:
    """One line saying why compilation failed: the backend's own exception when dynamo wrapped one."""
    inner = getattr(err, "inner_exception", None) or err.__cause__ or err
    lines = [line.strip() for line in str(inner).strip().splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
