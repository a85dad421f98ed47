"""The step plan: the ``strategy`` block resolved once for the world that started (``resolve_plan``), on real Gloo
ranks with real meshes; and a default changed in a config dataclass reaching the step with no other edit."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
from typing import Any

import pytest
import torch
from _dist import run_ranks

from lightning_static_dist.mesh import MeshConfig, build_dp_mesh
from lightning_static_dist.plan.step_plan import StepPlan, resolve_plan
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.sync.config import SyncConfig
from lightning_static_dist.sync.plan import BucketCapacity

from tests.participants._view import Context, gradient_participant


def _summary(plan: StepPlan) -> dict[str, Any]:
    sync = plan.sync
    return {"mode": sync.mode, "scatter": sync.reduce_by_scatter, "schedule": sync.schedule,
            "launch": sync.launch_during_backward, "cut": plan.compile.cut, "capacity": sync.capacity,
            "embeddings": plan.embedding.on, "line": sync.schedule_line, "reduce_dtype": sync.torch_reduce_dtype}


def _plans(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    replicated = build_dp_mesh("cpu", MeshConfig())  # (collective: every rank builds each mesh)
    sharded = build_dp_mesh("cpu", MeshConfig(dp_shard=2))
    default = StrategyConfig()
    found["cpu"] = _summary(resolve_plan(default, world_size=world, device_type="cpu", num_nodes=1, mesh=replicated))
    # the world's device type decides whether measured is probed (left pending here without a GPU: nothing runs on one)
    found["gpus"] = _summary(resolve_plan(default, world_size=world, device_type="cuda", num_nodes=1, mesh=replicated))
    found["nodes"] = _summary(resolve_plan(default, world_size=world, device_type="cuda", num_nodes=2, mesh=replicated))
    shard_embeddings = StrategyConfig.from_dict({"mesh": {"dp_shard": 2}, "embedding": {"shard": "auto"},
                                                 "sync": {"reduce_dtype": "fp32"}})
    found["sharded"] = _summary(resolve_plan(shard_embeddings, world_size=world, device_type="cpu", num_nodes=1,
                                             mesh=sharded))
    bf16 = StrategyConfig.from_dict({"sync": {"reduce_dtype": "bf16", "schedule": "after_backward"}})
    found["bf16"] = _summary(resolve_plan(bf16, world_size=world, device_type="cpu", num_nodes=1, mesh=replicated))
    found["one_rank"] = _summary(resolve_plan(default, world_size=1, device_type="cpu", num_nodes=1, mesh=None))
    return found


@pytest.fixture(scope="module")
def plans() -> list[dict[str, Any]]:
    return run_ranks(_plans, world_size=2, timeout=120)


@pytest.mark.multiprocess
def test_measured_is_resolved_for_the_world_or_left_pending_for_the_probe(plans: list[dict[str, Any]]) -> None:
    capacity = SyncConfig().capacity
    for r in plans:
        assert r["cpu"] == {"mode": "hooks", "scatter": False, "schedule": "overlap", "launch": True, "cut": capacity, "capacity": capacity, "embeddings": False,
                            "line": "sync.schedule measured: overlap (CPU ranks: Gloo shares the cores with the step;"
                                    " sync.probe=true measures them)", "reduce_dtype": None}
        # GPUs: pending until the probe at setup settles it, and no cut until then
        for where in ("gpus", "nodes"):
            assert (r[where]["schedule"], r[where]["cut"], r[where]["line"]) == ("measured", None, None)


@pytest.mark.multiprocess
def test_the_mesh_decides_the_reduce_path_and_what_follows_from_it(plans: list[dict[str, Any]]) -> None:
    for r in plans:
        # reduce auto on a mesh with dp_shard > 1: reduce_scatter, which shards the embeddings' state already and
        # compiles without the bucket cut (its gathers follow the blocks)
        assert {k: r["sharded"][k] for k in ("mode", "scatter", "embeddings", "cut", "schedule")} == {
            "mode": "sharded", "scatter": True, "embeddings": False, "cut": None, "schedule": "overlap"}
        assert (r["bf16"]["reduce_dtype"], r["bf16"]["line"], r["bf16"]["launch"]) == (torch.bfloat16, None, False)
        assert (r["one_rank"]["mode"], r["one_rank"]["cut"]) == (None, None)  # one rank: nothing to average or cut


def test_the_plan_is_frozen() -> None:
    plan = resolve_plan(StrategyConfig(), world_size=2, device_type="cpu", num_nodes=1, mesh=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sync = plan.sync  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sync.schedule = "after_backward"  # type: ignore[misc]


def _set_defaults(cls: type, **values: Any) -> None:
    """``cls``'s constructor defaults changed, as an edit of the dataclass's field defaults changes them."""
    names = [p.name for p in inspect.signature(cls.__init__).parameters.values() if p.default is not p.empty]
    cls.__init__.__defaults__ = tuple(values.get(n, d) for n, d in zip(names, cls.__init__.__defaults__))


def _a_fit_with_defaults(rank: int, world: int, defaults: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from lightning_static_dist.participants.compression_state import CompressionState

    for cls in (SyncConfig, CompressionConfig, CompileConfig):  # (this rank's own process: nothing else is edited)
        _set_defaults(cls, **defaults.get(cls.__name__, {}))
    model, view, gradients = gradient_participant({})
    compression = CompressionState(view, gradients)
    context = view.enter(Context())
    gradients.setup(context)
    compression.setup(context)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        model.training_step((x, torch.zeros(4, 1)), step).backward()
        gradients.finish_gradients(accumulating=False)
    sync = gradients.synchronizer
    found = {"capacity": sync.capacity, "buckets": len(sync.plan.buckets), "launch": sync.schedule.launch_during_backward,
             "cut": view.plan.compile.cut, "reducer": type(sync.reducer).__name__,
             "compressor": compression.reducer.compressor.name if compression.reducer is not None else None,
             "bytes": sync.stats.bytes_sent}
    gradients.teardown(failed=False)
    return found


@pytest.mark.multiprocess
def test_a_default_changed_in_the_config_dataclass_changes_the_step_with_no_other_edit() -> None:
    as_shipped = run_ranks(_a_fit_with_defaults, world_size=2, args=({},), timeout=120)
    small = {"bucket_mb": 100 / 2**20, "first_bucket_mb": 100 / 2**20, "schedule": "after_backward"}
    changed = run_ranks(_a_fit_with_defaults, world_size=2, args=({"SyncConfig": small},), timeout=120)
    for shipped, edited in zip(as_shipped, changed):
        assert shipped["capacity"] == SyncConfig().capacity and shipped["buckets"] == 1  # 644 bytes of gradients
        assert (shipped["launch"], shipped["cut"]) == (True, SyncConfig().capacity)  # measured on CPUs: overlap
        assert edited["capacity"] == BucketCapacity(100, 100) and edited["buckets"] > 1
        assert (edited["launch"], edited["cut"]) == (False, None)  # after_backward: issued once backward ends, uncut


@pytest.mark.multiprocess
def test_a_default_changed_in_another_features_dataclass_reaches_its_plan_and_the_step() -> None:
    as_shipped = run_ranks(_a_fit_with_defaults, world_size=2, args=({},), timeout=120)
    changed = run_ranks(_a_fit_with_defaults, world_size=2,
                        args=({"CompressionConfig": {"name": "bf16", "min_numel": 1},
                               "CompileConfig": {"regional": False}},), timeout=120)
    for shipped, edited in zip(as_shipped, changed):
        assert (shipped["reducer"], shipped["compressor"]) == ("MeanAllReduce", None)
        assert (edited["reducer"], edited["compressor"]) == ("CompressingReducer", "bf16")
        assert edited["bytes"] < shipped["bytes"]  # bf16 on the wire: fewer bytes for the same rounds
        assert shipped["cut"] is not None and edited["cut"] is None  # compile.regional false: the step is never cut


# ---------------------------------------------------------------- participants read the plan, never a config section

CONFIG_CLASSES = {"StrategyConfig", "SyncConfig", "CompileConfig", "CompressionConfig", "EmbeddingConfig",
                  "CheckpointConfig", "MeshConfig"}
#: the names the strategy block is held under (``strategy.config``, the world's ``_config``, ``_asked``).
#: ``SimulateConfig`` is not among the sections forbidden: the offer gives it to users as it is (``simulation``),
#: and ``RanksView.simulation`` hands participants that same object
CONFIG_HOLDERS = {"config", "_config", "_asked"}


def _config_reads(source: str) -> list[str]:
    """Where ``source`` reads a config section: an import of a section's class or of the strategy block's module, or
    any ``.config`` attribute (``view.config.sync``, ``strategy.config``, a participant's ``config()``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names}
            if names & CONFIG_CLASSES or (node.module or "").endswith("plan.strategy_config") or (
                    "strategy_config" in names):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.endswith("strategy_config")
                      or a.name.rsplit(".", 1)[-1] == "config"]
        elif isinstance(node, ast.Attribute) and node.attr in CONFIG_HOLDERS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in CONFIG_HOLDERS):
            found.append(f"line {node.lineno}: getattr(..., {node.args[1].value!r})")
    return sorted(found, key=lambda line: int(line.split()[1].rstrip(":")))


def test_no_participant_reads_a_config_section() -> None:
    import lightning_static_dist.participants as participants

    folder = pathlib.Path(participants.__file__).parent
    reads = {path.name: _config_reads(path.read_text()) for path in sorted(folder.glob("*.py"))}
    assert {name: found for name, found in reads.items() if found} == {}
    # the check itself finds what it forbids
    assert _config_reads("from lightning_static_dist.sync.config import SyncConfig\nview.config.sync.bucket_mb") == [
        "line 1: from lightning_static_dist.sync.config import SyncConfig", "line 2: .config"]
    assert _config_reads("import lightning_static_dist.plan.strategy_config as sc\ngetattr(view, 'config').sync\n"
                         "self._view._world._asked") == [
        "line 1: import lightning_static_dist.plan.strategy_config", "line 2: getattr(..., 'config')",
        "line 3: ._asked"]


def _sections(value: Any, path: str) -> list[str]:
    """Every config dataclass held anywhere in ``value`` (a plan, its feature plans, their fields)."""
    if type(value).__name__ in CONFIG_CLASSES:
        return [path]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [found for f in dataclasses.fields(value) for found in _sections(getattr(value, f.name), f"{path}.{f.name}")]
    return []


def test_the_plan_holds_decisions_not_config_sections() -> None:
    config = StrategyConfig.from_dict({"sync": {"schedule": "after_backward"}, "compression": {"name": "bf16"},
                                       "embedding": {"shard": "auto"}, "checkpoint": {"format": "sharded"}})
    plan = resolve_plan(config, world_size=2, device_type="cpu", num_nodes=1, mesh=None)
    assert _sections(plan, "plan") == []
    assert [type(getattr(plan, name)).__name__ for name in ("sync", "compile", "compression", "embedding", "checkpoint")] \
        == ["SyncPlan", "CompilePlan", "CompressionPlan", "EmbeddingPlan", "CheckpointPlan"]
    assert _sections(dataclasses.replace(plan, sync=config.sync), "plan") == ["plan.sync"]  # (the check finds one)
