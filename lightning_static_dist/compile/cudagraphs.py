"""``strategy.compile.cudagraphs``: whether the compiled step is replayed as CUDA graphs, and what inductor left out.

Why. A compiled GPT-2 step launches about 650 kernels; inductor's Python wrapper, the AOTAutograd wrapper of each
graph piece, the gradient hooks and Lightning's loop all run on the host between those launches. Uncut, the host
keeps ahead of the GPU by a few milliseconds; cut at the gradient buckets (one graph piece per bucket, so that
collectives leave during backward), the host's extra work per piece used up that lead, and the step ran at the
host's pace: any stall of the host (a data-loader worker, a logger, another process on its core) became a stall
of the GPU. Replayed as CUDA graphs (inductor's CUDA graph trees), each piece is one launch; the collectives are
still issued between the pieces, from the same hooks, so overlap is unchanged, and the host is far ahead again.

``auto`` turns them on where nothing in the step is known to defeat them: CUDA, inductor, gradients synchronised by
hooks (``sync.mode: graph`` traces the collectives into the graphs), and no parameter that the strategy gathers
into a new buffer between steps (sharded embeddings, ``reduce_scatter``). A graph inductor still refuses (a CPU
tensor in it, an input it mutates ...) runs its kernels one by one; :class:`SkipCapture` puts inductor's reason in
the compile report, and a warning says so once, so that this slower path is never silent.

Example::

    choice = choose_cudagraphs(CompileConfig(enabled=True), torch.device("cuda", 0), sync_mode="hooks",
                               gathers_parameters=False)
    choice.on, choice.why         # (True, 'auto: CUDA, inductor, gradients synchronised by hooks')
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_static_dist.compile.config import INDUCTOR_BACKENDS, MODE_CUDAGRAPHS, CompileConfig
from lightning_static_dist.compile.report import listen_to_artifacts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudagraphChoice:
    """Whether the strategy's graphs are replayed as CUDA graphs, and why (a clause for the compile report)."""

    on: bool
    why: str

    def describe(self) -> str:
        return f"CUDA graphs: {'on' if self.on else 'off'} ({self.why})"


def choose_cudagraphs(config: CompileConfig, device: torch.device, sync_mode: str,
                      gathers_parameters: bool) -> CudagraphChoice:
    """Resolve ``compile.cudagraphs`` for a run on ``device``; ``gathers_parameters``: the strategy gathers some
    parameters into new buffers between steps (sharded embeddings, ``reduce_scatter``)."""
    if config.backend not in INDUCTOR_BACKENDS:
        return CudagraphChoice(False, f"backend {config.backend!r}: CUDA graphs come from inductor")
    decided = MODE_CUDAGRAPHS.get(config.mode)
    if decided is not None:
        return CudagraphChoice(decided, f"compile.mode={config.mode}")
    if config.cudagraphs is not True and config.cudagraphs is not False:  # auto
        if device.type != "cuda":
            return CudagraphChoice(False, f"auto: the device is {device.type}")
        if sync_mode == "graph":
            return CudagraphChoice(False, "auto: sync.mode=graph traces the collectives into the graphs")
        if gathers_parameters:
            return CudagraphChoice(False, "auto: sharded embeddings or reduce_scatter gather parameters between steps")
        return CudagraphChoice(True, "auto: CUDA, inductor, gradients synchronised by hooks")
    if config.cudagraphs and device.type != "cuda":  # (inductor would drop them without a word: no CUDA kernels)
        return CudagraphChoice(False, f"compile.cudagraphs=true, but the device is {device.type}")
    return CudagraphChoice(config.cudagraphs, f"compile.cudagraphs={str(config.cudagraphs).lower()}")


def inductor_options(config: CompileConfig) -> dict[str, Any]:
    """Inductor's settings for ``config.cudagraphs`` once resolved to a bool (nothing for ``auto``, or where the
    mode decides)."""
    if config.mode in MODE_CUDAGRAPHS or config.cudagraphs == "auto":
        return {}
    return {"triton.cudagraphs": bool(config.cudagraphs)}


class SkipCapture(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." lines (its ``cudagraphs`` artifact logger) into
    ``skips``; the first one is also a warning, so a graph left without CUDA graphs is never a silent slow path."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.skips: Optional[list[str]] = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.skips is None:
            return
        message = record.getMessage().strip()
        if not message.startswith(("skipping cudagraphs", "disabling cudagraphs")):
            return
        reason = message.splitlines()[0][:300]
        if reason in self.skips:
            return
        if not self.skips:
            log.warning(f"static_dist: a compiled graph runs without CUDA graphs, its kernels launched one by one"
                        f" ({reason}); the compile report lists every such graph")
        self.skips.append(reason)


_SKIPS = SkipCapture()


def capture_skips(skips: list[str]) -> None:
    """Send inductor's CUDA-graph skip reasons to ``skips`` from now on (a compile report's list)."""
    import torch._inductor.cudagraph_utils  # noqa: F401  (registers the artifact logger)

    _SKIPS.skips = skips
    # at warnings (a skip is one): none of cudagraph trees' debug-level bookkeeping is switched on by this
    listen_to_artifacts(_SKIPS, ("__cudagraphs",), logging.WARNING)
