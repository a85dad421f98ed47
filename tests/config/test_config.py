"""Pure tests of the configuration sections: every bad value is rejected with one line naming its full key.

No process is started here. The values are the keyword arguments of ``StaticDistStrategy`` (what a user writes in
Python), the sections' dataclasses and dicts, and the callbacks' ``Config``s. The run file that holds them is tested
in test_runfile.py, DDP's keyword arguments in test_ddp_arguments.py, the mesh shape in test_mesh.py.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

from _configs import CPU_CONFIG, assert_one_line_naming
from lightning_static_dist import (
    CompileConfig,
    CompressionGuard,
    ConfigError,
    GraphReport,
    MeshConfig,
    OverlapMonitor,
    RunSummary,
    StaticDistStrategy,
    StrategyConfig,
    SyncConfig,
    load_run_config,
)
from lightning_static_dist.runfile import CALLBACKS


# ------------------------------------------------------------------------------------ invalid: Python kwargs

INVALID_STRATEGY_KWARGS = [
    pytest.param({"sync": {"bucket_mbb": 1}}, "strategy.sync.bucket_mbb", "unknown key", id="unknown-sync-key"),
    pytest.param({"sync": {"bucket_mb": -1}}, "strategy.sync.bucket_mb", "-1", id="bucket-mb-negative"),
    pytest.param({"sync": {"first_bucket_mb": 4097}}, "strategy.sync.first_bucket_mb", "4097", id="first-bucket-too-big"),
    pytest.param({"sync": 10}, "strategy.sync", "10", id="section-not-a-mapping"),
    pytest.param({"compile": {"backend": "aot_eager", "mode": "max-autotune"}}, "strategy.compile.mode",
                 "'max-autotune'", id="compile-mode-needs-inductor"),
    pytest.param({"compile": {"fallback": "skip"}}, "strategy.compile.fallback", "'skip'", id="compile-fallback-bogus"),
    pytest.param({"compile": {"fullgraph": "yes"}}, "strategy.compile.fullgraph", "'yes'", id="string-for-bool"),
    pytest.param({"mesh": {"dp_replicate": 0}}, "strategy.mesh.dp_replicate", "=0", id="mesh-replicate-zero"),
    pytest.param({"mesh": {"dp_replicate": -1, "dp_shard": -1}}, "strategy.mesh.dp_shard", "-1", id="mesh-both-inferred"),
    pytest.param({"compression": {"name": "powersgd", "ranks": 4}}, "strategy.compression.ranks", "unknown key", id="compression-option-unknown"),
    pytest.param({"compression": {"name": "powersgd", "rank": 0}}, "strategy.compression.rank", "=0", id="compression-rank-zero"),
    pytest.param({"compression": {"name": "qsgd", "levels": 1}}, "strategy.compression.levels", "=1", id="compression-levels-one"),
    pytest.param({"compression": {"name": "bf16"}, "sync": {"mode": "graph"}}, "strategy.compression.name", "sync.mode=hooks",
                 id="compression-needs-hooks"),
    pytest.param({"embedding": {"shard": "auto"}, "sync": {"mode": "graph"}}, "strategy.embedding.shard", "sync.mode=hooks",
                 id="embedding-shard-needs-hooks"),
    pytest.param({"sync": {"reduce_dtype": "fp16"}}, "strategy.sync.reduce_dtype", "'fp16'", id="reduce-dtype-unknown"),
    pytest.param({"sync": {"reduce_dtype": "bf16"}, "compression": {"name": "powersgd"}}, "strategy.sync.reduce_dtype",
                 "allowed with compression: 'fp32'", id="reduce-dtype-with-compression"),
    pytest.param({"sync": {"reduce_dtype": "bf16", "reduce": "reduce_scatter"}, "mesh": {"dp_shard": 2}},
                 "strategy.sync.reduce_dtype", "allowed: 'fp32'", id="reduce-dtype-with-reduce-scatter"),
    pytest.param({"compile": {"around_blocks": True}}, "strategy.compile.around_blocks", "regional=true",
                 id="around-blocks-needs-blocks"),
    pytest.param({"compile": {"cudagraphs": True, "backend": "aot_eager"}}, "strategy.compile.cudagraphs",
                 "come from inductor", id="cudagraphs-need-inductor"),
    pytest.param({"compile": {"cudagraphs": False, "mode": "reduce-overhead"}}, "strategy.compile.cudagraphs",
                 "allowed with it: auto, true", id="cudagraphs-against-the-mode"),
    pytest.param({"compile": {"cudagraphs": "maybe"}}, "strategy.compile.cudagraphs", "'maybe'", id="cudagraphs-bogus"),
    pytest.param({"compile": {"cudagraphs": True}, "sync": {"mode": "graph"}}, "strategy.compile.cudagraphs",
                 "sync.mode=graph", id="cudagraphs-with-graph-mode"),
    pytest.param({"compile": {"cudagraphs": True, "regional": True}}, "strategy.compile.cudagraphs",
                 "regional=true", id="cudagraphs-with-blocks"),
    pytest.param({"timeout_s": "1h"}, "strategy.timeout_s", "'1h'", id="timeout-string"),
    pytest.param({"timeout_s": 0}, "strategy.timeout_s", "=0", id="timeout-zero"),
    pytest.param({"start_method": "thread"}, "start_method", "'thread'", id="start-method-unknown"),
    pytest.param({"num_nodes": 0}, "num_nodes", "=0", id="num-nodes-zero"),
    pytest.param({"ddp_comm_hook": print}, "ddp_comm_hook", "DDP's reducer does not run", id="ddp-comm-hook"),
    pytest.param({"model_averaging_period": 4}, "model_averaging_period", "=4", id="ddp-model-averaging"),
    pytest.param({"timeout": timedelta(seconds=30), "timeout_s": 60}, "timeout", "given twice", id="timeout-twice"),
    pytest.param({"timeout": 30}, "timeout", "timedelta", id="timeout-not-a-timedelta"),
    pytest.param({"bucket_cap_mb": 5, "sync": {"bucket_mb": 10}}, "bucket_cap_mb", "given twice",
                 id="ddp-bucket-cap-twice"),
]


@pytest.mark.parametrize(("kwargs", "key", "shown"), INVALID_STRATEGY_KWARGS)
def test_strategy_rejects_bad_kwargs_before_any_process(kwargs: dict[str, Any], key: str, shown: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StaticDistStrategy(**kwargs)
    assert_one_line_naming(excinfo.value, key, shown)


def test_strategy_config_from_dict_names_the_key() -> None:
    with pytest.raises(ConfigError) as excinfo:
        StrategyConfig.from_dict({"sync": {"bucket_mb": 0}})
    assert_one_line_naming(excinfo.value, "strategy.sync.bucket_mb", "=0")
    with pytest.raises(ConfigError) as excinfo:
        StrategyConfig.from_dict({"synch": {}})
    assert_one_line_naming(excinfo.value, "strategy.synch", "unknown key")
    with pytest.raises(ConfigError) as excinfo:
        StrategyConfig.from_dict([1, 2])
    assert_one_line_naming(excinfo.value, "strategy", "[1, 2]")


def test_dataclass_section_validates_itself() -> None:
    with pytest.raises(ConfigError) as excinfo:
        SyncConfig(bucket_mb=True)  # a bool is an int, but not a size
    assert_one_line_naming(excinfo.value, "strategy.sync.bucket_mb", "True")
    with pytest.raises(ConfigError) as excinfo:
        MeshConfig(dp_shard=0)
    assert_one_line_naming(excinfo.value, "strategy.mesh.dp_shard", "=0")


# ------------------------------------------------------------------------------------ invalid: regressions


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_timeout_is_rejected(value: float) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StaticDistStrategy(timeout_s=value)
    assert_one_line_naming(excinfo.value, "strategy.timeout_s", repr(value))


# ------------------------------------------------------------------------------------ valid inputs


def test_int_for_a_float_field_is_stored_as_float() -> None:
    # the shipped file itself says `bucket_mb: 25` and `timeout_s: 600`
    cfg = load_run_config(CPU_CONFIG)
    assert type(cfg.strategy.sync.bucket_mb) is float and cfg.strategy.sync.bucket_mb == 25.0
    assert type(cfg.strategy.timeout_s) is float
    sync = SyncConfig(bucket_mb=5, first_bucket_mb=2)
    assert type(sync.bucket_mb) is float and type(sync.first_bucket_mb) is float


def test_strategy_accepts_dataclasses_and_dicts() -> None:
    sync = SyncConfig(bucket_mb=5)
    strategy = StaticDistStrategy(sync=sync, mesh={"dp_replicate": -1}, compile=CompileConfig(), timeout_s=60)
    config = strategy.config
    assert config.sync is sync and config.sync.bucket_mb == 5.0
    assert config.mesh == MeshConfig(dp_replicate=-1, dp_shard=1)
    assert config.timeout_s == 60.0


# ------------------------------------------------------------------------------------ callbacks' configs


@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_a_callbacks_keyword_arguments_are_the_fields_of_its_config(name: str) -> None:
    # the run file's block is checked against Config, the callback is built from its keyword arguments: they must agree
    import dataclasses
    import inspect

    cls = CALLBACKS[name]
    arguments = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert arguments == [f.name for f in dataclasses.fields(cls.Config)]
    assert cls.Config.KEY == f"callbacks.{name}"
    assert cls().config == cls.Config()


@pytest.mark.parametrize(("cls", "kwargs", "message"), [
    (RunSummary, {"warmup_steps": -1}, "callbacks.run_summary.warmup_steps=-1: must be an integer >= 0"),
    (GraphReport, {"print_summary": "no"}, "callbacks.graph_report.print_summary='no': expected bool"),
    (OverlapMonitor, {"timeline_every_n_steps": -2},
     "callbacks.overlap_monitor.timeline_every_n_steps=-2: must be an integer >= 0 (0: never)"),
    (OverlapMonitor, {"profiler": {"warmup": -1}}, "callbacks.overlap_monitor.profiler.warmup=-1: must be an integer >= 0"),
    (CompressionGuard, {"loss_ema": 1.0}, "callbacks.compression_guard.loss_ema=1.0: must be in [0, 1)"),
], ids=["run_summary", "graph_report", "overlap_monitor", "profiler", "compression_guard"])
def test_a_callback_built_in_python_names_its_run_file_key(cls: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        cls(**kwargs)
    assert str(excinfo.value) == message
