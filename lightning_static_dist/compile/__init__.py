"""Static compilation of a LightningModule inside the strategy, one concern per module.

- :mod:`~lightning_static_dist.compile.regions`: what gets compiled — the whole ``training_step`` or its repeated
  blocks — the region wrappers with their eager fallback, the optimizer step, and the static-shape dataloader edit.
- :mod:`~lightning_static_dist.compile.split`: the whole-step graph cut where the gradient buckets end.
- :mod:`~lightning_static_dist.compile.backends`: the recording backend every region compiles with, and the
  ``inductor_distributed`` dynamo backend.
- :mod:`~lightning_static_dist.compile.report`: what compilation did (:class:`CompileReport`) and every reading of
  dynamo's internal logs.
- :mod:`~lightning_static_dist.compile.log_calls`: ``self.log`` / ``self.log_dict`` in a compiled ``training_step``,
  recorded in the graph and made after it.

Imports flow one way: ``regions`` → ``backends`` → ``report``, and ``regions`` → ``split``, ``log_calls``.
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
    drop_short_last_batch,
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
    "drop_short_last_batch",
    "failure_reason",
    "find_regions",
    "graph_mode_patches",
    "inductor_distributed",
    "is_compiled",
    "register_inductor_distributed",
    "whole_method",
]
