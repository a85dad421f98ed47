"""The ``lsd-train`` run file (:mod:`lightning_static_dist.runfile`): every bad value in a file or a dotted override
is rejected with one line naming its full key, valid files and overrides load as written, and random ones (hypothesis)
never end in a traceback.

No process is started here. The run files are the shipped ``configs/*.yaml`` with dotted overrides on top (what a user
types after ``lsd-train CONFIG.yaml``) or small YAML files written to ``tmp_path``.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _configs import CPU_CONFIG, GPU_CONFIG, assert_one_line_naming
from lightning_static_dist import (
    ConfigError,
    MeshConfig,
    RunConfig,
    StaticDistStrategy,
    StrategyConfig,
    SyncConfig,
    load_run_config,
)
from lightning_static_dist.runfile import DEFAULT_DATA, DEFAULT_MODEL


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
    # issue 37: both passed the check, then ended in Lightning's 28-line TypeError once the processes started
    pytest.param(["trainer.devices=-1"], "trainer.devices", "-1 (every device) needs an accelerator",
                 id="trainer-devices-all-on-cpu"),
    pytest.param(["trainer.devices=abc"], "trainer.devices", "'abc'", id="trainer-devices-not-a-number"),
    pytest.param(["trainer.accelerator=gpu", "trainer.devices=abc"], "trainer.devices", "a list of device indices",
                 id="trainer-devices-not-a-number-on-gpu"),
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
    pytest.param(["callbacks.overlap_monitor.enabeld=true"], "callbacks.overlap_monitor.enabeld",
                 "did you mean 'enabled'? allowed: enabled, every_n_steps", id="callback-enabled-misspelt"),
    pytest.param(["callbacks.model_checkpoint.enabeld=true"], "callbacks.model_checkpoint.enabeld",
                 "did you mean 'enabled'? allowed: enabled, dirpath", id="lightning-callback-enabled-misspelt"),
    pytest.param(["callbacks.run_summary.warmup_steps=two"], "callbacks.run_summary.warmup_steps", "'two'", id="callback-option-wrong-type"),
    pytest.param(["callbacks.compression_guard.patience=0"], "callbacks.compression_guard.patience", "=0", id="guard-patience-zero"),
    pytest.param(["callbacks.compression_guard.loss_spike=0.5"], "callbacks.compression_guard.loss_spike", "=0.5",
                 id="guard-loss-spike-below-one"),
    # what the strategy block and the trainer's arguments refuse together, before any process (issue 46)
    pytest.param(["strategy.sync.optimizer_overlap=true"], "strategy.sync.optimizer_overlap",
                 "sync.schedule=measured may choose overlap", id="overlap-true-with-measured"),
    pytest.param(["strategy.sync.schedule=after_backward", "strategy.sync.optimizer_overlap=true",
                  "trainer.precision=16-mixed", "trainer.gradient_clip_val=null"], "strategy.sync.optimizer_overlap",
                 "the gradient scaler (16-mixed)", id="overlap-true-with-16-mixed"),
    pytest.param(["strategy.sync.schedule=after_backward", "strategy.sync.optimizer_overlap=true",
                  "trainer.gradient_clip_val=0.5"], "strategy.sync.optimizer_overlap", "trainer.gradient_clip_val=0.5",
                 id="overlap-true-with-clipping"),
    pytest.param(["strategy.compile.enabled=true", "strategy.compile.cudagraphs=true",
                  "trainer.accumulate_grad_batches=4"], "strategy.compile.cudagraphs",
                 "trainer.accumulate_grad_batches=4", id="cudagraphs-true-with-accumulation"),
    # the override itself
    pytest.param(["trainer.max_steps"], "trainer.max_steps", "expected dotted.key=value", id="override-without-equals"),
    pytest.param(["=3"], "'=3'", "expected dotted.key=value", id="override-without-key"),
    pytest.param(["trainer.max_steps=${nowhere}"], "trainer.max_steps", "nowhere", id="override-bad-interpolation"),
]


def test_what_one_rank_or_no_compilation_leaves_alone_is_not_refused() -> None:
    # one process averages nothing: no overlap to refuse; cudagraphs without compiling: nothing recorded
    overlap = ["strategy.sync.schedule=after_backward", "strategy.sync.optimizer_overlap=true", "trainer.gradient_clip_val=1.0"]
    assert load_run_config(CPU_CONFIG, [*overlap, "trainer.devices=1"]).strategy.sync.optimizer_overlap is True
    load_run_config(CPU_CONFIG, ["strategy.compile.cudagraphs=true", "trainer.accumulate_grad_batches=2"])


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


def refusal_of(path: Path, text: str) -> ConfigError:
    """The error loading a run file that holds ``text``, written at ``path``, raises."""
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_run_config(str(path))
    return excinfo.value


def test_a_yaml_error_keeps_its_cause_and_its_lines(tmp_path: Path) -> None:
    # issue 37: the reader's error was cut to its first line ("while parsing a flow sequence"), which names neither
    # the cause nor where it is
    error = refusal_of(tmp_path / "bad.yaml", "trainer:\n  max_steps: [1, 2\n  devices: 2\n")
    assert_one_line_naming(error, "bad.yaml", "not valid YAML")
    assert "did not find expected ',' or ']' (line 3, column 10)" in str(error), error
    assert "(line 2, column 14)" in str(error), error


@pytest.mark.parametrize("text, line", [
    pytest.param("a: " + "[" * 1000 + "]" * 1000 + "\n", 1, id="flow-1000-levels"),  # YAML's "maximum nesting depth"
    pytest.param("".join("  " * i + f"k{i}:\n" for i in range(150)) + "  " * 150 + "v: 1\n", 33,
                 id="valid-block-150-levels"),  # valid YAML: OmegaConf's RecursionError read as "not valid YAML"
])
def test_yaml_nested_too_deep_is_named_as_such_with_its_line(tmp_path: Path, text: str, line: int) -> None:
    error = refusal_of(tmp_path / "deep.yaml", text)
    assert_one_line_naming(error, "deep.yaml", f"nested deeper than 32 levels at line {line}")
    assert "not valid YAML" not in str(error)


# ------------------------------------------------------------------------------------ invalid: regressions


@pytest.mark.parametrize("override", ["model=[1]", "strategy.sync=[]"])
def test_list_over_a_mapping_is_a_config_error(override: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_run_config(CPU_CONFIG, [override])
    assert_one_line_naming(excinfo.value, override.split("=")[0], "")


def test_file_whose_top_level_is_a_list_is_a_config_error(tmp_path: Path) -> None:
    assert_one_line_naming(refusal_of(tmp_path / "list.yaml", "- seed\n- model\n"), "list.yaml", "")


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
    assert StaticDistStrategy().config == StrategyConfig()


def test_empty_file_and_no_file_are_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_run_config(str(path)) == RunConfig()
    assert load_run_config(None) == RunConfig()
    assert load_run_config(None, ["seed=5"]).seed == 5


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
