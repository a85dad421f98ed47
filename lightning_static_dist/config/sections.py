"""The strategy's sections: the ``strategy`` block of a run file, ``StaticDistStrategy``'s keyword arguments.

Each section is a dataclass with a docstring on every field; its full key is fixed (``strategy.<section>``) and its
``__post_init__`` validates it with the package's one checker (:mod:`lightning_static_dist.config.check`): a bad value
raises a one-line :class:`~lightning_static_dist.config.check.ConfigError` naming the full key
(``strategy.sync.bucket_mb``), the value and what is allowed. :class:`StrategyConfig` holds them all and checks the
combinations they cannot check one by one.

Example::

    cfg = StrategyConfig.from_dict({"sync": {"bucket_mb": 10}, "compression": {"name": "bf16"}})
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from lightning_static_dist.config.check import check_fields, check_value, fail, import_object, section_from_dict

__all__ = [
    "COMPRESSORS",
    "CheckpointConfig",
    "CompileConfig",
    "CompressionConfig",
    "EmbeddingConfig",
    "MeshConfig",
    "StrategyConfig",
    "SyncConfig",
]


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
        check_fields(self)
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.backend not in backends:
            fail(f"{self.KEY}.backend", self.backend, f"not a registered dynamo backend; allowed: {', '.join(sorted(backends))}")
        if self.mode != "default" and self.backend != "inductor":
            fail(f"{self.KEY}.mode", self.mode, f"a mode needs backend 'inductor' (backend is {self.backend!r}); allowed with it: 'default'")
        if self.around_blocks and self.regional is not True:
            fail(f"{self.KEY}.around_blocks", self.around_blocks,
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
        check_fields(self)
        for name in ("dp_replicate", "dp_shard"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                fail(f"{self.KEY}.{name}", value, "must be -1 (infer) or an integer >= 1")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            fail(f"{self.KEY}.dp_shard", self.dp_shard, "at most one of dp_replicate and dp_shard may be -1")


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
        check_fields(self)
        for name in ("bucket_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if not 0 < value <= 4096:
                fail(f"{self.KEY}.{name}", value, "must be a number of MiB in (0, 4096]")


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
        check_fields(self)
        if self.name not in COMPRESSORS:
            if "." not in self.name:
                fail(f"{self.KEY}.name", self.name, f"unknown compressor; allowed: {', '.join(COMPRESSORS)} or a class path")
            import_object(f"{self.KEY}.name", self.name)
        if self.rank < 1:
            fail(f"{self.KEY}.rank", self.rank, "must be an integer >= 1")
        if not 0 < self.density <= 1:
            fail(f"{self.KEY}.density", self.density, "must be a fraction in (0, 1]")
        if not 2 <= self.levels <= 127:
            fail(f"{self.KEY}.levels", self.levels, "must be an integer in [2, 127] (one int8 per value)")
        if not (math.isfinite(self.min_compression_rate) and self.min_compression_rate >= 1):
            fail(f"{self.KEY}.min_compression_rate", self.min_compression_rate, "must be a finite number >= 1")
        if self.start_step < 0:
            fail(f"{self.KEY}.start_step", self.start_step, "must be an integer >= 0")
        if self.min_numel < 1:
            fail(f"{self.KEY}.min_numel", self.min_numel, "must be an integer >= 1")
        if self.trial_steps < 2:
            fail(f"{self.KEY}.trial_steps", self.trial_steps, "must be an integer >= 2 (the first step is not timed)")


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
        check_fields(self)
        if self.min_rows < 1:
            fail(f"{self.KEY}.min_rows", self.min_rows, "must be an integer >= 1")


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
        check_fields(self)


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
            fail(f"{self.KEY}.timeout_s", self.timeout_s, "must be a finite number of seconds > 0")
        self.timeout_s = float(self.timeout_s)
        if self.embedding.shard is not False and self.sync.mode == "graph":
            fail(f"{self.KEY}.embedding.shard", self.embedding.shard,
                  "sharded embeddings need strategy.sync.mode=hooks (mode is 'graph'); allowed with graph: false")
        if self.sync.reduce == "reduce_scatter" or self.mesh.dp_shard != 1:  # -1 may resolve to > 1
            self._check_sharded()
        if self.compression.name != "none" and self.sync.mode == "graph":
            fail(f"{self.KEY}.compression.name", self.compression.name,
                  "compression runs in the synchroniser's buckets; it needs strategy.sync.mode=hooks (mode is 'graph')")
        if self.compression.name != "none" and self.sync.reduce_dtype != "fp32":
            fail(f"{self.KEY}.sync.reduce_dtype", self.sync.reduce_dtype,
                  f"a compressor chooses what goes on the wire (compression.name is {self.compression.name!r});"
                  " allowed with compression: 'fp32'")

    def _check_sharded(self) -> None:
        """What ``reduce_scatter`` cannot be combined with yet, named before any process starts."""
        if self.sync.reduce == "all_reduce":
            return  # a 2-D mesh with all_reduce: plain replication over the whole world
        if self.sync.mode == "graph":
            fail(f"{self.KEY}.sync.reduce", self.sync.reduce,
                  "graph mode traces all-reduces only; with strategy.sync.mode=graph allowed: 'all_reduce'")
        if self.compression.name != "none":
            fail(f"{self.KEY}.compression.name", self.compression.name,
                  "the compressors are written for all_reduce buckets; with strategy.sync.reduce=reduce_scatter"
                  " allowed: 'none'")
        if self.sync.reduce_dtype != "fp32":
            fail(f"{self.KEY}.sync.reduce_dtype", self.sync.reduce_dtype,
                  "reduce_scatter reduces the parameters' own buckets; with strategy.sync.reduce=reduce_scatter"
                  " allowed: 'fp32'")
        if self.embedding.shard is True:
            fail(f"{self.KEY}.embedding.shard", self.embedding.shard,
                  "reduce_scatter already splits every parameter's optimizer state, embeddings included;"
                  " allowed with it: 'auto' (off) or false")

    @classmethod
    def from_dict(cls, data: Any) -> StrategyConfig:
        return section_from_dict(cls, data)
