"""Static compilation of a LightningModule inside the strategy, one concern per module: ``regions`` (what gets
compiled, the eager fallback, the optimizer step), ``shapes`` (shapes that vary: the short last batch, dynamic
dimensions, the recompile limit), ``split`` (the step cut at the buckets),
``backends`` (the recording backend, ``inductor_distributed``), ``report`` (what compilation did), ``log_calls``
(``self.log`` in a compiled step), ``cudagraphs`` (whether the step replays as CUDA graphs). Imports flow one way:
``regions`` → ``backends`` → ``report``, and ``regions`` → ``split``, ``log_calls``, ``shapes``.
"""

from lightning_static_dist.compile.backends import (
    RecordingBackend,
    backend_of,
    graph_mode_patches,
    inductor_distributed,
    register_inductor_distributed,
)
from lightning_static_dist.compile.regions import (
    compile_optimizer_step,
    compile_regions,
    find_regions,
    is_compiled,
    whole_method,
)
from lightning_static_dist.compile.report import CompileFailure, CompileReport, GraphRecord, failure_reason
from lightning_static_dist.compile.split import BucketGraphSplitter

__all__ = [
    "BucketGraphSplitter",
    "CompileFailure",
    "CompileReport",
    "GraphRecord",
    "RecordingBackend",
    "backend_of",
    "compile_optimizer_step",
    "compile_regions",
    "failure_reason",
    "find_regions",
    "graph_mode_patches",
    "inductor_distributed",
    "is_compiled",
    "register_inductor_distributed",
    "whole_method",
]
