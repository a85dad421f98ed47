"""The data-parallel mesh (``strategy.mesh``, :mod:`lightning_static_dist.mesh`): its shape from the world, the
mesh and reduce-primitive config errors, and the topology every rank reports — each checked before any rank trains."""

from __future__ import annotations

from typing import Any

import pytest

import lightning as L
from _configs import assert_one_line_naming
from _mesh_fit import static, tiny_gpt
from lightning_static_dist.config import ConfigError
from lightning_static_dist.mesh import MeshConfig
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.examples.charlm import CharDataModule
from lightning_static_dist.mesh import RankPlace, TopologyError, check_topology, resolve_mesh_shape


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


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("section", "key", "fragment"),
    [
        ({"mesh": {"dp_shard": 0}}, "strategy.mesh.dp_shard", "-1 (infer) or an integer >= 1"),
        ({"mesh": {"dp_replicate": -1, "dp_shard": -1}}, "strategy.mesh.dp_shard", "at most one"),
        ({"mesh": {"dp_shard": 2}, "sync": {"mode": "graph"}}, "strategy.sync.reduce", "graph mode"),
        ({"mesh": {"dp_replicate": 2, "dp_shard": -1}, "sync": {"mode": "graph"}}, "strategy.sync.reduce", "graph mode"),
        ({"mesh": {"dp_shard": 2}, "compression": {"name": "powersgd"}}, "strategy.compression.name", "all_reduce"),
        ({"sync": {"reduce": "reduce_scatter"}, "embedding": {"shard": True}}, "strategy.embedding.shard", "already"),
        ({"sync": {"reduce": "scatter"}}, "strategy.sync.reduce", "reduce_scatter"),
    ],
    ids=["zero", "both-inferred", "graph-mode", "graph-mode-inferred-shard", "compression", "embedding",
         "unknown-primitive"],
)
def test_bad_mesh_configs_name_the_key(section: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StrategyConfig.from_dict(section)
    message = str(excinfo.value)
    assert "\n" not in message and key in message and fragment in message


def test_mesh_that_does_not_fit_the_world_fails_before_any_rank_starts() -> None:
    with pytest.raises(ConfigError, match=r"strategy.mesh: dp_replicate=3 x dp_shard=1 = 3 does not match the world"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=static(3, 1), logger=False, enable_progress_bar=False)
        trainer.fit(tiny_gpt(), datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=4_000))


def test_topology_errors_list_what_each_rank_has() -> None:
    same = [RankPlace("cpu", "a")] * 4
    check_topology(same, 2, 2, shard_across_nodes=False)
    with pytest.raises(TopologyError, match=r"different device types — rank 0: cuda on a; rank 1: cpu on a"):
        check_topology([RankPlace("cuda", "a"), RankPlace("cpu", "a")], 1, 2, False)
    split = [RankPlace("cpu", "a"), RankPlace("cpu", "a"), RankPlace("cpu", "b"), RankPlace("cpu", "b")]
    check_topology(split, 2, 2, False)  # each shard group on one host
    with pytest.raises(TopologyError, match=r"dp_shard=4: shard group 0 spans several hosts .*rank 2: cpu on b"):
        check_topology(split, 1, 4, False)
    check_topology(split, 1, 4, shard_across_nodes=True)
