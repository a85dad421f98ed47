"""``strategy.compile.cudagraphs``: whether the compiled step is replayed as CUDA graphs, and what inductor left out.

Replayed as CUDA graphs, each graph piece is one launch, so the host stays ahead of the GPU and its stalls no longer
stall the step; the collectives still go out between the pieces. ``auto`` turns them on where nothing in the step is
known to defeat them (:func:`hazards`); ``true`` refuses, in one line, a run with one of these hazards. A graph
inductor still refuses runs its kernels one by one, and :class:`SkipCapture` says so. Why, and the hazards:
docs/how-it-works.md, "Compilation".

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

from lightning_static_dist.compile.config import INDUCTOR_BACKENDS, MODE_CUDAGRAPHS, CompileConfig, CompileOptions
from lightning_static_dist.config.check import fail
from lightning_static_dist.compile.report import listen_to_artifacts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudagraphChoice:
    """Whether the strategy's graphs are replayed as CUDA graphs, and why (a clause for the compile report)."""

    on: bool
    why: str

    def describe(self) -> str:
        return f"CUDA graphs: {'on' if self.on else 'off'} ({self.why})"


def choose_cudagraphs(config: CompileOptions, device: torch.device, sync_mode: str, gathers_parameters: bool,
                      micro_batches: Optional[int] = 1, automatic_optimization: bool = True) -> CudagraphChoice:
    """Resolve ``compile.cudagraphs`` for a run on ``device``.

    ``gathers_parameters``: the strategy gathers some parameters into new buffers between steps (sharded embeddings,
    ``reduce_scatter``); ``micro_batches``: backward passes per optimizer step (``None``: the loop decides, as Fabric's
    does); ``automatic_optimization``: Lightning steps the optimizer outside the compiled step. ``true`` with one of
    the hazards :func:`hazards` names is a one-line ``ConfigError``; ``auto`` is then off, and says why."""
    if config.backend not in INDUCTOR_BACKENDS:
        return CudagraphChoice(False, f"backend {config.backend!r}: CUDA graphs come from inductor")
    decided = MODE_CUDAGRAPHS.get(config.mode)
    if decided is not None:
        return CudagraphChoice(decided, f"compile.mode={config.mode}")
    found = hazards(config, sync_mode, gathers_parameters, micro_batches, automatic_optimization)
    if config.cudagraphs is not True and config.cudagraphs is not False:  # auto
        if device.type != "cuda":
            return CudagraphChoice(False, f"auto: the device is {device.type}")
        if found:
            return CudagraphChoice(False, f"auto: {found[0]}")
        if micro_batches is None:  # (not a hazard for `true`: the script says it accumulates nowhere)
            return CudagraphChoice(False, "auto: the loop may accumulate gradients in no_backward_sync, and an"
                                          " accumulated gradient would stay in the graphs' memory")
        return CudagraphChoice(True, "auto: CUDA, inductor, gradients synchronised by hooks")
    if config.cudagraphs and found:
        fail(f"{CompileConfig.KEY}.cudagraphs", True, f"{found[0]}; allowed with it: auto (off here), false")
    if config.cudagraphs and device.type != "cuda":  # (inductor would drop them without a word: no CUDA kernels)
        return CudagraphChoice(False, f"compile.cudagraphs=true, but the device is {device.type}")
    return CudagraphChoice(config.cudagraphs, f"compile.cudagraphs={str(config.cudagraphs).lower()}")


def hazards(config: CompileOptions, sync_mode: str, gathers_parameters: bool, micro_batches: Optional[int],
            automatic_optimization: bool) -> list[str]:
    """What in this run would break CUDA graphs: each is a tensor that must outlive a replay, or a graph recorded
    for something that changes (why, in a clause each)."""
    found = []
    if sync_mode == "graph":
        found.append("sync.mode=graph traces the collectives into the graphs")
    if gathers_parameters:
        found.append("sharded embeddings or reduce_scatter gather parameters between steps")
    if config.regional is True:
        found.append("compile.regional=true makes each block a graph of its own, and a forward without gradients"
                     " (validation) would overwrite one block's output with the next's")
    if config.dynamic is True:
        found.append("compile.dynamic=true records a graph for each input shape")
    if not automatic_optimization:
        found.append("manual optimization steps the optimizer inside the compiled step, so its state would live in"
                     " the graphs' memory")
    if micro_batches is not None and micro_batches > 1:
        found.append(f"trainer.accumulate_grad_batches={micro_batches}: a micro-batch's gradients would stay in the"
                     " graphs' memory, which the next micro-batch's replay overwrites")
    return found


def inductor_options(config: CompileOptions) -> dict[str, Any]:
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
        # every warning of inductor's cudagraphs loggers is a graph left out ("skipping cudagraphs due to ...", the
        # re-record limit's "skipping cudagraph due to ...", and reasons with no such prefix)
        lines = record.getMessage().strip().splitlines()
        reason = lines[0][:300] if lines else ""
        if not reason or reason in self.skips:
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
