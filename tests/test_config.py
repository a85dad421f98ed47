"""Pure tests of the configuration edge: every bad value is rejected with one line naming its full key.

No process is started here. The run files are the shipped ``configs/*.yaml`` with dotted overrides on top (what a user
types after ``lsd-train CONFIG.yaml``), small YAML files written to ``tmp_path``, or the keyword arguments of
``StaticDistStrategy`` (what a user writes in Python).
"""

from __future__ import annotations

from datetime import timedelta

import functools
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_static_dist import (
    CompileConfig,
    CompressionGuard,
    ConfigError,
    GraphReport,
    MeshConfig,
    OverlapMonitor,
    RunConfig,
    RunSummary,
    StaticDistStrategy,
    StrategyConfig,
    SyncConfig,
    load_run_config,
)
from lightning_static_dist.runfile import CALLBACKS, DEFAULT_DATA, DEFAULT_MODEL
from lightning_static_dist.mesh import resolve_mesh_shape

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = str(REPO / "configs" / "charlm_cpu.yaml")
GPU_CONFIG = str(REPO / "configs" / "charlm_gpu.yaml")


def assert_one_line_naming(err: ConfigError, key: str, shown: str) -> None:
    """The contract of every ConfigError: one line, the full key, the bad value (or the bad key itself)."""
    message = str(err)
    assert message, "empty ConfigError message"
    assert "\n" not in message, f"message is not one line: {message!r}"
    assert key in message, f"{key!r} not named in {message!r}"
    assert shown in message, f"{shown!r} not shown in {message!r}"


# ------------------------------------------------------------------------------------ invalid: dotted overrides

# (overrides merged over configs/charlm_cpu.yaml, the full key the message must name, a fragment showing the bad value)
INVALID_OVERRIDES = [
    # unknown keys, at every level
    pytest.param(["optimizer.lr=0.1"], "optimizer", "unknown top-level key", id="unknown-top-level-key"),
    pytest.param(["strategy.fsdp.enabled=true"], "strategy.fsdp", "unknown key", id="unknown-strategy-section"),
    pytest.param(["strategy.compile.backnd=eager"], "strategy.compile.backnd", "unknown key", id="unknown-key-compile"),
    pytest.param(["strategy.mesh.dp_replicat=2"], "strategy.mesh.dp_replicat", "unknown key", id="unknown-key-mesh"),
    pytest.param(["strategy.sync.bucket_mbb=10"], "strategy.sync.bucket_mbb", "did you mean 'bucket_mb'?",
                 id="unknown-key-sync"),
    pytest.param(["callbacks.compression_guard.enabled=true"], "callbacks.compression_guard.enabled",
                 "strategy.compression.name is 'none'", id="guard-without-compression"),
    pytest.param(["strategy.compression.rnk=4"], "strategy.compression.rnk", "unknown key", id="unknown-key-compression"),
    pytest.param(["strategy.compression.name=topk", "strategy.compression.density=2"], "strategy.compression.density",
                 "=2.0", id="compression-density-above-one"),
    pytest.param(["strategy.embedding.shards=false"], "strategy.embedding.shards", "unknown key", id="unknown-key-embedding"),
    # wrong types
    pytest.param(["strategy.sync.bucket_mb=lots"], "strategy.sync.bucket_mb", "'lots'", id="string-for-float"),
    pytest.param(["strategy.timeout_s=soon"], "strategy.timeout_s", "'soon'", id="string-for-float-timeout"),
    pytest.param(["strategy.sync.broadcast_buffers=1"], "strategy.sync.broadcast_buffers", "=1", id="int-for-bool"),
    pytest.param(["strategy.mesh.dp_replicate=1.5"], "strategy.mesh.dp_replicate", "1.5", id="float-for-int"),
    pytest.param(["strategy.embedding.min_rows=true"], "strategy.embedding.min_rows", "True", id="bool-for-int"),
    pytest.param(["seed=true"], "seed", "True", id="bool-for-seed"),
    pytest.param(["strategy.sync=10"], "strategy.sync", "10", id="scalar-for-section"),
    # out of range, or not implemented yet
    pytest.param(["strategy.sync.bucket_mb=0"], "strategy.sync.bucket_mb", "=0", id="bucket-mb-zero"),
    pytest.param(["strategy.sync.bucket_mb=-3"], "strategy.sync.bucket_mb", "-3", id="bucket-mb-negative"),
    pytest.param(["strategy.sync.first_bucket_mb=5000"], "strategy.sync.first_bucket_mb", "5000", id="first-bucket-too-big"),
    pytest.param(["strategy.sync.mode=ring"], "strategy.sync.mode", "'ring'", id="sync-mode-unknown"),
    pytest.param(["strategy.timeout_s=0"], "strategy.timeout_s", "=0", id="timeout-zero"),
    pytest.param(["strategy.timeout_s=-5"], "strategy.timeout_s", "-5", id="timeout-negative"),
    pytest.param(["strategy.mesh.dp_replicate=0"], "strategy.mesh.dp_replicate", "=0", id="mesh-replicate-zero"),
    pytest.param(["strategy.mesh.dp_shard=-1"], "strategy.mesh.dp_shard", "-1", id="mesh-both-inferred"),
    pytest.param(["strategy.mesh.dp_shard=2", "strategy.sync.mode=graph"], "strategy.sync.reduce", "'auto'",
                 id="mesh-shard-with-graph-mode"),
    pytest.param(["strategy.sync.reduce=scatter"], "strategy.sync.reduce", "'scatter'", id="reduce-unknown"),
    pytest.param(["strategy.compile.regional=maybe"], "strategy.compile.regional", "'maybe'", id="compile-regional-bogus"),
    pytest.param(["strategy.compile.backend=turbo"], "strategy.compile.backend", "'turbo'", id="compile-backend-unknown"),
    pytest.param(["strategy.compile.mode=fastest"], "strategy.compile.mode", "'fastest'", id="compile-mode-bogus"),
    pytest.param(["strategy.compression.name=zip"], "strategy.compression.name", "'zip'", id="compression-unknown"),
    pytest.param(["strategy.embedding.shard=maybe"], "strategy.embedding.shard", "'maybe'", id="embedding-shard-bogus"),
    pytest.param(["strategy.embedding.prefetch=never"], "strategy.embedding.prefetch", "'never'", id="embedding-prefetch-bogus"),
    pytest.param(["strategy.sync.nonfinite=ignore"], "strategy.sync.nonfinite", "'ignore'", id="nonfinite-bogus"),
    pytest.param(["strategy.sync.check=always"], "strategy.sync.check", "'always'", id="sync-check-bogus"),
    pytest.param(["strategy.embedding.min_rows=0"], "strategy.embedding.min_rows", "=0", id="embedding-min-rows-zero"),
    pytest.param(["seed=-1"], "seed", "-1", id="seed-negative"),
    # trainer
    pytest.param(["trainer.max_stepz=3"], "trainer.max_stepz", "did you mean 'max_steps'", id="trainer-typo-suggests"),
    pytest.param(["trainer.precision=bogus"], "trainer.precision", "'bogus'", id="trainer-precision-bogus"),
    pytest.param(["trainer.strategy=ddp"], "trainer.strategy", "'ddp'", id="trainer-strategy-reserved"),
    pytest.param(["trainer.callbacks=[]"], "trainer.callbacks", "[]", id="trainer-callbacks-reserved"),
    pytest.param(["trainer.devices=0"], "trainer.devices", "=0", id="trainer-devices-zero"),
    pytest.param(["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", "=0", id="trainer-accumulate-zero"),
    pytest.param(["trainer.max_steps=-5"], "trainer.max_steps", "-5", id="trainer-max-steps-below-minus-one"),
    pytest.param(["trainer.max_steps=1e3"], "trainer.max_steps", "1000.0", id="trainer-float-for-int"),
    pytest.param(["trainer=5"], "trainer", "5", id="trainer-not-a-mapping"),
    # model / data
    pytest.param(["model.n_layers=2"], "model.n_layers", "did you mean 'n_layer'", id="model-unknown-init-arg"),
    pytest.param(["model.n_layer=four"], "model.n_layer", "'four'", id="model-init-arg-wrong-type"),
    pytest.param(["model.class_path=no_such_pkg.Model"], "model.class_path", "'no_such_pkg.Model'", id="model-class-not-importable"),
    pytest.param(["model.class_path=lightning_static_dist.examples.charlm.NoSuchModel"], "model.class_path", "NoSuchModel", id="model-class-missing-attr"),
    pytest.param(["model.class_path=CharGPT"], "model.class_path", "'CharGPT'", id="model-class-not-dotted"),
    pytest.param(["data.shuffle=false"], "data.shuffle", "unknown key", id="data-unknown-key"),
    pytest.param(["data.path=5"], "data.path", "=5", id="data-path-wrong-type"),
    # callbacks
    pytest.param(["callbacks.early_stop.enabled=true"], "callbacks.early_stop", "unknown callback", id="callback-unknown-name"),
    pytest.param(["callbacks.run_summary.enabled=1"], "callbacks.run_summary.enabled", "=1", id="callback-enabled-not-bool"),
    pytest.param(["callbacks.run_summary.warmup=2"], "callbacks.run_summary.warmup", "unknown key", id="callback-unknown-option"),
    pytest.param(["callbacks.run_summary.warmup_steps=two"], "callbacks.run_summary.warmup_steps", "'two'", id="callback-option-wrong-type"),
    pytest.param(["callbacks.compression_guard.patience=0"], "callbacks.compression_guard.patience", "=0", id="guard-patience-zero"),
    pytest.param(["callbacks.compression_guard.loss_spike=0.5"], "callbacks.compression_guard.loss_spike", "=0.5",
                 id="guard-loss-spike-below-one"),
    # the override itself
    pytest.param(["trainer.max_steps"], "trainer.max_steps", "expected dotted.key=value", id="override-without-equals"),
    pytest.param(["=3"], "'=3'", "expected dotted.key=value", id="override-without-key"),
    pytest.param(["trainer.max_steps=${nowhere}"], "trainer.max_steps", "nowhere", id="override-bad-interpolation"),
]


@pytest.mark.parametrize(("overrides", "key", "shown"), INVALID_OVERRIDES)
def test_invalid_override_is_rejected_with_one_line_naming_the_key(overrides: list[str], key: str, shown: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_run_config(CPU_CONFIG, overrides)
    assert_one_line_naming(excinfo.value, key, shown)


# ------------------------------------------------------------------------------------ invalid: files


INVALID_FILES = [
    pytest.param("trainer: {max_steps: 3\n", "bad.yaml", "not valid YAML", id="yaml-syntax-error"),
    pytest.param("seed: 1\nseed: 2\n", "bad.yaml", "not valid YAML", id="yaml-duplicate-key"),
    pytest.param("42\n", "bad.yaml", "not valid YAML", id="top-level-is-a-number"),
    pytest.param("seed: 1\nmodle: {n_layer: 2}\n", "modle", "unknown top-level key", id="unknown-top-level-key-in-file"),
    pytest.param("strategy:\n  sync:\n    bucket_mb: '25'\n", "strategy.sync.bucket_mb", "'25'", id="quoted-number-in-file"),
    pytest.param(None, "missing.yaml", "no such file", id="missing-config-file"),
]


@pytest.mark.parametrize(("text", "key", "shown"), INVALID_FILES)
def test_invalid_file_is_rejected_with_one_line(tmp_path: Path, text: Optional[str], key: str, shown: str) -> None:
    path = tmp_path / ("missing.yaml" if text is None else "bad.yaml")
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_run_config(str(path))
    assert_one_line_naming(excinfo.value, key, shown)


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
    pytest.param({"timeout_s": "1h"}, "strategy.timeout_s", "'1h'", id="timeout-string"),
    pytest.param({"timeout_s": 0}, "strategy.timeout_s", "=0", id="timeout-zero"),
    pytest.param({"start_method": "thread"}, "start_method", "'thread'", id="start-method-unknown"),
    pytest.param({"process_group_backend": ""}, "process_group_backend", "''", id="backend-empty"),
    pytest.param({"process_group_backend": "glooo"}, "process_group_backend", "'gloo', 'nccl'", id="backend-typo"),
    pytest.param({"process_group_backend": "cpu:gloo,cuda:ncl"}, "process_group_backend", "'cpu:gloo,cuda:ncl'",
                 id="backend-typo-in-a-pair"),
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


@pytest.mark.parametrize("override", ["model=[1]", "strategy.sync=[]"])
def test_list_over_a_mapping_is_a_config_error(override: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_run_config(CPU_CONFIG, [override])
    assert_one_line_naming(excinfo.value, override.split("=")[0], "")


def test_file_whose_top_level_is_a_list_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- seed\n- model\n")
    with pytest.raises(ConfigError) as excinfo:
        load_run_config(str(path))
    assert_one_line_naming(excinfo.value, "list.yaml", "")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_timeout_is_rejected(value: float) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StaticDistStrategy(timeout_s=value)
    assert_one_line_naming(excinfo.value, "strategy.timeout_s", repr(value))


def test_class_path_to_a_non_callable_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_run_config(CPU_CONFIG, ["model.class_path=os.sep"])
    assert_one_line_naming(excinfo.value, "model.class_path", "'os.sep'")


# ------------------------------------------------------------------------------------ valid inputs


@pytest.mark.parametrize("path", [CPU_CONFIG, GPU_CONFIG], ids=["cpu", "gpu"])
def test_shipped_configs_load(path: str) -> None:
    cfg = load_run_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.model.class_path == "lightning_static_dist.examples.charlm.CharGPT"
    assert cfg.data.class_path == "lightning_static_dist.examples.charlm.CharDataModule"
    assert cfg.strategy.mesh == MeshConfig(dp_replicate=-1, dp_shard=1)
    assert cfg.strategy.timeout_s == 600.0
    assert cfg.callbacks["run_summary"].enabled
    assert cfg.callbacks["run_summary"].options == {"warmup_steps": 5, "print_every_n_steps": 25}
    assert "strategy" not in cfg.trainer and "callbacks" not in cfg.trainer


def test_overrides_merge_over_the_file() -> None:
    cfg = load_run_config(CPU_CONFIG, ["trainer.max_steps=7", "strategy.sync.bucket_mb=10", "model.n_layer=2",
                                       "callbacks.run_summary.enabled=false"])
    assert cfg.trainer["max_steps"] == 7
    assert cfg.trainer["devices"] == 2  # untouched keys of the same block survive
    assert cfg.strategy.sync.bucket_mb == 10.0 and type(cfg.strategy.sync.bucket_mb) is float
    assert cfg.strategy.sync.first_bucket_mb == 1.0
    assert cfg.model.init_args["n_layer"] == 2 and cfg.model.init_args["n_head"] == 4
    assert cfg.callbacks["run_summary"].enabled is False


def test_later_override_wins() -> None:
    assert load_run_config(CPU_CONFIG, ["trainer.max_steps=7", "trainer.max_steps=9"]).trainer["max_steps"] == 9


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
    config = strategy._config
    assert config.sync is sync and config.sync.bucket_mb == 5.0
    assert config.mesh == MeshConfig(dp_replicate=-1, dp_shard=1)
    assert config.timeout_s == 60.0


def test_omitted_sections_take_their_defaults(tmp_path: Path) -> None:
    path = tmp_path / "minimal.yaml"
    path.write_text("seed: 3\n")
    cfg = load_run_config(str(path))
    assert cfg.seed == 3
    assert cfg.model.class_path == DEFAULT_MODEL and cfg.model.init_args == {}
    assert cfg.data.class_path == DEFAULT_DATA and cfg.data.init_args == {}
    assert cfg.trainer == {} and cfg.callbacks == {}
    assert cfg.strategy == StrategyConfig()
    assert cfg.strategy.sync == SyncConfig(mode="hooks", bucket_mb=100.0, first_bucket_mb=1.0, broadcast_buffers=True)
    assert StaticDistStrategy()._config == StrategyConfig()


def test_empty_file_and_no_file_are_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_run_config(str(path)) == RunConfig()
    assert load_run_config(None) == RunConfig()
    assert load_run_config(None, ["seed=5"]).seed == 5


# ------------------------------------------------------------------------------------ mesh shape


@pytest.mark.parametrize(
    ("replicate", "world_size", "expected"),
    [(-1, 4, (4, 1)), (-1, 1, (1, 1)), (-1, 3, (3, 1)), (4, 4, (4, 1)), (1, 1, (1, 1))],
    ids=["infer-4", "infer-1", "infer-odd", "explicit-4", "explicit-1"],
)
def test_mesh_shape_inferred_from_the_world(replicate: int, world_size: int, expected: tuple[int, int]) -> None:
    assert resolve_mesh_shape(MeshConfig(dp_replicate=replicate, dp_shard=1), world_size) == expected


@pytest.mark.parametrize(("replicate", "world_size"), [(3, 4), (2, 4), (8, 4), (2, 1)],
                         ids=["not-dividing", "dividing-but-smaller", "larger", "larger-than-one"])
def test_mesh_shape_that_does_not_match_the_world_is_a_config_error(replicate: int, world_size: int) -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve_mesh_shape(MeshConfig(dp_replicate=replicate), world_size)
    assert_one_line_naming(excinfo.value, "strategy.mesh", f"dp_replicate={replicate}")
    assert f"world size {world_size}" in str(excinfo.value)


# ------------------------------------------------------------------------------------ property: never a traceback

_KEYS = [
    # real keys, each level
    "seed", "model", "data", "trainer", "strategy", "callbacks",
    "model.n_layer", "model.n_head", "model.dropout", "model.lr", "data.path", "data.batch_size", "data.max_bytes",
    "trainer.max_steps", "trainer.devices", "trainer.precision", "trainer.accelerator", "trainer.max_epochs",
    "trainer.accumulate_grad_batches", "trainer.gradient_clip_val", "trainer.limit_val_batches", "trainer.num_nodes",
    "strategy.compile", "strategy.compile.enabled", "strategy.compile.mode", "strategy.compile.backend",
    "strategy.mesh", "strategy.mesh.dp_replicate", "strategy.mesh.dp_shard",
    "strategy.sync", "strategy.sync.mode", "strategy.sync.bucket_mb", "strategy.sync.first_bucket_mb",
    "strategy.sync.broadcast_buffers", "strategy.compression.name", "strategy.compression.rank",
    "strategy.compression.density", "strategy.compression.levels", "strategy.embedding.shard",
    "strategy.embedding.min_rows", "strategy.embedding.prefetch", "strategy.timeout_s", "strategy.sync.nonfinite",
    "strategy.sync.check", "strategy.sync.reduce", "strategy.mesh.shard_across_nodes", "strategy.checkpoint",
    "strategy.checkpoint.format", "strategy.checkpoint.consolidate_at_end", "callbacks.overlap_monitor.profiler",
    "strategy.compression.start_step", "callbacks.compression_guard.patience", "callbacks.compression_guard.enabled",
    "callbacks.run_summary", "callbacks.run_summary.enabled", "callbacks.run_summary.warmup_steps",
    "callbacks.run_summary.loss_key",
    # bogus keys, each level, and keys nested under scalars
    "sed", "trainer.max_stepz", "trainer.strategy", "trainer.callbacks", "model.n_layers", "data.bogus",
    "strategy.bogus", "strategy.sync.bucket", "strategy.sync.bucket_mb.inner", "seed.x", "callbacks.nope",
    "callbacks.run_summary.nope", "a.b.c.d",
]

# strings are quoted in the override so YAML keeps them strings; "${...}" still reaches OmegaConf's interpolation
_STRINGS = st.one_of(
    st.sampled_from(["", "auto", "none", "hooks", "default", "cpu", "32-true", "bf16-mixed", "yes", "null", "1",
                     "-1", "1e3", "nan", "${seed}", "${nowhere}", "${oc.env:HOME}", "a=b", "a.b", "[1]", "{a: 1}"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=12),
)
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    _STRINGS,
)


def _render(value: Any) -> str:
    """The text a user would type after ``key=`` to mean ``value``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    return "'" + value.replace("'", "''") + "'"


# class_path values come from a fixed list: random text would be handed to importlib.import_module
_CLASS_PATHS = st.sampled_from(["lightning_static_dist.examples.charlm.CharGPT", "lightning_static_dist.examples.charlm.CharDataModule", "lightning_static_dist.examples.charlm.Nope",
                                "no_such_pkg.Model", "CharGPT", ".x", "collections.OrderedDict"])
_OVERRIDE = st.one_of(
    st.builds(lambda k, v: f"{k}={_render(v)}", st.sampled_from(_KEYS), _VALUES),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["model.class_path", "data.class_path"]), _CLASS_PATHS),
    st.sampled_from(["trainer.max_steps", "=1", "seed==1", "trainer..max_steps=1"]),  # malformed
)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=st.lists(_OVERRIDE, max_size=4))
def test_random_overrides_validate_or_raise_one_line_config_error(overrides: list[str]) -> None:
    try:
        load_run_config(CPU_CONFIG, overrides)
    except ConfigError as err:
        assert str(err) and "\n" not in str(err), f"{overrides} -> {str(err)!r}"


def _nest(dotted: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = _merge(a[k], v) if isinstance(a.get(k), dict) and isinstance(v, dict) else v
    return a


# whole YAML documents: random keys (real and bogus) at any depth, random values, or random text altogether
_DOCUMENTS = st.one_of(
    st.lists(st.tuples(st.sampled_from(_KEYS), _VALUES), max_size=6).map(
        lambda pairs: yaml.safe_dump({"seed": 1, **functools.reduce(_merge, [_nest(k, v) for k, v in pairs], {})},
                                     allow_unicode=True)),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80),
    st.sampled_from(["", "- 1\n- 2\n", "seed: [1\n", "model: !!python/object:os.system {}\n", "{{{", "a: b: c",
                     "trainer:\n  max_steps: 5\n  max_steps: 6\n", "\ttab: 1", "strategy: 5", "callbacks: [1]"]),
)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=_DOCUMENTS)
def test_random_yaml_files_validate_or_raise_one_line_config_error(tmp_path_factory: Any, document: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "run.yaml"
    path.write_text(document, encoding="utf-8")
    try:
        load_run_config(str(path), [])
    except ConfigError as err:
        assert str(err) and "\n" not in str(err), f"{document!r} -> {str(err)!r}"


# ------------------------------------------------------------------------------------ DDPStrategy's arguments


@pytest.mark.parametrize("backend", ["gloo", "NCCL", "cpu:gloo,cuda:nccl"])
def test_registered_process_group_backends_are_accepted(backend: str) -> None:
    assert StaticDistStrategy(process_group_backend=backend)._process_group_backend == backend


def test_any_mapping_is_a_sync_section_beside_ddps_bucket_arguments() -> None:
    from types import MappingProxyType

    strategy = StaticDistStrategy(sync=MappingProxyType({"first_bucket_mb": 2}), bucket_cap_mb=5,
                                  broadcast_buffers=False)
    assert (strategy.config.sync.first_bucket_mb, strategy.config.sync.bucket_mb) == (2.0, 5.0)
    assert strategy.config.sync.broadcast_buffers is False


def test_other_ddp_arguments_are_a_type_error_naming_them() -> None:
    with pytest.raises(TypeError, match="init_sync"):
        StaticDistStrategy(init_sync=False)


def test_from_config_keyword_arguments_win_over_the_run_file() -> None:
    config = load_run_config(CPU_CONFIG, ["strategy.sync.first_bucket_mb=2"]).strategy  # timeout_s 600, bucket_mb 25
    strategy = StaticDistStrategy.from_config(config, timeout=timedelta(seconds=30), bucket_cap_mb=5,
                                              start_method="spawn")
    assert strategy.config.timeout_s == 30.0
    assert (strategy.config.sync.bucket_mb, strategy.config.sync.first_bucket_mb) == (5.0, 2.0)  # the rest kept
    assert strategy.config.compile == config.compile and strategy._start_method == "spawn"
    assert StaticDistStrategy.from_config(config, timeout_s=60).config.timeout_s == 60.0
    assert StaticDistStrategy.from_config(config, sync={"bucket_mb": 7}).config.sync.first_bucket_mb == 1.0
    assert StaticDistStrategy.from_config(config).config == config


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"timeout": timedelta(seconds=30), "timeout_s": 60}, "timeout"),
    ({"bucket_cap_mb": 5, "sync": {"bucket_mb": 10}}, "bucket_cap_mb"),
])
def test_from_config_refuses_one_key_given_twice_in_its_arguments(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StaticDistStrategy.from_config(load_run_config(CPU_CONFIG).strategy, **kwargs)
    assert_one_line_naming(excinfo.value, key, "given twice")


def test_a_num_nodes_given_to_the_strategy_that_the_trainer_replaces_is_warned_about() -> None:
    # as with DDPStrategy, Trainer(num_nodes=...) is the value that counts: a different one on the strategy is lost
    import lightning as L

    with pytest.warns(UserWarning, match="num_nodes=2 given to the strategy is replaced by the Trainer's num_nodes=1"):
        L.Trainer(accelerator="cpu", devices=1, strategy=StaticDistStrategy(num_nodes=2), logger=False)



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
