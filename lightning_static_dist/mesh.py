"""The data-parallel ``DeviceMesh``, decided when the job starts, never when a graph is compiled.

:func:`resolve_mesh_shape` is pure and also runs in the launching process, so a shape that does not fit the world
fails before any rank starts; :func:`check_topology` checks what every rank reported about itself;
:func:`build_dp_mesh` builds the ``(dp_replicate, dp_shard)`` mesh over the default process group. Shard groups are
neighbouring ranks, where the fast intra-node links are.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_static_dist.config.check import ConfigError, check_fields, fail
from lightning_static_dist.wording import counted

log = logging.getLogger(__name__)

#: Names of the mesh dimensions: replica groups (all-reduce across them) and shard groups (reduce-scatter inside).
REPLICATE_DIM = "dp_replicate"
SHARD_DIM = "dp_shard"


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


class TopologyError(RuntimeError):
    """The ranks that started cannot form the configured mesh (raised identically on every rank)."""


def resolve_mesh_shape(config: MeshConfig, world_size: int) -> tuple[int, int]:
    """Return ``(dp_replicate, dp_shard)`` for ``world_size`` ranks, inferring a ``-1``.

    Example::

        >>> resolve_mesh_shape(MeshConfig(dp_replicate=-1, dp_shard=1), 4)
        (4, 1)

    Raises:
        ConfigError: the shape does not divide or does not match the world size.
    """
    replicate, shard = config.dp_replicate, config.dp_shard
    if replicate == -1:
        if world_size % shard:
            raise ConfigError(f"strategy.mesh.dp_shard={shard}: does not divide the world size {world_size}")
        replicate = world_size // shard
    elif shard == -1:
        if world_size % replicate:
            raise ConfigError(f"strategy.mesh.dp_replicate={replicate}: does not divide the world size {world_size}")
        shard = world_size // replicate
    if replicate * shard != world_size:
        raise ConfigError(
            f"strategy.mesh: dp_replicate={replicate} x dp_shard={shard} = {replicate * shard}"
            f" does not match the world size {world_size}; use -1 to infer one of them"
        )
    return replicate, shard


@dataclass(frozen=True)
class RankPlace:
    """What a rank reports about itself at start-up."""

    device_type: str
    host: str


def local_place(device_type: str) -> RankPlace:
    return RankPlace(device_type=device_type, host=socket.gethostname())


def check_topology(places: Sequence[RankPlace], replicate: int, shard: int, shard_across_nodes: bool) -> None:
    """Raise :class:`TopologyError` (one line listing what each rank has) if the ranks cannot form the mesh.

    Example::

        >>> check_topology([RankPlace("cuda", "a"), RankPlace("cpu", "a")], 1, 2, False)
        Traceback (most recent call last):
        TopologyError: static_dist: ranks have different device types — rank 0: cuda on a; rank 1: cpu on a ...
    """
    def listing(ranks: Sequence[int]) -> str:
        return "; ".join(f"rank {r}: {places[r].device_type} on {places[r].host}" for r in ranks)

    if len(places) != replicate * shard:
        raise TopologyError(f"static_dist: {counted(len(places), 'rank')} reported, the mesh {replicate} x {shard} needs"
                            f" {replicate * shard}")
    if len({p.device_type for p in places}) > 1:
        raise TopologyError(f"static_dist: ranks have different device types — {listing(range(len(places)))};"
                            " every rank must use the same accelerator")
    if shard_across_nodes:
        return
    for r in range(replicate):
        ranks = range(r * shard, (r + 1) * shard)
        if len({places[i].host for i in ranks}) > 1:
            raise TopologyError(
                f"static_dist: strategy.mesh.dp_shard={shard}: shard group {r} spans several hosts — {listing(ranks)};"
                " make dp_shard divide the ranks per node, or set strategy.mesh.shard_across_nodes=true"
            )


def build_dp_mesh(device_type: str, config: MeshConfig) -> DeviceMesh:
    """Check the ranks' topology, then build the ``(dp_replicate, dp_shard)`` mesh over the default process group.

    Collective: every rank calls it. The whole world is the data-parallel group (``dist.group.WORLD``); the mesh
    adds one group per dimension slice.

    Example::

        mesh = build_dp_mesh("cpu", MeshConfig(dp_shard=2))
        shard_group = mesh.get_group(SHARD_DIM)
    """
    world_size = dist.get_world_size()
    replicate, shard = resolve_mesh_shape(config, world_size)
    places: list[RankPlace] = [local_place(device_type)] * world_size
    if world_size > 1:
        dist.all_gather_object(places, local_place(device_type))
    check_topology(places, replicate, shard, config.shard_across_nodes)
    log.debug(f"building a {replicate} x {shard} mesh of {world_size} {device_type} ranks")
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def reduces_by_scatter(reduce: str, mesh: Optional[DeviceMesh], world_size: int) -> bool:
    """``strategy.sync.reduce`` resolved against the mesh that started (``auto``: reduce_scatter if dp_shard > 1).

    Example::

        reduces_by_scatter("auto", build_dp_mesh("cpu", MeshConfig(dp_shard=2)), world_size=2)   # True
    """
    if reduce == "auto":
        return mesh is not None and mesh.size(1) > 1
    return reduce == "reduce_scatter" and world_size > 1
