"""GradientSynchronization chooses how a fit averages once, from the config and the mesh; no processes needed for
the choice (the view below is the strategy's configuration and world, nothing collective)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.participants.embeddings import EmbeddingShards
from lightning_static_dist.participants.gradients import GradientSynchronization
from lightning_static_dist.participants.recording import PhaseRecording
from lightning_static_dist.strategy_config import StrategyConfig


def participant(sync: dict, world_size: int, reduce_scatter: bool) -> GradientSynchronization:
    view = SimpleNamespace(config=StrategyConfig.from_dict({"sync": sync}), world_size=world_size,
                           reduce_scatter=lambda: reduce_scatter)
    recording = PhaseRecording()
    return GradientSynchronization(view, StaticCompile(view), EmbeddingShards(view, recording), recording)


@pytest.mark.parametrize(("sync", "world_size", "reduce_scatter", "fitting", "mode"), [
    ({}, 2, False, True, "hooks"),
    ({"mode": "graph"}, 2, False, True, "graph"),
    ({"reduce": "reduce_scatter"}, 2, True, True, "sharded"),
    ({"reduce": "auto"}, 2, True, True, "sharded"),  # auto on a mesh with dp_shard > 1
    ({}, 1, False, True, None),  # one rank: nothing to average
    ({}, 2, False, False, None),  # validate, test, predict
])
def test_the_mode_is_chosen_from_the_config_and_the_world(sync: dict, world_size: int, reduce_scatter: bool,
                                                          fitting: bool, mode: object) -> None:
    context = SimpleNamespace(fitting=fitting)
    assert participant(sync, world_size, reduce_scatter).choose_mode(context) == mode
