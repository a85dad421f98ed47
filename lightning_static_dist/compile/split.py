"""One compiled graph for the whole training step, cut where the gradient buckets end.

A step compiled whole is one autograd node, so no gradient collective could overlap its backward; cut at the buckets,
each piece readies its parameters' gradients as soon as its own backward ends. The cutting is torch's own splitter,
``DDPOptimizer``, used as a compiler of graphs with this strategy's bucket sizes; the pieces are reported back
(:attr:`BucketGraphSplitter.ready_groups`) so that the bucket plan follows them (docs/how-it-works.md: Compilation).

Private API: ``DDPOptimizer`` (same constructor and ``compile_fn`` from torch 2.1 to 2.13). A graph it cannot cut is
compiled whole and the compile report says so. Retire this module if torch exposes graph splitting at caller-chosen
boundaries as a public backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_static_dist.wording import counted

log = logging.getLogger(__name__)


class BucketGraphSplitter:
    """A dynamo backend: cuts each graph into pieces of about one bucket of parameters, compiles each piece with
    ``compiler``.

    Args:
        compiler: the backend that compiles each piece (the strategy's recording backend over inductor ...).
        first_bucket_bytes: parameters in the piece whose backward runs first (the last layers): small, so the
            first collective starts early.
        bucket_bytes: parameters in every later piece.

    Example::

        splitter = BucketGraphSplitter(torch._dynamo.lookup_backend("inductor"), 1 << 20, 25 << 20)
        step = torch.compile(model.training_step, backend=splitter)
        step(batch, 0).backward()        # one autograd node per piece
        splitter.ready_groups            # id(parameter) -> piece
    """

    def __init__(self, compiler: Callable[..., Any], first_bucket_bytes: int, bucket_bytes: int) -> None:
        from torch._dynamo.backends.distributed import DDPOptimizer

        self._compiler = compiler
        self._splitter = DDPOptimizer(bucket_bytes_cap=bucket_bytes, backend_compile_fn=compiler,
                                      first_bucket_cap=min(first_bucket_bytes, bucket_bytes))
        self.ready_groups: dict[int, int] = {}
        """``id(parameter)`` -> the piece whose backward completes its gradient (numbered across graphs)."""
        self.pieces = 0
        """Pieces made so far, over every graph this backend compiled (the numbering of ``ready_groups``)."""
        self.cuts: list[int] = []
        """The pieces of each graph holding parameters, in the order compiled (1: not cut)."""
        self.uncut: list[str] = []
        """Why a graph holding parameters was compiled whole (its gradients are then ready only at its end)."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # dynamo lifts the parameters a graph reads into its inputs: the example inputs are the parameters themselves
        params = {i: x for i, x in enumerate(example_inputs) if isinstance(x, nn.Parameter) and x.requires_grad}
        if not params:
            return self._compiler(gm, example_inputs)
        try:
            compiled = self._splitter.compile_fn(gm, example_inputs)
        except NotImplementedError as err:  # e.g. a higher-order op (activation checkpointing) on an older torch
            reason = str(err).strip().splitlines()[0][:200]
            self.uncut.append(reason)
            log.warning(f"static_dist: a graph could not be cut at the gradient buckets ({reason}); compiled whole")
            return self._compiler(gm, example_inputs)
        first = self.pieces
        self._record_pieces(gm, compiled, params)
        self._splitter.buckets = []  # (DDPOptimizer keeps them for its tests: they hold the traced graph's nodes)
        log.debug(f"static_dist: graph cut into {counted(self.pieces - first, 'piece')} at the gradient buckets")
        return compiled

    def _record_pieces(self, gm: torch.fx.GraphModule, compiled: Any, params: dict[int, nn.Parameter]) -> None:
        placeholders = {node.name: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        pieces: list[list[int]] = []  # per piece, in forward order: the input positions it reads
        cut = len(getattr(self._splitter, "buckets", ())) > 1  # else the splitter compiled the graph whole
        if cut and isinstance(compiled, torch.fx.GraphModule):
            for node in compiled.graph.nodes:
                if node.op == "call_module":  # one per piece: the compiled piece
                    reads = [placeholders[a.name] for a in node.all_input_nodes if a.op == "placeholder"]
                    pieces.append([i for i in reads if i in params])
        if not pieces:  # not cut (all its parameters fit one bucket): one piece
            pieces = [list(params)]
        first = self.pieces
        self.cuts.append(len(pieces))
        for k, reads in enumerate(pieces):
            for i in reads:
                # the earliest piece in forward order wins (and an earlier graph's piece over this one's)
                self.ready_groups.setdefault(id(params[i]), first + k)
        self.pieces += len(pieces)

    def describe(self) -> str:
        """One line of the compile report: the pieces of each graph, and what they are for.

        Example::

            >>> splitter.describe()
            '  each of its 2 graphs cut into 4 pieces at the gradient buckets (one autograd node each: their ...'
        """
        if not self.cuts:
            return "  nothing cut at the gradient buckets yet"
        counts = sorted(set(self.cuts))
        if counts == [1]:
            return (f"  not cut at the gradient buckets: the parameters of {'each graph' if len(self.cuts) > 1 else 'the graph'}"
                    " fit one bucket, whose collective goes out when backward ends")
        if len(counts) > 1:
            graphs, pieces = f"its {len(self.cuts)} graphs", f"{', '.join(map(str, self.cuts[:8]))} pieces"
        else:
            graphs = f"each of its {len(self.cuts)} graphs" if len(self.cuts) > 1 else "its graph"
            pieces = counted(counts[0], "piece")
        return (f"  {graphs} cut into {pieces} at the gradient buckets (one autograd node each: their"
                " collectives overlap backward)")
