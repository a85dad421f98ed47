"""Typed configuration: the strategy's sections and the YAML run file, validated once, at the edge.

Every section is a dataclass with a docstring on each field. A dataclass checks its own values in
``__post_init__`` and raises :class:`ConfigError` with one line naming the *full* key (``strategy.sync.bucket_mb``),
the bad value and what is allowed. Dicts become dataclasses through :func:`section_from_dict`, which rejects
unknown keys the same way, so a typo never disappears into a ``**kwargs``.

The run file (``lsd-train CONFIG.yaml key=value ...``) has the top level ``seed``, ``model``, ``data``, ``trainer``,
``strategy`` and ``callbacks``; :func:`load_run_config` merges the dotted overrides with OmegaConf and validates
everything — including the ``trainer`` block against ``lightning.Trainer``'s signature and the ``model``/``data``
blocks against their classes' signatures — before a single process is started.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, TypeVar, Union

__all__ = [
    "CallbackConfig",
    "ComponentConfig",
    "CompileConfig",
    "CompressionConfig",
    "ConfigError",
    "EmbeddingConfig",
    "MeshConfig",
    "RunConfig",
    "StrategyConfig",
    "SyncConfig",
    "load_run_config",
    "section_from_dict",
]


class ConfigError(ValueError):
    """A configuration value that is unknown, of the wrong type or out of range. The message is one line."""


# --------------------------------------------------------------------------------------------------------------
# Generic checks: one value against one annotation.
# --------------------------------------------------------------------------------------------------------------


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(annotation, "__name__", str(annotation))


def _matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits ``annotation``; annotations this checker does not understand accept anything."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        # bool is an int: ``True == 1`` must not satisfy Literal[1], nor 1 satisfy Literal[True]
        return any(value == a and type(value) is type(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, Sequence, tuple) or annotation in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin in (dict, Mapping) or annotation is dict:
        return isinstance(value, Mapping)
    # anything else (an Accelerator instance, a Logger ...) cannot come from YAML and is the user's business
    return True


def check_value(key: str, value: Any, annotation: Any) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``value`` fits ``annotation``."""
    if not _matches(value, annotation):
        raise ConfigError(f"{key}={value!r}: expected {_describe(annotation)}")


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r}: {allowed}")


def _check_fields(section: Any) -> None:
    """Type-check every field of a dataclass instance against its annotation."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if f.name.startswith("_"):
            continue
        value = getattr(section, f.name)
        check_value(f"{section.KEY}.{f.name}", value, hints[f.name])
        if hints[f.name] is float and isinstance(value, int):
            object.__setattr__(section, f.name, float(value))


_Section = TypeVar("_Section")


def section_from_dict(cls: type[_Section], data: Any, key: Optional[str] = None) -> _Section:
    """Build the dataclass ``cls`` from a mapping, an instance of ``cls`` or ``None`` (defaults).

    Example::

        sync = section_from_dict(SyncConfig, {"bucket_mb": 10})
    """
    key = key or getattr(cls, "KEY", cls.__name__)
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key}={data!r}: expected a mapping of {_field_names(cls)} or a {cls.__name__}")
    names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    for name in data:
        if name not in names:
            close = difflib.get_close_matches(str(name), sorted(names), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{key}.{name}: unknown key; {hint}allowed: {_field_names(cls)}")
    return cls(**dict(data))


def _field_names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))


# --------------------------------------------------------------------------------------------------------------
# Strategy sections. The full key of each is fixed: ``strategy.<section>``.
# --------------------------------------------------------------------------------------------------------------


@dataclass
class CompileConfig:
    """``strategy.compile``: static compilation of the LightningModule inside the strategy.

    By default the whole ``training_step`` — forward and loss — is traced as one graph; at world size > 1 that graph
    is cut where the gradient buckets end, each piece one autograd node, so the synchroniser's collectives go out
    during backward. A model passed as ``torch.compile(model)`` is compiled this way too, with its backend.

    Example::

        StaticDistStrategy(compile={"enabled": True, "backend": "inductor", "regional": "auto"})
    """

    KEY = "strategy.compile"

    enabled: bool = False
    """Compile the LightningModule inside the strategy."""
    backend: str = "inductor"
    """Any registered dynamo backend: ``inductor``, ``aot_eager`` (debugging), ``inductor_distributed`` ..."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """The inductor mode (only with ``backend: inductor``)."""
    fullgraph: bool = False
    """Fail on any graph break, naming its location, instead of splitting the graph."""
    dynamic: bool = False
    """false: static shapes; a train loader whose last batch is short has that batch dropped (with a warning)
    instead of recompiling for it."""
    regional: Union[bool, Literal["auto"]] = "auto"
    """``auto``: the LightningModule's whole ``training_step`` — forward and loss — as one graph, cut at the gradient
    buckets at world size > 1 (with ``sync.mode: graph``: uncut, the collectives inside it); ``true``: each block
    of the model's largest ``nn.ModuleList``/``nn.Sequential`` of repeated blocks compiled on its own (an error when
    there is none); ``false``: the whole ``training_step``, never cut (every gradient then becomes ready at the end
    of backward)."""
    around_blocks: bool = False
    """With ``regional: true``: compile ``training_step`` around the blocks too, each block call a boundary of
    that graph, so the blocks keep their own graphs and gradients still become ready block by block. What gets
    compiled is the code of ``training_step`` around the call that runs the blocks — typically the loss (a language
    model's cross-entropy over its vocabulary is a large share of the step); a ``forward`` that runs the blocks in a
    loop stays eager around them. Opt-in: ``training_step`` code then runs under dynamo — a branch on ``batch_idx``
    recompiles, many ``self.log`` calls can reach dynamo's recompile limit (those frames then run eagerly); the
    compile report shows both. Not applied with manual optimization. Never ``fullgraph``."""
    fallback: Literal["eager", "error"] = "eager"
    """A region that fails to compile: run it eagerly (logged once, counted) or raise."""
    optimizer: bool = False
    """Also compile ``optimizer.step()``."""

    def __post_init__(self) -> None:
        _check_fields(self)
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.backend not in backends:
            _fail(f"{self.KEY}.backend", self.backend, f"not a registered dynamo backend; allowed: {', '.join(sorted(backends))}")
        if self.mode != "default" and self.backend != "inductor":
            _fail(f"{self.KEY}.mode", self.mode, f"a mode needs backend 'inductor' (backend is {self.backend!r}); allowed with it: 'default'")
        if self.around_blocks and self.regional is not True:
            _fail(f"{self.KEY}.around_blocks", self.around_blocks,
                  f"compiles around blocks compiled one by one, which needs {self.KEY}.regional=true"
                  f" (it is {self.regional!r}); allowed otherwise: false")


@dataclass
class MeshConfig:
    """``strategy.mesh``: the shape of the data-parallel ``DeviceMesh``, built at run time from the actual world.

    ``dp_replicate * dp_shard`` must equal the world size; ``-1`` infers one of them. Ranks ``r * dp_shard ..
    r * dp_shard + dp_shard - 1`` form shard group ``r`` (neighbours: the same node, where the fast links are).
    With ``dp_shard > 1`` and ``strategy.sync.reduce: reduce_scatter`` (its default then) each shard group splits
    the optimizer state between its ranks.

    Example::

        StaticDistStrategy(mesh={"dp_replicate": 2, "dp_shard": -1})
    """

    KEY = "strategy.mesh"

    dp_replicate: int = -1
    """Replica groups (gradient shards all-reduced across them); -1: world size / dp_shard."""
    dp_shard: int = 1
    """Ranks splitting one replica's optimizer state (gradients reduce-scattered among them); -1: world size /
    dp_replicate."""
    shard_across_nodes: bool = False
    """Allow a shard group to span several hosts (its reduce-scatter and all-gather then cross the slow links);
    false stops such a job at start-up, listing each rank's host."""

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in ("dp_replicate", "dp_shard"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                _fail(f"{self.KEY}.{name}", value, "must be -1 (infer) or an integer >= 1")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            _fail(f"{self.KEY}.dp_shard", self.dp_shard, "at most one of dp_replicate and dp_shard may be -1")


@dataclass
class SyncConfig:
    """``strategy.sync``: how gradients are synchronised across the mesh's ``dp`` group.

    Parameters are grouped into flat buckets in the order backward produced their gradients in the first step
    (rank 0's observation, shared); each bucket launches its asynchronous collective as soon as its last gradient
    is ready, in plan order.

    Example::

        StaticDistStrategy(sync={"bucket_mb": 10, "first_bucket_mb": 0.5})
    """

    KEY = "strategy.sync"

    mode: Literal["hooks", "graph"] = "hooks"
    """``hooks``: bucketed async collectives launched from post-accumulate-grad hooks (any model, any usage).
    ``graph``: each parameter read in the forward passes through an identity whose backward is a functional
    all-reduce, so the collectives are traced into the compiled backward graph and inductor buckets them and
    schedules them against compute; needs ``compile`` and every rank to use every trainable parameter on every
    step (the ranks' graphs are compared before the first backward)."""
    reduce: Literal["auto", "all_reduce", "reduce_scatter"] = "auto"
    """``all_reduce``: every rank gets the whole averaged gradient and keeps the whole optimizer state.
    ``reduce_scatter``: each bucket is reduce-scattered over the mesh's ``dp_shard`` group and all-reduced over
    ``dp_replicate``; each rank steps only its shard (optimizer state / ``dp_shard``) and the updated shards are
    all-gathered back, overlapped with the next forward. ``auto``: ``reduce_scatter`` when ``dp_shard > 1``."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype gradients are averaged in, like FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``: ``fp32`` (their
    own dtype, exact) or ``bf16`` (half the bytes: one cast into a persistent bf16 bucket, one all-reduce, one copy
    back; the sum is rounded to bf16). Not a compressor: no error feedback, no phases."""
    bucket_mb: float = 100.0
    """Capacity of each bucket after the first, in MiB."""
    first_bucket_mb: float = 1.0
    """Capacity of the first bucket, in MiB: small, so the first collective starts early in backward."""
    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics ...) from rank 0 before every training forward, like DDP."""
    check: Literal["pass", "collective"] = "pass"
    """How ranks check they are in step: ``pass`` (a small integer all-reduce per round compares their backward-pass
    numbers, read two rounds later: nothing waits) or, to debug, ``collective`` (a small blocking all-gather before
    every bucket's collective comparing bucket, size and pass: names the first disagreement before any mismatched
    data is exchanged; slow)."""
    nonfinite: Literal["off", "warn", "skip", "error"] = "off"
    """After each synchronised backward, check the averaged gradients for NaN/Inf (one flag all-reduced, so every
    rank decides alike): ``warn`` and step anyway, ``skip`` the optimizer step on every rank, ``error`` naming the
    first offending parameter. ``off``: no check, like DDP. Not applied with a gradient scaler (16-mixed), which
    skips such steps itself."""

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in ("bucket_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if not 0 < value <= 4096:
                _fail(f"{self.KEY}.{name}", value, "must be a number of MiB in (0, 4096]")


#: The built-in compressors of ``strategy.compression.name``; anything else must be a class path.
COMPRESSORS = ("none", "fp16", "bf16", "powersgd", "qsgd", "topk", "auto")


@dataclass
class CompressionConfig:
    """``strategy.compression``: gradient compression applied to each bucket's collective (``sync.mode: hooks``).

    Gradients the compressor does not take — 1-D tensors and tensors under ``min_numel`` elements (fp16/bf16 take
    every gradient) — travel exact in fp32. Options that a compressor has no use for are ignored by it.

    Example::

        StaticDistStrategy(compression={"name": "powersgd", "rank": 4, "start_step": 100})
    """

    KEY = "strategy.compression"

    name: str = "none"
    """``none``, ``fp16``, ``bf16``, ``powersgd``, ``qsgd``, ``topk``, ``auto`` (after ``start_step``, time exact,
    bf16 and PowerSGD at ``rank`` for ``trial_steps`` steps each and keep the fastest:
    :mod:`lightning_static_dist.compression.auto`), or the class path of a user compressor (``my_pkg.MyCompressor``,
    built without arguments, implementing :class:`~lightning_static_dist.compression.base.Compressor`)."""
    rank: int = 4
    """PowerSGD: rank of the low-rank approximation."""
    warm_start: bool = True
    """PowerSGD: start each step's power iteration from the previous step's Q."""
    min_compression_rate: float = 2.0
    """PowerSGD: compress a matrix only when that sends at least this many times fewer bytes."""
    levels: int = 127
    """QSGD: quantisation levels per sign (2..127: one int8 per value)."""
    density: float = 0.01
    """TopK: fraction of each bucket's entries sent, in (0, 1]."""
    error_feedback: bool = True
    """PowerSGD and TopK: add what compression dropped (each rank its own) to the next step's gradient."""
    start_step: int = 0
    """Synchronised steps reduced exactly before compression starts."""
    min_numel: int = 1024
    """Gradients with fewer elements travel exact."""
    trial_steps: int = 6
    """``auto``: optimizer steps each candidate reduces for (the first is not timed)."""

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.name not in COMPRESSORS:
            if "." not in self.name:
                _fail(f"{self.KEY}.name", self.name, f"unknown compressor; allowed: {', '.join(COMPRESSORS)} or a class path")
            import_object(f"{self.KEY}.name", self.name)
        if self.rank < 1:
            _fail(f"{self.KEY}.rank", self.rank, "must be an integer >= 1")
        if not 0 < self.density <= 1:
            _fail(f"{self.KEY}.density", self.density, "must be a fraction in (0, 1]")
        if not 2 <= self.levels <= 127:
            _fail(f"{self.KEY}.levels", self.levels, "must be an integer in [2, 127] (one int8 per value)")
        if not (math.isfinite(self.min_compression_rate) and self.min_compression_rate >= 1):
            _fail(f"{self.KEY}.min_compression_rate", self.min_compression_rate, "must be a finite number >= 1")
        if self.start_step < 0:
            _fail(f"{self.KEY}.start_step", self.start_step, "must be an integer >= 0")
        if self.min_numel < 1:
            _fail(f"{self.KEY}.min_numel", self.min_numel, "must be an integer >= 1")
        if self.trial_steps < 2:
            _fail(f"{self.KEY}.trial_steps", self.trial_steps, "must be an integer >= 2 (the first step is not timed)")


@dataclass
class EmbeddingConfig:
    """``strategy.embedding``: shard embeddings across data-parallel ranks, with the all-gather hoisted.

    Each rank keeps 1/N of the rows of each sharded embedding (its weight, gradient and optimizer state); the full
    weight is all-gathered asynchronously before the forward and its gradient reduce-scattered in backward. Tied
    uses (``head.weight = wte.weight``) share one gather. See :mod:`lightning_static_dist.embedding`.

    Example::

        StaticDistStrategy(embedding={"shard": "auto", "min_rows": 8192, "prefetch": "after_optimizer"})
    """

    KEY = "strategy.embedding"

    shard: Union[bool, Literal["auto"]] = False
    """``auto``: embeddings (``nn.Embedding``/``nn.EmbeddingBag``) with at least ``min_rows`` rows; ``true``: every
    embedding; ``false``: none. Ignored at world size 1."""
    min_rows: int = 8192
    """With ``shard: auto``, the smallest embedding that gets sharded."""
    prefetch: Literal["batch_start", "after_optimizer"] = "after_optimizer"
    """When the all-gather is issued: right after the previous optimizer step (default: it then overlaps the end of
    the step, the loader and the batch transfer — measured 0 % exposed on 2 CPU ranks, embed-shard benchmark), or
    in the batch-start hook (61 % exposed there: little runs between that hook and the forward). The first step
    issues it before its forward either way."""
    gather_once_per_step: bool = True
    """With gradient accumulation: keep the gathered weight across micro-batches (one gather per step); false
    frees it after every backward and gathers again (less memory, one gather per micro-batch)."""

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.min_rows < 1:
            _fail(f"{self.KEY}.min_rows", self.min_rows, "must be an integer >= 1")


@dataclass
class CheckpointConfig:
    """``strategy.checkpoint``: how checkpoints hold state that ``reduce_scatter`` splits between ranks.

    Example::

        StaticDistStrategy(checkpoint={"format": "sharded", "consolidate_at_end": True})
    """

    KEY = "strategy.checkpoint"

    format: Literal["auto", "full", "sharded"] = "auto"
    """``sharded``: a ``torch.distributed.checkpoint`` directory in which each rank writes its own optimizer-state
    ranges (nothing is gathered; any world size or mesh resumes from it). ``full``: one Lightning file with the
    optimizer state gathered to the form an unsharded run writes. ``auto``: ``sharded`` with ``reduce_scatter``,
    else ``full`` (nothing is split then)."""
    consolidate_at_end: bool = True
    """At the end of ``fit``, turn the last sharded checkpoint into a plain Lightning file in place (the same path);
    any other one: ``lsd-consolidate DIR OUT.ckpt``."""

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass
class StrategyConfig:
    """The ``strategy`` block: one field per section plus the collective timeout.

    Example::

        cfg = StrategyConfig.from_dict({"sync": {"bucket_mb": 10}, "timeout_s": 600})
    """

    KEY = "strategy"

    compile: CompileConfig = field(default_factory=CompileConfig)
    """Static compilation."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """The data-parallel DeviceMesh."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Gradient synchronisation."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Gradient compression."""
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    """Sharded embeddings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint format for sharded optimizer state."""
    timeout_s: float = 1800.0
    """Timeout of every collective, in seconds (process-group timeout)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "timeout_s":
                setattr(self, f.name, section_from_dict(typing.get_type_hints(StrategyConfig)[f.name], getattr(self, f.name)))
        check_value(f"{self.KEY}.timeout_s", self.timeout_s, float)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            _fail(f"{self.KEY}.timeout_s", self.timeout_s, "must be a finite number of seconds > 0")
        self.timeout_s = float(self.timeout_s)
        if self.embedding.shard is not False and self.sync.mode == "graph":
            _fail(f"{self.KEY}.embedding.shard", self.embedding.shard,
                  "sharded embeddings need strategy.sync.mode=hooks (mode is 'graph'); allowed with graph: false")
        if self.sync.reduce == "reduce_scatter" or self.mesh.dp_shard != 1:  # -1 may resolve to > 1
            self._check_sharded()
        if self.compression.name != "none" and self.sync.mode == "graph":
            _fail(f"{self.KEY}.compression.name", self.compression.name,
                  "compression runs in the synchroniser's buckets; it needs strategy.sync.mode=hooks (mode is 'graph')")
        if self.compression.name != "none" and self.sync.reduce_dtype != "fp32":
            _fail(f"{self.KEY}.sync.reduce_dtype", self.sync.reduce_dtype,
                  f"a compressor chooses what goes on the wire (compression.name is {self.compression.name!r});"
                  " allowed with compression: 'fp32'")

    def _check_sharded(self) -> None:
        """What ``reduce_scatter`` cannot be combined with yet, named before any process starts."""
        if self.sync.reduce == "all_reduce":
            return  # a 2-D mesh with all_reduce: plain replication over the whole world
        if self.sync.mode == "graph":
            _fail(f"{self.KEY}.sync.reduce", self.sync.reduce,
                  "graph mode traces all-reduces only; with strategy.sync.mode=graph allowed: 'all_reduce'")
        if self.compression.name != "none":
            _fail(f"{self.KEY}.compression.name", self.compression.name,
                  "the compressors are written for all_reduce buckets; with strategy.sync.reduce=reduce_scatter"
                  " allowed: 'none'")
        if self.sync.reduce_dtype != "fp32":
            _fail(f"{self.KEY}.sync.reduce_dtype", self.sync.reduce_dtype,
                  "reduce_scatter reduces the parameters' own buckets; with strategy.sync.reduce=reduce_scatter"
                  " allowed: 'fp32'")
        if self.embedding.shard is True:
            _fail(f"{self.KEY}.embedding.shard", self.embedding.shard,
                  "reduce_scatter already splits every parameter's optimizer state, embeddings included;"
                  " allowed with it: 'auto' (off) or false")

    @classmethod
    def from_dict(cls, data: Any) -> StrategyConfig:
        return section_from_dict(cls, data)


# --------------------------------------------------------------------------------------------------------------
# The run file.
# --------------------------------------------------------------------------------------------------------------

DEFAULT_MODEL = "lightning_static_dist.examples.charlm.CharGPT"
DEFAULT_DATA = "lightning_static_dist.examples.charlm.CharDataModule"


def shipped_configs_dir() -> str:
    """Where the run files shipped with the package lie: inside an installed wheel, or a source checkout's configs/."""
    package = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(package, "configs")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(package), "configs")


def shipped_config_names() -> list[str]:
    folder = shipped_configs_dir()
    return sorted(f[: -len(".yaml")] for f in os.listdir(folder) if f.endswith(".yaml")) if os.path.isdir(folder) else []


def resolve_config_path(name: str) -> str:
    """A run file's path: ``name`` itself when it is a file, else the shipped config called ``name``
    (``charlm_cpu`` or ``charlm_cpu.yaml``)."""
    if os.path.isfile(name) or os.sep in name or "/" in name:
        return name
    shipped = os.path.join(shipped_configs_dir(), name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if os.path.isfile(shipped):
        return shipped
    names = shipped_config_names()
    raise ConfigError(f"config {name!r}: no such file, and no shipped config of that name;"
                      f" shipped: {', '.join(names) or 'none'}")


def import_object(key: str, class_path: str) -> Any:
    """Import ``package.module.Name``; errors name the config key."""
    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        _fail(key, class_path, "expected a dotted import path such as 'my_pkg.models.MyModel'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        _fail(key, class_path, f"cannot import module {module_name!r} ({err})")
    target = getattr(module, attr, None)
    if target is None:
        _fail(key, class_path, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        _fail(key, class_path, f"{class_path!r} is a {type(target).__name__}, not a class")
    return target


def check_kwargs_against(key: str, target: Any, kwargs: Mapping[str, Any], exclude: Sequence[str] = ()) -> None:
    """Check ``kwargs`` against the signature of ``target`` (a class or a callable): names and simple types.

    ``exclude``: argument names that exist but are not for the user to set (left out of the allowed list).
    """
    init = target.__init__ if isinstance(target, type) else target
    params = inspect.signature(init).parameters
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # unresolvable forward references: check names only
        hints = {}
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    allowed = [
        n
        for n, p in params.items()
        if n != "self" and n not in exclude and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    for name, value in kwargs.items():
        if name not in params or name == "self":
            if accepts_var_kw:
                continue
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{key}.{name}: unknown key; {hint}allowed: {', '.join(allowed)}")
        if name in hints:
            check_value(f"{key}.{name}", value, hints[name])


@dataclass
class ComponentConfig:
    """A ``model`` or ``data`` block: ``class_path`` plus the keyword arguments of that class.

    Example (YAML)::

        model:
          class_path: lightning_static_dist.examples.charlm.CharGPT
          n_layer: 4
    """

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, key: str, data: Any, default_class_path: str) -> ComponentConfig:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            _fail(key, data, "expected a mapping with class_path and the class's keyword arguments")
        data = dict(data)
        class_path = data.pop("class_path", default_class_path)
        check_value(f"{key}.class_path", class_path, str)
        target = import_object(f"{key}.class_path", class_path)
        check_kwargs_against(key, target, data)
        return cls(class_path=class_path, init_args=data)

    def instantiate(self, key: str) -> Any:
        """Build the object; a constructor's own ``ValueError``/``TypeError`` becomes a ConfigError naming ``key``."""
        target = import_object(f"{key}.class_path", self.class_path)
        try:
            return target(**self.init_args)
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise ConfigError(f"{key}: {err}") from err


@dataclass
class CallbackConfig:
    """One block under ``callbacks``: ``enabled`` plus the callback's own options."""

    enabled: bool = True
    options: dict[str, Any] = field(default_factory=dict)


#: The callbacks a run file can configure, by name -> import path. Each class's ``__init__`` keyword arguments
#: are that block's options; its ``ValueError`` messages start with ``option=value:`` so that the loader can
#: prefix the full key (``callbacks.run_summary.warmup_steps=-1: ...``).
CALLBACKS: dict[str, str] = {
    "run_summary": "lightning_static_dist.callbacks.RunSummary",
    "graph_report": "lightning_static_dist.callbacks.GraphReport",
    "overlap_monitor": "lightning_static_dist.overlap.monitor.OverlapMonitor",
    "compression_guard": "lightning_static_dist.compression.guard.CompressionGuard",
}

#: Trainer arguments the run file may not set, and why.
_RESERVED_TRAINER_KEYS = {
    "strategy": "use the top-level 'strategy' block",
    "callbacks": "use the top-level 'callbacks' block",
}


@dataclass
class RunConfig:
    """A whole ``lsd-train`` run file, validated.

    Example::

        cfg = load_run_config("charlm_cpu", ["trainer.max_steps=50"])  # a shipped config, or a file's path
    """

    seed: int = 1234
    model: ComponentConfig = field(default_factory=lambda: ComponentConfig(DEFAULT_MODEL))
    data: ComponentConfig = field(default_factory=lambda: ComponentConfig(DEFAULT_DATA))
    trainer: dict[str, Any] = field(default_factory=dict)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    callbacks: dict[str, CallbackConfig] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> RunConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"<top level>={data!r}: expected a mapping with keys seed, model, data, trainer, strategy, callbacks")
        allowed = ("seed", "model", "data", "trainer", "strategy", "callbacks")
        for name in data:
            if name not in allowed:
                raise ConfigError(f"{name}: unknown top-level key; allowed: {', '.join(allowed)}")
        seed = data.get("seed", 1234)
        check_value("seed", seed, int)
        if seed < 0:
            _fail("seed", seed, "must be an integer >= 0")
        trainer = data.get("trainer") or {}
        if not isinstance(trainer, Mapping):
            _fail("trainer", trainer, "expected a mapping of lightning.Trainer keyword arguments")
        from lightning import Trainer

        for name, why in _RESERVED_TRAINER_KEYS.items():
            if name in trainer:
                _fail(f"trainer.{name}", trainer[name], f"not allowed here: {why}")
        check_kwargs_against("trainer", Trainer, trainer, exclude=tuple(_RESERVED_TRAINER_KEYS))
        _check_trainer_ranges(trainer)
        run = cls(
            seed=seed,
            model=ComponentConfig.from_dict("model", data.get("model"), DEFAULT_MODEL),
            data=ComponentConfig.from_dict("data", data.get("data"), DEFAULT_DATA),
            trainer=dict(trainer),
            strategy=section_from_dict(StrategyConfig, data.get("strategy")),
            callbacks=_callbacks_from_dict(data.get("callbacks")),
        )
        guard = run.callbacks.get("compression_guard")
        if guard is not None and guard.enabled and run.strategy.compression.name == "none":
            _fail("callbacks.compression_guard.enabled", True, "the guard steps a compressor down and"
                  " strategy.compression.name is 'none'; allowed: false, or a compressor")
        return run


def _check_trainer_ranges(trainer: Mapping[str, Any]) -> None:
    """Range checks Lightning itself would only make after processes start (or never, for some)."""
    positive = ("max_epochs", "accumulate_grad_batches", "log_every_n_steps", "num_nodes")
    for name in positive:
        value = trainer.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1 and not (name == "max_epochs" and value == -1):
            _fail(f"trainer.{name}", value, "must be an integer >= 1")
    max_steps = trainer.get("max_steps")
    if isinstance(max_steps, int) and max_steps < -1:
        _fail("trainer.max_steps", max_steps, "must be -1 (no limit) or an integer >= 0")
    devices = trainer.get("devices")
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < 1 and devices != -1:
        _fail("trainer.devices", devices, "must be -1 (all), an integer >= 1, 'auto' or a list of device indices")


def _callbacks_from_dict(data: Any) -> dict[str, CallbackConfig]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        _fail("callbacks", data, f"expected a mapping of callback blocks; allowed names: {', '.join(CALLBACKS)}")
    out: dict[str, CallbackConfig] = {}
    for name, block in data.items():
        if name not in CALLBACKS:
            raise ConfigError(f"callbacks.{name}: unknown callback; allowed: {', '.join(CALLBACKS)}")
        block = {} if block is None else block
        if not isinstance(block, Mapping):
            _fail(f"callbacks.{name}", block, "expected a mapping with 'enabled' and the callback's options")
        options = dict(block)
        enabled = options.pop("enabled", True)
        check_value(f"callbacks.{name}.enabled", enabled, bool)
        callback_cls = import_object(f"callbacks.{name}", CALLBACKS[name])
        check_kwargs_against(f"callbacks.{name}", callback_cls, options)
        try:
            callback_cls(**options)  # callbacks are cheap to build: range checks run here, before any process
        except ValueError as err:
            raise ConfigError(f"callbacks.{name}.{err}") from None
        out[name] = CallbackConfig(enabled=enabled, options=options)
    return out


def load_run_config(path: Optional[str], overrides: Sequence[str] = ()) -> RunConfig:
    """Load a YAML run file (a path, or the name of a shipped config: :func:`resolve_config_path`), merge
    ``dotted.key=value`` overrides and validate the result.

    Raises:
        ConfigError: one line naming the key, the bad value and what is allowed.
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if path is not None:
        path = resolve_config_path(path)
    try:
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r}: no such file") from None
    except Exception as err:  # yaml.YAMLError, OmegaConf's own errors: both mean the file is not a valid config
        raise ConfigError(f"config file {path!r}: not valid YAML ({str(err).splitlines()[0]})") from None
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. trainer.max_steps=100")
    if not isinstance(base, DictConfig):
        raise ConfigError(f"config file {path!r}: the top level must be a mapping with keys seed, model, data, trainer, strategy, callbacks")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, TypeError, ValueError) as err:  # e.g. a list merged over a mapping
        raise ConfigError(f"overrides {list(overrides)}: {str(err).splitlines()[0]}") from None
    if data is None:
        data = {}
    return RunConfig.from_dict(data)
