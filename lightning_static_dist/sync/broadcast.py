"""Broadcasting parameters and buffers from rank 0, coalesced into one flat tensor per dtype and device.

At setup every rank must start from rank 0's weights, and before every training forward the buffers (BatchNorm
running statistics ...) are taken from rank 0, like DDP's ``broadcast_buffers``: one collective per dtype and device
(why: docs/internals.md, "sync/broadcast.py").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.agreement.fingerprint import check_same_on_all_ranks, describe_parameters


def broadcast_tensors(tensors: Iterable[Tensor], group: Optional[dist.ProcessGroup] = None, src: int = 0) -> int:
    """Overwrite ``tensors`` on every rank with the values of global rank ``src``; return the bytes broadcast.

    Example::

        broadcast_tensors(list(model.parameters()) + list(model.buffers()))
    """
    if dist.get_world_size(group) == 1:
        return 0
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        by_kind[(tensor.dtype, tensor.device)].append(tensor)
    sent = 0
    for kind in sorted(by_kind, key=str):  # the same order on every rank
        group_tensors = by_kind[kind]
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in group_tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        sent += flat.numel() * flat.element_size()
    return sent


def start_from_rank_zero(module: torch.nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Check that every rank holds the same parameters (a rank with another model would pair its broadcasts and
    buckets with the wrong tensors: it stops here), then give every rank rank 0's weights and buffers, whatever its
    own initialisation drew. Collective."""
    check_same_on_all_ranks("the model's parameters", describe_parameters(module), group)
    broadcast_tensors(list(module.parameters()) + list(module.buffers()), group=group)


def broadcast_buffers(buffers: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Rank 0's module buffers (BatchNorm statistics ...) to every rank before a training forward
    (``strategy.sync.broadcast_buffers``). Collective."""
    with waiting_in("the broadcast of module buffers"):
        broadcast_tensors(buffers, group=group)
