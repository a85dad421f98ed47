"""GradientAveraging chooses how a fit averages once, from the step plan: the config resolved for the world and
the mesh by the same ``resolve_plan`` the front ends run (a real mesh on real Gloo ranks where the mesh decides)."""

from __future__ import annotations

from typing import Any, Optional

import pytest
from _dist import run_ranks


from lightning_static_dist.mesh import MeshConfig, build_dp_mesh
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.gradients import GradientAveraging
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.plan.strategy_config import StrategyConfig

from ._view import Context, Regression, View


class _World(View):
    """The view of a world of ``world_size`` ranks (no process group needed for the choice: nothing collective)."""

    def __init__(self, config: StrategyConfig, world_size: Optional[int] = None, mesh: Any = None) -> None:
        super().__init__(Regression(), config, mesh=mesh)
        self._world_size = world_size

    @property
    def world_size(self) -> int:
        return self._world_size if self._world_size is not None else super().world_size


def participant(view: View) -> GradientAveraging:
    recording = PhaseRecording()
    return GradientAveraging(view, StaticCompile(view), EmbeddingShards(view, recording), recording)


@pytest.mark.parametrize(("sync", "world_size", "fitting", "mode"), [
    ({}, 2, True, "hooks"),
    ({"mode": "graph"}, 2, True, "graph"),
    ({"reduce": "reduce_scatter"}, 2, True, "sharded"),
    ({"reduce": "auto"}, 2, True, "hooks"),  # auto without a mesh that shards: all_reduce
    ({}, 1, True, None),  # one rank: nothing to average
    ({"reduce": "reduce_scatter"}, 1, True, None),
    ({}, 2, False, None),  # validate, test, predict
])
def test_the_mode_is_chosen_from_the_config_and_the_world(sync: dict, world_size: int, fitting: bool,
                                                          mode: object) -> None:
    view = _World(StrategyConfig.from_dict({"sync": sync}), world_size)
    assert participant(view).choose_mode(Context(fitting=fitting)) == mode


def _modes_on_a_mesh(rank: int, world: int) -> dict[str, Any]:
    found = {}
    for name, dp_shard, reduce in (("shard", 2, "auto"), ("replicate", 1, "auto"), ("forced", 1, "reduce_scatter")):
        config = StrategyConfig.from_dict({"mesh": {"dp_shard": dp_shard}, "sync": {"reduce": reduce}})
        mesh = build_dp_mesh("cpu", MeshConfig(dp_shard=dp_shard))  # (collective: every rank builds it)
        found[name] = participant(_World(config, mesh=mesh)).choose_mode(Context())
    return found


@pytest.mark.multiprocess
def test_reduce_auto_is_resolved_against_the_mesh_that_started() -> None:
    for r in run_ranks(_modes_on_a_mesh, world_size=2, timeout=90):
        # auto: reduce_scatter on a mesh with dp_shard > 1, all_reduce on a replicated one; asked for, it shards
        assert r == {"shard": "sharded", "replicate": "hooks", "forced": "sharded"}
