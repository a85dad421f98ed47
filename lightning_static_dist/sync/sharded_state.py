"""The optimizer state of ``sync.reduce: reduce_scatter`` in the forms checkpoints hold it.

The optimizer steps this rank's *pieces* (:mod:`~lightning_static_dist.sync.shard_layout`): flat ranges of the
buckets. A checkpoint speaks of the model's original parameters instead, so that it resumes at any world size or mesh
and a plain Lightning run loads it: either the *full* form an unsharded optimizer would write (gathered over the
shard group at save, cut again at load), or each rank's own ranges of the flattened original parameters (a sharded
checkpoint, :mod:`~lightning_static_dist.checkpoint`). This module translates between the pieces and those forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_static_dist.checkpoint import FullSource, PieceSource, full_state_from_pieces, range_key, scalar_key
from lightning_static_dist.simulate import is_simulated
from lightning_static_dist.sync.shard_layout import NOT_OPTIMIZED, BucketShard, Piece, overlaps


class OptimizerStateShard:
    """This rank's share of the optimizer state, read and written in the original parameters' coordinates.

    Args:
        optimizer: the optimizer; its param groups hold the pieces once the synchroniser re-pointed them.
        original_groups: the optimizer's own parameters per param group, as it was given them.
        shards: this rank's bucket shards (the list is read at each call: emptied, it frees what they hold).
        params: the synchronised parameters, in the order the buckets' ``param_indices`` index.
        shard_group: the ``dp_shard`` group whose ranks hold the other pieces.

    Example::

        state = OptimizerStateShard(optimizer, original_groups, shards, params, shard_group)
        full = state.full_optimizer_state()          # collective over the shard group; what torch would save
        state.load_full_optimizer_state(full)        # cut this rank's pieces out again
    """

    def __init__(self, optimizer: torch.optim.Optimizer, original_groups: Sequence[Sequence[Parameter]],
                 shards: Sequence[BucketShard], params: Sequence[Parameter],
                 shard_group: Optional[dist.ProcessGroup]) -> None:
        self.optimizer = optimizer
        self.original_groups = original_groups
        self.shards = shards
        self._params = params
        self._shard_group = shard_group
        self._shard_size = dist.get_world_size(shard_group)
        self._original_index = {id(p): i for i, p in enumerate(p for params in self.original_groups for p in params)}
        """id(parameter) -> its index in the optimizer's own numbering (what a full-form state dict is keyed by)."""

    def full_optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` as an unsharded optimizer over the original parameters would give it.

        Every rank of the shard group contributes its :meth:`piece_tensors` (replica groups hold the same ones) and
        the whole is assembled the way a sharded checkpoint is consolidated. Collective over the shard group (every
        rank of it calls this: Lightning dumps checkpoints on every rank); the state comes back on the CPU.
        """
        pieces = {name: t.detach().to("cpu", copy=True) for name, t in self.piece_tensors().items()}
        simulated = is_simulated(self._shard_group)  # the other ranks' pieces are nowhere: their ranges read as zeros
        if self._shard_size > 1 and not simulated:
            everyone: list[Any] = [None] * self._shard_size
            dist.all_gather_object(everyone, pieces, group=self._shard_group)
            pieces = {name: t for rank in everyone for name, t in rank.items()}
        state = full_state_from_pieces(PieceSource(pieces, missing_as_zeros=simulated), self.original_shapes())
        return {"state": state, "param_groups": self.full_param_groups()}

    def load_full_optimizer_state(self, full: dict[str, Any]) -> None:
        """Load a full-form optimizer state (any world size or mesh wrote it, or an unsharded run): cut this rank's
        pieces out of it."""
        numels = {i: p.numel() for i, p in enumerate(self.originals())}
        self.load_optimizer_state(FullSource(full["state"], numels), full["param_groups"])

    def load_optimizer_state(self, source: Any, param_groups: list[dict[str, Any]]) -> None:
        """Cut this rank's pieces out of ``source`` (a :class:`~lightning_static_dist.checkpoint.FullSource` or
        :class:`~lightning_static_dist.checkpoint.PieceSource`) and load them with the saved group options."""
        if len(param_groups) != len(self.original_groups):
            raise ValueError(f"static_dist: the checkpoint's optimizer has {len(param_groups)} param groups,"
                             f" this one {len(self.original_groups)}")
        owner = {id(piece.param): (shard, piece) for shard in self.shards for piece in shard.pieces}
        piece_state: dict[int, dict[str, Any]] = {}
        flat_index = 0
        groups = []
        for g, group in enumerate(self.optimizer.param_groups):
            ids = []
            for param in group["params"]:
                shard, piece = owner[id(param)]
                entry = self._cut_piece(shard, piece, source)
                if entry:
                    piece_state[flat_index] = entry
                ids.append(flat_index)
                flat_index += 1
            options = {k: v for k, v in param_groups[g].items() if k != "params"}
            groups.append({**options, "params": ids})
        self.optimizer.load_state_dict({"state": piece_state, "param_groups": groups})

    def _cut_piece(self, shard: BucketShard, piece: Piece, source: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        for param, offset, lo, hi in overlaps(shard, piece, self._params):
            i = self._original_index[id(param)]
            for key, elementwise in source.keys(i).items():
                if not elementwise:
                    entry.setdefault(key, source.scalar(i, key))
                    continue
                values = source.elements(i, key, lo - offset, hi - offset)
                if key not in entry:
                    entry[key] = torch.zeros(piece.end - piece.start, dtype=values.dtype, device=piece.param.device)
                entry[key][lo - piece.start : hi - piece.start].copy_(values)
        return entry

    def originals(self) -> list[Parameter]:
        """The optimizer's original parameters, in its own numbering."""
        return [p for params in self.original_groups for p in params]

    def wanted_ranges(self) -> list[tuple[int, int, int]]:
        """``(original parameter index, lo, hi)`` of every element this rank's optimizer state covers."""
        index = self._original_index
        return [(index[id(param)], lo - offset, hi - offset)
                for shard in self.shards for piece in shard.pieces if piece.group != NOT_OPTIMIZED
                for param, offset, lo, hi in overlaps(shard, piece, self._params)]

    def piece_tensors(self) -> dict[str, Tensor]:
        """This rank's optimizer state as ranges of the flattened original parameters (for a sharded checkpoint)."""
        index = self._original_index
        out: dict[str, Tensor] = {}
        for shard in self.shards:
            for piece in shard.pieces:
                state = self.optimizer.state.get(piece.param) if piece.group != NOT_OPTIMIZED else None
                for param, offset, lo, hi in overlaps(shard, piece, self._params) if state else ():
                    i = index[id(param)]
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece.param.numel():
                            out[range_key(i, key, lo - offset, hi - offset)] = value[lo - piece.start : hi - piece.start]
                        else:
                            out[scalar_key(i, key)] = value if torch.is_tensor(value) else torch.tensor(value)
        return out

    def full_param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups in full form: options, and the original parameters' indices."""
        index = self._original_index
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in params]}
                for group, params in zip(self.optimizer.param_groups, self.original_groups)]

    def original_shapes(self) -> dict[int, torch.Size]:
        return {i: p.shape for i, p in enumerate(self.originals())}
