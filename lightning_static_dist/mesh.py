"""The data-parallel ``DeviceMesh``, decided when the job starts — never when a graph is compiled.

The mesh shape comes from ``strategy.mesh`` (``dp_replicate x dp_shard``) and the world that actually started.
:func:`resolve_mesh_shape` is the pure part (tested without processes); :func:`build_dp_mesh` builds the mesh
over the already-initialised default process group.

So far only replication is implemented: the mesh is 1-D with the single dimension ``dp`` covering the world, and
its group is the default process group (a 1-D mesh over the whole world creates no new communicator).
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_static_dist.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

#: Name of the data-parallel mesh dimension the gradient synchroniser reduces over.
DP_DIM = "dp"


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


def build_dp_mesh(device_type: str, config: MeshConfig) -> DeviceMesh:
    """Build the data-parallel mesh over the initialised default process group.

    Example::

        mesh = build_dp_mesh("cpu", MeshConfig())
        group = mesh.get_group(DP_DIM)
    """
    world_size = dist.get_world_size()
    replicate, shard = resolve_mesh_shape(config, world_size)
    log.debug(f"building a {DP_DIM} mesh of {world_size} {device_type} ranks ({replicate} x {shard})")
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=(DP_DIM,))
