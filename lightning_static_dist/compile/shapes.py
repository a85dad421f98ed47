"""Shapes that vary: the short last batch, dimensions that become dynamic, and dynamo's recompile limit.

Compiling never changes what is trained: a loader whose last batch is short keeps it (``drop_last`` stays the
user's). That batch gets one graph of its own, static in its batch dimension (:func:`mark_tail`), so the graphs of the
full batches keep theirs static too; any other dimension that takes a second size becomes dynamic, as dynamo's
automatic dynamic shapes make it (``strategy.compile.dynamic: auto``). Where dynamo still reaches its recompile
limit, its warning becomes one line on rank 0 naming the guard and the fix (:class:`RecompileLimitNotice`), and the
report lists the calls that ran eagerly.

Private API: dynamo's recompile-limit warning is read by its words on the ``torch._dynamo.convert_frame`` logger
(torch 2.13); retire :class:`RecompileLimitNotice` if torch reports the limit through a public hook.

Example::

    rows = tail_rows(loader)                 # 2 for 10 samples in batches of 4
    mark_tail((batch, batch_idx), rows)      # True for the short batch: its dimension 0 is compiled static
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch._dynamo
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from lightning_static_dist.compile.report import CompileReport

log = logging.getLogger(__name__)


def tail_rows(loader: Any) -> Optional[int]:
    """The rows of the short last batch of each epoch of ``loader`` (``None``: every batch is full, the loader drops
    the short one, or its batches are not counted by a ``BatchSampler``)."""
    from torch.utils.data import BatchSampler, DataLoader

    batches = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
    if not isinstance(batches, BatchSampler) or batches.drop_last:
        return None
    try:
        remainder = len(batches.sampler) % batches.batch_size  # type: ignore[arg-type]
    except TypeError:  # a sampler without a length: no known last batch
        return None
    return remainder or None


def mark_tail(args: Any, rows: Optional[int]) -> bool:
    """Whether ``args`` (a region's arguments) are the short last batch: every tensor with a dimension has ``rows``
    rows. If so, dimension 0 of each is marked static: dynamo compiles one graph for this batch (why: docs/internals.md,
    "compile/shapes.py")."""
    if rows is None:
        return False
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors or any(t.shape[0] != rows for t in tensors):
        return False
    for t in tensors:
        torch._dynamo.mark_static(t, 0)
    return True


def input_shapes(example_inputs: list[Any]) -> str:
    """The shapes of a graph's inputs other than parameters and buffers, a dynamic size written ``?``:
    ``(4, 16) (4, 16)``; equal on ranks that compiled for the same batch shapes."""
    shapes = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) and x.dim() > 0:
            shapes.append("(" + ", ".join(str(d) if isinstance(d, int) else "?" for d in x.shape) + ")")
    return " ".join(shapes[:4]) + (" ..." if len(shapes) > 4 else "")


def is_dynamic(example_inputs: list[Any]) -> bool:
    """Whether some input of a graph has a dynamic size (dynamo hands it a symbol, or a symbolic size)."""
    return any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
        not isinstance(d, int) for d in x.shape)) for x in example_inputs)


def structure(gm: torch.fx.GraphModule) -> str:
    """Hash of the graph's tensor operations, in order. What computes sizes is left out (a graph compiled with a
    dynamic size reads it from its input and does arithmetic on it where a static one holds a constant), so the
    same program compiled for other shapes, static or dynamic, has the same structure."""
    ops = [f"{n.op}:{getattr(n.target, '__name__', n.target)}" for n in gm.graph.nodes if _computes_tensors(n)]
    return hashlib.sha1("\n".join(ops).encode()).hexdigest()[:12]


def _computes_tensors(node: torch.fx.Node) -> bool:
    if node.op in ("placeholder", "get_attr"):  # (a dynamic graph takes its sizes as inputs too)
        return False
    if node.op == "output":
        return True
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool, torch.Size)):
        return False
    return getattr(node.target, "__module__", None) not in ("_operator", "operator")



class RecompileLimitNotice(logging.Filter):
    """Turns dynamo's warning that a region reached its recompile limit into one line on rank 0 and a line of the
    report; dynamo's own (six lines on every rank) is dropped. Other frames' warnings pass untouched."""

    _LIMIT = re.compile(r"hit config\.(\w*recompile_limit) \((\d+)\)")

    def __init__(self) -> None:
        super().__init__()
        self.report: Optional[CompileReport] = None

    def filter(self, record: logging.LogRecord) -> bool:
        report = self.report
        message = record.getMessage()
        limit = self._LIMIT.search(message)
        if report is None or not report.active_region or limit is None:
            return True
        reason = re.search(r"last reason: (.*)", message)
        guard = re.sub(r"^\d+/\d+: ", "", reason.group(1).strip()) if reason else "(dynamo named no guard)"
        report.limit_hit = f"{report.active_region}: dynamo's {limit.group(1)} ({limit.group(2)}) reached; guard: {guard}"
        if rank_zero_only.rank == 0:
            log.warning(f"static_dist: {report.active_region} reached dynamo's recompile limit ({limit.group(2)}"
                        f" graphs) on the guard {guard!r}; calls that match none of its graphs now run eagerly."
                        " Set strategy.compile.dynamic=true to compile one graph for every shape")
        return False


_NOTICE = RecompileLimitNotice()


def notice_recompile_limit(report: CompileReport) -> None:
    """Send dynamo's recompile-limit warnings for the regions of ``report`` to it from now on."""
    import torch._dynamo.convert_frame  # noqa: F401  (the module that warns)

    _NOTICE.report = report
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _NOTICE not in logger.filters:
        logger.addFilter(_NOTICE)
