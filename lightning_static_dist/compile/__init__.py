"""Static compilation of a LightningModule inside the strategy.

- :mod:`~lightning_static_dist.compile.regions`: the whole-step / regional compile, its report and backends.
- :mod:`~lightning_static_dist.compile.split`: the whole-step graph cut where the gradient buckets end.
"""

from lightning_static_dist.compile.regions import (
    CompileFailure,
    CompileReport,
    GraphRecord,
    RecordingBackend,
    allow_compiled_models_in_trainer,
    backend_of,
    compile_optimizer_step,
    compile_regions,
    drop_short_last_batch,
    failure_reason,
    find_regions,
    graph_mode_patches,
    inductor_distributed,
    is_compiled,
    register_inductor_distributed,
    whole_method,
)
from lightning_static_dist.compile.split import BucketGraphSplitter

__all__ = [
    "BucketGraphSplitter",
    "CompileFailure",
    "CompileReport",
    "GraphRecord",
    "RecordingBackend",
    "allow_compiled_models_in_trainer",
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
